"""Command line: ``python -m gemini`` (and the ``gemini`` console script).

Commands: ``demo`` (a GPT several times the device budget, trained with per-step reports),
``train`` (a GPT of a chosen size under any placement and budgets), ``tune-margin`` (the
margin tuner), ``report`` (summarise and plot a JSON Lines file of reports) and ``plan``
(before training: whether a model fits and where its bytes will go).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

from gemini.config import PLACEMENTS, PRECISIONS, GeminiConfig
from gemini.gpt import GPT, GPTConfig, synthetic_batch
from gemini.initialize import initialize
from gemini.loop import StepResult, train_steps
from gemini.memory import DeviceBudgetError
from gemini.planner import plan_placement
from gemini.report import MemoryReport, WarmupTimeline, read_reports
from gemini.summary import UNITS, readable_unit, run_summary, summary_line
from gemini.tune import DEFAULT_RATIOS, MarginTrial, tune_margin
from offload import format_size

__all__ = ["build_parser", "main"]

# The demo's model on a 2-core CPU: 19.5M parameters (305 MiB of model data), a step in a
# fraction of a second under a budget a quarter of that; its activations (batch 2 x 32 tokens,
# under 20 MiB) leave room in that budget for the chunks being computed with.
_DEMO_MODEL = dict(layers=6, embd=512, heads=8, vocab=1024, seq=32, batch=2)
_TRAIN_MODEL = dict(layers=4, embd=256, heads=4, vocab=4096, seq=128, batch=8)


# ----------------------------------------------------------------------------- arguments
def _add_model_args(p: argparse.ArgumentParser, defaults: dict[str, int], *, batch: bool = True) -> None:
    g = p.add_argument_group("model (a nanoGPT-style GPT on synthetic tokens)")
    g.add_argument("--layers", type=int, default=defaults["layers"])
    g.add_argument("--embd", type=int, default=defaults["embd"], help="width")
    g.add_argument("--heads", type=int, default=defaults["heads"])
    g.add_argument("--vocab", type=int, default=defaults["vocab"])
    g.add_argument("--seq", type=int, default=defaults["seq"], help="sequence length (and block size)")
    if batch:
        g.add_argument("--batch", type=int, default=defaults["batch"])
        g.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")


def _add_engine_args(p: argparse.ArgumentParser, *, placement: str | None, device: bool = True) -> None:
    g = p.add_argument_group("engine (GeminiConfig)")
    if device:
        g.add_argument("--device", choices=["cpu", "cuda"], default=None,
                       help="compute device (default: cuda if present; cpu stands in for an accelerator)")
    if placement is not None:
        g.add_argument("--placement", choices=PLACEMENTS, default=placement)
    g.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32")
    g.add_argument("--chunk-size", type=int, default=None, help="elements per chunk (default: searched)")
    g.add_argument("--device-memory", default=None, help="device budget, bytes or a size like 512MiB")
    g.add_argument("--cpu-memory", default=None, help="host budget for optimizer states; beyond it -> NVMe")
    g.add_argument("--nvme-dir", default=None, help="folder for NVMe-resident optimizer states")
    g.add_argument("--nvme-offload-fraction", type=float, default=0.0)
    g.add_argument("--nvme-pipeline-depth", type=int, default=2)
    g.add_argument("--static-param-device-fraction", type=float, default=1.0)
    g.add_argument("--static-optimizer-offload-fraction", type=float, default=0.0)


def _add_run_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=steps)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--report", default=None, help="write one MemoryReport per step to this JSON Lines file")
    g.add_argument("--plot-dir", default=None, help="write memory.png and timeline.png here (needs matplotlib)")
    g.add_argument("--quiet", action="store_true", help="no per-step lines, only the run's summary")
    g.add_argument("--unit", choices=tuple(UNITS), default=None, help="sizes in summaries (default: by scale)")


def _gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.embd, activation_checkpointing=getattr(args, "activation_checkpointing", False))


def _gemini_config(args: argparse.Namespace, **overrides) -> GeminiConfig:
    values = dict(
        device=getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu"),
        placement=getattr(args, "placement", "auto"), precision=args.precision, chunk_size=args.chunk_size,
        device_memory=args.device_memory, cpu_memory=args.cpu_memory, nvme_dir=args.nvme_dir,
        nvme_offload_fraction=args.nvme_offload_fraction, nvme_pipeline_depth=args.nvme_pipeline_depth,
        static_param_device_fraction=args.static_param_device_fraction,
        static_optimizer_offload_fraction=args.static_optimizer_offload_fraction,
        gpu_margin_mem_ratio=getattr(args, "gpu_margin_mem_ratio", 0.0), report_path=getattr(args, "report", None),
    )
    values.update(overrides)
    return GeminiConfig(**values)


def _seeded_gpt(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def _model_data_bytes(cfg: GPTConfig, args: argparse.Namespace) -> int:
    """Bytes of every chunk (parameters, gradients, Adam states) as the planner lays them out,
    for a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT(cfg)
    config = _gemini_config(args, device="cpu", placement="cpu", device_memory=None, cpu_memory=None,
                            nvme_dir=None, nvme_offload_fraction=0.0, gpu_margin_mem_ratio=0.0, report_path=None)
    plan = plan_placement(model, config)
    return sum(plan.tier_bytes(t) for t in plan.model_bytes_by_tier)


