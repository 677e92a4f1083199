"""Command line: ``python -m gemini`` (and the ``gemini`` console script).

Commands: ``demo`` (a GPT several times the device budget, trained with per-step reports),
``train`` (a GPT of a chosen size under any placement and budgets), ``tune-margin`` (the
margin tuner), ``report`` (summarise and plot a JSON Lines file of reports) and ``plan``
(before training: whether a model fits and where its bytes will go).
"""

from __future__ import annotations

import argparse
import logging
import math
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
from gemini.report import MemoryReport, ReportRun, WarmupTimeline, read_report_runs
from gemini.summary import UNITS, readable_unit, run_summary, summary_line
from gemini.tune import DEFAULT_RATIOS, MarginTrial, tune_margin
from offload import format_size, parse_size

__all__ = ["build_parser", "main"]

# The demo's model on a 2-core CPU: 19.5M parameters (305 MiB of model data), a step in a
# fraction of a second under a budget a quarter of that; its activations (batch 2 x 32 tokens,
# under 20 MiB) leave room in that budget for the chunks being computed with.
_DEMO_MODEL = dict(layers=6, embd=512, heads=8, vocab=1024, seq=32, batch=2)
_TRAIN_MODEL = dict(layers=4, embd=256, heads=4, vocab=4096, seq=128, batch=8)


# ----------------------------------------------------------------------------- arguments
# Numeric options are checked as they are parsed (argparse's type functions), so a bad value
# ends the command at once, exit status 2, naming the option and the accepted range, before a
# model is built or a step is run.
def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    accepted = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}")
        return value

    return parse


def _number_in(low: float, high: float | None = None, *, high_open: bool = False) -> Callable[[str], float]:
    accepted = (f"a finite number >= {low:g}" if high is None
                else f"a number in [{low:g}, {high:g}{')' if high_open else ']'}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}") from None
        # Comparisons written so that nan fails them all.
        ok = math.isfinite(value) and value >= low
        if high is not None:
            ok = ok and (value < high if high_open else value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}")
        return value

    return parse


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except (ValueError, TypeError):
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size: bytes, or a size like 512MiB or 8GiB")
    return value


_POSITIVE = _int_in(1)
_FRACTION = _number_in(0.0, 1.0)


def _add_model_args(p: argparse.ArgumentParser, defaults: dict[str, int], *, batch: bool = True) -> None:
    g = p.add_argument_group("model (a nanoGPT-style GPT on synthetic tokens)")
    g.add_argument("--layers", type=_POSITIVE, default=defaults["layers"])
    g.add_argument("--embd", type=_POSITIVE, default=defaults["embd"], help="width (a multiple of --heads)")
    g.add_argument("--heads", type=_POSITIVE, default=defaults["heads"])
    g.add_argument("--vocab", type=_POSITIVE, default=defaults["vocab"])
    g.add_argument("--seq", type=_POSITIVE, default=defaults["seq"], help="sequence length (and block size)")
    if batch:
        g.add_argument("--batch", type=_POSITIVE, default=defaults["batch"])
        g.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")


def _add_engine_args(p: argparse.ArgumentParser, *, placement: str | None, device: bool = True) -> None:
    g = p.add_argument_group("engine (GeminiConfig)")
    if device:
        g.add_argument("--device", choices=["cpu", "cuda"], default=None,
                       help="compute device (default: cuda if present; cpu stands in for an accelerator)")
    if placement is not None:
        g.add_argument("--placement", choices=PLACEMENTS, default=placement)
    g.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32")
    g.add_argument("--chunk-size", type=_POSITIVE, default=None, help="elements per chunk (default: searched)")
    g.add_argument("--device-memory", type=_size, default=None, help="device budget, bytes or a size like 512MiB")
    g.add_argument("--cpu-memory", type=_size, default=None,
                   help="host budget for optimizer states; beyond it -> NVMe")
    g.add_argument("--nvme-dir", default=None, help="folder for NVMe-resident optimizer states")
    g.add_argument("--nvme-offload-fraction", type=_FRACTION, default=0.0)
    g.add_argument("--nvme-pipeline-depth", type=_int_in(1, 64), default=2)
    g.add_argument("--static-param-device-fraction", type=_FRACTION, default=1.0)
    g.add_argument("--static-optimizer-offload-fraction", type=_FRACTION, default=0.0)


def _add_run_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=_POSITIVE, default=steps)
    g.add_argument("--lr", type=_number_in(0.0), default=1e-3)
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
    runs = read_report_runs(args.file)
    if args.all_runs:
        chosen = list(enumerate(runs, start=1))
    else:
        if not -len(runs) <= args.run <= len(runs):
            raise ValueError(f"--run {args.run} is out of range: {args.file} holds {len(runs)} run(s), so expected "
                             f"1 to {len(runs)} or -1 to -{len(runs)}" if runs else f"{args.file} holds no reports")
        index = args.run - 1 if args.run > 0 else len(runs) + args.run
        chosen = [(index + 1, runs[index])]
    if not any(run.reports for _, run in chosen):
        raise ValueError(f"{args.file} holds no reports" + (f" in run {chosen[0][0]}" if len(chosen) == 1 else ""))
    for number, run in chosen:
        print(_run_line(number, len(runs), run))
        if not run.reports:
            continue
        reports = run.reports
        unit = args.unit or readable_unit(max(r.device_budget_bytes or r.device_peak_bytes for r in reports))[0]
        if not args.quiet:
            for r in reports:
                print(summary_line(r, unit=unit))
                if r.timeline is not None:
                    print(_timeline_line(r.timeline, r))
        print(run_summary(reports, unit=unit))
        if args.plot_dir:
            # One folder per run when several are shown, so that none overwrites another's plots.
            folder = os.path.join(args.plot_dir, f"run-{number}") if len(chosen) > 1 else args.plot_dir
            for path in _write_plots(reports, folder):
                print(f"plot: {path}")
    return 0


