"""What users run around training: the CLI, the planner, the margin tuner, reports.

- ``cli``: python -m gemini
- ``planner``: plan_placement, a placement judged before any step
- ``forecast``: the planner's questions answered per placement, one class each
- ``meta_run``: one forward and backward on the meta device, for the planner
- ``meta_replay``: the warm-up's chunk visits replayed beside it
- ``meta_attention``: attention charged there as the configured device runs it
- ``meta_offload``: offload_activations there, as the engine offloads
- ``meta_device``: kernels whose outputs differ on the configured device
- ``tune``: tune_margin
- ``summary``: one-line summaries of reports
- ``plots``: memory and timeline plots
- ``loop``: the plain training loop the tools time
- ``gpt``: the demo GPT the examples and tools use
"""

__all__ = ["cli", "forecast", "gpt", "loop", "meta_attention", "meta_device", "meta_offload", "meta_replay", "meta_run",
           "planner", "plots", "summary", "tune"]