# ------------------------------------------------------------------------------ training
def _progress(total: int, *, quiet: bool, unit: str) -> Callable[[StepResult], None]:
    """Prints each step as it ends (and the warm-up's plan when a step carries one)."""

    def on_step(result: StepResult) -> None:
        r = result.report
        if not quiet:
            print(f"[{r.step + 1}/{total}] {summary_line(r, loss=result.loss, unit=unit)}", flush=True)
        if r.timeline is not None:
            print(_timeline_line(r.timeline, r), flush=True)

    return on_step


def _timeline_line(t: WarmupTimeline, r: MemoryReport) -> str:
    return (f"      warm-up traced {len(t.periods)} periods: "
            f"non-model peak up to {format_size(t.max_non_model_bytes)}, "
            f"reserve {format_size(t.reserve_bytes)}, margin {format_size(max(0, t.margin_bytes))} -> "
            f"{r.os_chunks_on_device} of {r.os_chunks_total} optimizer-state chunk groups on the device")


def _train(args: argparse.Namespace, cfg: GPTConfig, config: GeminiConfig) -> list[StepResult]:
    # One unit for the whole run, readable at its scale (MiB for a demo, GiB for a real model).
    unit = args.unit or readable_unit(config.device_memory or _model_data_bytes(cfg, args))[0]
    model = _seeded_gpt(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT: {n_params / 1e6:.2f}M parameters, {cfg.n_layer} layers, width {cfg.n_embd}, vocab {cfg.vocab_size}; "
          f"device={config.resolved_device()} placement={config.placement} precision={config.precision}", flush=True)
    gmodel, opt = initialize(model, config, lr=args.lr, weight_decay=0.1)
    try:
        mgr = opt._rt.manager
        print(f"chunks: {len(mgr.groups)} chunk groups of {mgr.chunk_size:,} elements "
              f"({mgr.waste_elements():,} elements of padding)", flush=True)
        x, y = synthetic_batch(cfg, args.batch, args.seq, generator=torch.Generator().manual_seed(1),
                               device=config.resolved_device())
        if config.placement == "auto" and not args.quiet:
            print(f"[1/{args.steps}] warm-up: tracing the first iteration ...", flush=True)
        start = time.perf_counter()
        # One batch, learned by heart: the loss visibly falls within a few steps.
        results = train_steps(gmodel, opt, lambda m: GPT.loss(m(x), y), steps=args.steps,
                              on_step=_progress(args.steps, quiet=args.quiet, unit=unit))
        elapsed = time.perf_counter() - start
    finally:
        opt.close()
    reports = [r.report for r in results]
    print(f"done: {len(results)} steps in {elapsed:.1f} s, loss {results[0].loss:.3f} -> {results[-1].loss:.3f}")
    print(run_summary(reports, unit=unit))
    if args.report:
        print(f"reports: {args.report}")
    if args.plot_dir:
        for path in _write_plots(reports, args.plot_dir):
            print(f"plot: {path}")
    return results


def _write_plots(reports: Sequence[MemoryReport], folder: str) -> list[str]:
    from gemini.plots import plot_memory, plot_timeline  # matplotlib is optional: only when asked

    paths = [str(plot_memory(reports, os.path.join(folder, "memory.png")))]
    timeline = next((r.timeline for r in reports if r.timeline is not None), None)
    if timeline is not None:
        paths.append(str(plot_timeline(timeline, os.path.join(folder, "timeline.png"))))
    return paths


# ------------------------------------------------------------------------------ commands
def cmd_demo(args: argparse.Namespace) -> int:
    cfg = _gpt_config(args)
    model_bytes = _model_data_bytes(cfg, args)
    budget = args.device_memory or int(model_bytes / args.model_to_budget)
    config = _gemini_config(args, placement="auto", device_memory=budget)
    print(f"gemini demo: a GPT whose model data (parameters, gradients, Adam states: {format_size(model_bytes)}) "
          f"is {model_bytes / config.device_memory:.1f}x the device budget ({format_size(config.device_memory)}); "
          f"placement auto: chunks move between the device and the host, within the budget", flush=True)
    _train(args, cfg, config)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _gpt_config(args)
    _train(args, cfg, _gemini_config(args))
    return 0