def _run_line(number: int, total: int, run: ReportRun) -> str:
    h = run.header
    if h is None:
        return f"run {number} of {total}: {len(run.reports)} steps (no run header: written by an older version)"
    config = h.get("config") or {}
    what = ", ".join(f"{k} {config[k]}" for k in ("device", "placement", "precision") if config.get(k) is not None)
    return (f"run {number} of {total}: started {h.get('started', '?')}, pid {h.get('pid', '?')} on "
            f"{h.get('host', '?')}, {len(run.reports)} steps" + (f"; {what}" if what else ""))


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
def _ratios(text: str) -> list[float]:
    ratios = []
    for v in text.split(","):
        if v.strip():
            try:
                ratios.append(_FRACTION(v.strip()))
            except argparse.ArgumentTypeError:
                ratios = []
                break
    if not ratios:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers in [0, 1]")
    return ratios


def _run_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a run number: 1 is the first run, -1 the last")
    return value


def _check_combinations(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What one option's type cannot check alone; exits like argparse (status 2)."""
    embd, heads = getattr(args, "embd", None), getattr(args, "heads", None)
    if embd is not None and heads is not None and embd % heads:
        parser.error(f"argument --embd: {embd} is not a multiple of --heads {heads}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemini", description="gemini-offload: train models larger than the device")
    p.add_argument("-v", "--verbose", action="store_true", help="log the engine's decisions (INFO)")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a GPT several times larger than the device budget, with per-step reports")
    _add_model_args(d, _DEMO_MODEL)
    _add_engine_args(d, placement=None)
    d.add_argument("--model-to-budget", type=_number_in(1.0), default=4.0,
                   help="model data / device budget when --device-memory is not given (default 4)")
    _add_run_args(d, steps=10)
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="train a GPT of a chosen size, placement, precision and budgets")
    _add_model_args(t, _TRAIN_MODEL)
    _add_engine_args(t, placement="auto")
    t.add_argument("--gpu-margin-mem-ratio", type=_FRACTION, default=0.0, help="placement auto: margin share for Adam")
    _add_run_args(t, steps=10)
    t.set_defaults(func=cmd_train)

    m = sub.add_parser("tune-margin", help="try gpu_margin_mem_ratio values and recommend the fastest within headroom")
    _add_model_args(m, _DEMO_MODEL)
    _add_engine_args(m, placement=None)
    m.add_argument("--model-to-budget", type=_number_in(1.0), default=4.0,
                   help="model data / device budget when --device-memory is not given (default 4)")
    m.add_argument("--ratios", type=_ratios, default=list(DEFAULT_RATIOS), help="comma-separated, e.g. 0,0.5,1")
    m.add_argument("--steps", type=_int_in(2), default=4, help="steps per ratio, the first a warm-up (default 4)")
    m.add_argument("--headroom-fraction", type=_number_in(0.0, 1.0, high_open=True), default=0.1,
                   help="share of the budget kept free (default 0.1)")
    m.add_argument("--lr", type=_number_in(0.0), default=1e-3)
    m.set_defaults(func=cmd_tune_margin)

    r = sub.add_parser("report", help="summarise (and plot) a JSON Lines file of memory reports")
    r.add_argument("file")
    which = r.add_mutually_exclusive_group()
    which.add_argument("--run", type=_run_number, default=-1,
                       help="which run of the file (each initialize appends one): 1 the first, -1 the last (default)")
    which.add_argument("--all-runs", action="store_true", help="every run of the file, one after another")
    r.add_argument("--plot-dir", default=None, help="write memory.png and timeline.png here (needs matplotlib)")
    r.add_argument("--quiet", action="store_true", help="only the run's summary, no per-step lines")
    r.add_argument("--unit", choices=tuple(UNITS), default=None, help="sizes in summaries (default: by scale)")
    r.set_defaults(func=cmd_report)

    pl = sub.add_parser("plan", help="before training: does it fit, and where will params, grads and states go")
    _add_model_args(pl, _TRAIN_MODEL, batch=False)
    _add_engine_args(pl, placement="cpu", device=False)
    pl.add_argument("--gpu-margin-mem-ratio", type=_FRACTION, default=0.0)
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_combinations(parser, args)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, DeviceBudgetError, NotImplementedError, ImportError, OSError) as e:
        # Configuration and budget errors are the user's to fix: their message, no traceback.
        print(f"gemini {args.command}: error: {e}", file=sys.stderr)
        return 2
