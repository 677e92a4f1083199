"""What users run around training: the CLI, the planner, the margin tuner, reports.

- ``cli``: python -m gemini
- ``planner``: plan_placement, a placement judged before any step
- ``forecast``: the planner's questions answered per placement, one class each
- ``meta_run``: the warm-up replayed on the meta device
- ``tune``: tune_margin
- ``summary``: one-line summaries of reports
- ``plots``: memory and timeline plots
- ``loop``: the plain training loop the tools time
- ``gpt``: the demo GPT the examples and tools use
"""

__all__ = ["cli", "forecast", "gpt", "loop", "meta_run", "planner", "plots", "summary", "tune"]