def cmd_tune_margin(args: argparse.Namespace) -> int:
    cfg = _gpt_config(args)
    budget = args.device_memory or int(_model_data_bytes(cfg, args) / args.model_to_budget)
    config = _gemini_config(args, placement="auto", device_memory=budget, report_path=None)
    device = config.resolved_device()
    x, y = synthetic_batch(cfg, args.batch, args.seq, generator=torch.Generator().manual_seed(1), device=device)
    print(f"tuning gpu_margin_mem_ratio over {args.ratios} with a {format_size(config.device_memory)} budget, "
          f"{args.steps} steps each (the first is the warm-up)", flush=True)

    def on_trial(t: MarginTrial) -> None:
        if t.failed:
            what = t.error.splitlines()[0]
        else:
            what = f"{t.step_seconds:.3f} s/step, peak {format_size(t.device_peak_bytes)}"
        print(f"  ratio {t.ratio:g}: {what}", flush=True)

    tuning = tune_margin(lambda: _seeded_gpt(cfg), lambda m: GPT.loss(m(x), y), config, ratios=args.ratios,
                         steps=args.steps, headroom_fraction=args.headroom_fraction, on_trial=on_trial, lr=args.lr)
    print(tuning.table())
    print(tuning.recommendation())
    return 0 if tuning.recommended_ratio is not None else 1


def cmd_report(args: argparse.Namespace) -> int:
    reports = read_reports(args.file)
    if not reports:
        raise ValueError(f"{args.file} holds no reports")
    unit = args.unit or readable_unit(max(r.device_budget_bytes or r.device_peak_bytes for r in reports))[0]
    if not args.quiet:
        for r in reports:
            print(summary_line(r, unit=unit))
            if r.timeline is not None:
                print(_timeline_line(r.timeline, r))
    print(run_summary(reports, unit=unit))
    if args.plot_dir:
        for path in _write_plots(reports, args.plot_dir):
            print(f"plot: {path}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = _gpt_config(args)
    with torch.device("meta"):  # no memory: plans models larger than this machine
        model = GPT(cfg)
    # The compute device does not change the layout: plan on the CPU so that a machine
    # without the target GPU can plan for it.
    config = _gemini_config(args, device="cpu", report_path=None)
    plan = plan_placement(model, config)
    print(plan.table())
    return 0 if plan.fits else 1


# -------------------------------------------------------------------------------- parser
def _at_least_one(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 1")
    return value


def _ratios(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemini", description="gemini-offload: train models larger than the device")
    p.add_argument("-v", "--verbose", action="store_true", help="log the engine's decisions (INFO)")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a GPT several times larger than the device budget, with per-step reports")
    _add_model_args(d, _DEMO_MODEL)
    _add_engine_args(d, placement=None)
    d.add_argument("--model-to-budget", type=_at_least_one, default=4.0,
                   help="model data / device budget when --device-memory is not given (default 4)")
    _add_run_args(d, steps=10)
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="train a GPT of a chosen size, placement, precision and budgets")
    _add_model_args(t, _TRAIN_MODEL)
    _add_engine_args(t, placement="auto")
    t.add_argument("--gpu-margin-mem-ratio", type=float, default=0.0, help="placement auto: margin share for Adam")
    _add_run_args(t, steps=10)
    t.set_defaults(func=cmd_train)

    m = sub.add_parser("tune-margin", help="try gpu_margin_mem_ratio values and recommend the fastest within headroom")
    _add_model_args(m, _DEMO_MODEL)
    _add_engine_args(m, placement=None)
    m.add_argument("--model-to-budget", type=_at_least_one, default=4.0,
                   help="model data / device budget when --device-memory is not given (default 4)")
    m.add_argument("--ratios", type=_ratios, default=list(DEFAULT_RATIOS), help="comma-separated, e.g. 0,0.5,1")
    m.add_argument("--steps", type=int, default=4, help="steps per ratio, the first a warm-up (default 4)")
    m.add_argument("--headroom-fraction", type=float, default=0.1, help="share of the budget kept free (default 0.1)")
    m.add_argument("--lr", type=float, default=1e-3)
    m.set_defaults(func=cmd_tune_margin)

    r = sub.add_parser("report", help="summarise (and plot) a JSON Lines file of memory reports")
    r.add_argument("file")
    r.add_argument("--plot-dir", default=None, help="write memory.png and timeline.png here (needs matplotlib)")
    r.add_argument("--quiet", action="store_true", help="only the run's summary, no per-step lines")
    r.add_argument("--unit", choices=tuple(UNITS), default=None, help="sizes in summaries (default: by scale)")
    r.set_defaults(func=cmd_report)

    pl = sub.add_parser("plan", help="before training: does it fit, and where will params, grads and states go")
    _add_model_args(pl, _TRAIN_MODEL, batch=False)
    _add_engine_args(pl, placement="cpu", device=False)
    pl.add_argument("--gpu-margin-mem-ratio", type=float, default=0.0)
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, DeviceBudgetError, NotImplementedError, ImportError, OSError) as e:
        # Configuration and budget errors are the user's to fix: their message, no traceback.
        print(f"gemini {args.command}: error: {e}", file=sys.stderr)
        return 2
