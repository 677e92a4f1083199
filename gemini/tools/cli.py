"""Command line: ``python -m gemini`` (and the ``gemini`` console script).

Commands: ``demo`` (a GPT several times the device budget, trained with per-step reports),
``train`` (a GPT of a chosen size under any placement and budgets), ``tune-margin`` (the
margin tuner), ``report`` (summarise and plot a JSON Lines file of reports) and ``plan``
(before training: whether a model fits and where its bytes will go).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

import torch

from gemini.config import PLACEMENTS, PRECISIONS, GeminiConfig
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch
from gemini.initialize import initialize
from gemini.tools.loop import StepResult, train_steps
from gemini.engine.memory import DeviceBudgetError
from gemini.tools.planner import plan_placement
from gemini.report import MemoryReport, ReportRun, WarmupTimeline, read_report_runs
from gemini.tools.summary import UNITS, readable_unit, run_summary, summary_line
from gemini.tools.tune import DEFAULT_RATIOS, MarginTrial, tune_margin
from offload import format_size, parse_size

__all__ = ["build_parser", "main"]

# The demo's model on a 2-core CPU: 19.5M parameters (about 300 MiB of model data), a step in a
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


# The engine options' defaults are GeminiConfig's own (one source: `plan`, `train`, `demo` and
# `tune-margin` default to what the library does when the option is left out).
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GeminiConfig)}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, "(default: 4)", unless the help already says
    what the default is in words (a default of None means something: "the whole device",
    "searched"), and flags (off unless given) say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def _add_model_args(p: argparse.ArgumentParser, defaults: dict[str, int], *, batch: bool = True) -> None:
    g = p.add_argument_group("model (a nanoGPT-style GPT on synthetic tokens)")
    g.add_argument("--layers", type=_POSITIVE, default=defaults["layers"], help="transformer blocks")
    g.add_argument("--embd", type=_POSITIVE, default=defaults["embd"], help="width (a multiple of --heads)")
    g.add_argument("--heads", type=_POSITIVE, default=defaults["heads"], help="attention heads per block")
    g.add_argument("--vocab", type=_POSITIVE, default=defaults["vocab"], help="vocabulary size")
    g.add_argument("--seq", type=_POSITIVE, default=defaults["seq"], help="sequence length (and block size)")
    if batch:
        g.add_argument("--batch", type=_POSITIVE, default=defaults["batch"], help="sequences per step")
        g.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")


def _add_engine_args(p: argparse.ArgumentParser, *, placement: bool, static: bool, device: bool = True,
                     budget_default: str = "the whole device") -> None:
    """GeminiConfig's options. ``placement=False`` for a command that fixes the placement itself
    (demo and tune-margin run ``auto``); ``static=False`` where no ``static`` placement can be
    chosen, so that a command never accepts the ``--static-*`` options only to ignore them.
    ``budget_default``: what the command budgets without --device-memory, for its help."""
    g = p.add_argument_group("engine (GeminiConfig)")
    d = _CONFIG_DEFAULTS
    if device:
        g.add_argument("--device", choices=["cpu", "cuda"], default=d["device"],
                       help="compute device (default: cuda if present, else cpu, which stands in for an accelerator)")
    if placement:
        g.add_argument("--placement", choices=PLACEMENTS, default=d["placement"],
                       help="where chunks live: cuda (all on the device), cpu (on the host, fetched for compute; "
                            "Adam on the host), auto (traced by the warm-up, within --device-memory), "
                            "static (by the --static-* fractions)")
    g.add_argument("--precision", choices=tuple(PRECISIONS), default=d["precision"],
                   help="compute precision (fp16: dynamic loss scaling; fp32 masters in every case)")
    g.add_argument("--chunk-size", type=_POSITIVE, default=d["chunk_size"],
                   help="elements per chunk (default: searched for the least padding)")
    g.add_argument("--device-memory", type=_size, default=d["device_memory"],
                   help=f"device budget, bytes or a size like 512MiB (default: {budget_default})")
    g.add_argument("--cpu-memory", type=_size, default=d["cpu_memory"],
                   help="host budget for optimizer states, bytes or a size like 8GiB; beyond it -> NVMe "
                        "(default: no limit)")
    g.add_argument("--nvme-dir", default=d["nvme_dir"],
                   help="existing folder for NVMe-resident optimizer states (default: none, no NVMe tier)")
    g.add_argument("--nvme-offload-fraction", type=_FRACTION, default=d["nvme_offload_fraction"],
                   help="share of optimizer-state chunk groups kept on NVMe (needs --nvme-dir), in [0, 1]")
    g.add_argument("--nvme-pipeline-depth", type=_int_in(1, 64), default=d["nvme_pipeline_depth"],
                   help="chunk groups whose NVMe-resident optimizer states are read ahead of (and written "
                        "behind) the one being updated; host memory holds 2 * depth + 1 groups (a shallower "
                        "pipeline when --cpu-memory cannot), in [1, 64]")
    if static:
        g.add_argument("--static-param-device-fraction", type=_FRACTION, default=d["static_param_device_fraction"],
                       help="--placement static: share of parameter chunk groups (the first ones) kept on the "
                            "device, in [0, 1]")
        g.add_argument("--static-optimizer-offload-fraction", type=_FRACTION,
                       default=d["static_optimizer_offload_fraction"],
                       help="--placement static: share of optimizer-state chunk groups (the last ones) kept on "
                            "the host, in [0, 1]")


def _add_margin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-margin-mem-ratio", type=_FRACTION, default=_CONFIG_DEFAULTS["gpu_margin_mem_ratio"],
                   help="placement auto: share of the margin left on the device after the warm-up's peak that "
                        "holds optimizer-state chunks (updated there), in [0, 1]")


def _add_run_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=_POSITIVE, default=steps, help="training steps, the first a warm-up")
    g.add_argument("--lr", type=_number_in(0.0), default=1e-3, help="AdamW learning rate")
    g.add_argument("--report", default=None,
                   help="write one MemoryReport per step to this JSON Lines file (default: none)")
    g.add_argument("--plot-dir", default=None,
                   help="write memory.png and timeline.png here (needs matplotlib; default: no plots)")
    g.add_argument("--quiet", action="store_true", help="no per-step lines, only the run's summary")
    g.add_argument("--unit", choices=tuple(UNITS), default=None,
                   help="sizes in summaries (default: GiB when the device budget, or without one the model "
                        "data, is 1 GiB or more, else MiB)")


def _gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.embd, activation_checkpointing=getattr(args, "activation_checkpointing", False))


# Options named after GeminiConfig fields go into the config as they are; a command without one
# of them gets GeminiConfig's default for it.
_CONFIG_OPTIONS = ("device", "placement", "precision", "chunk_size", "device_memory", "cpu_memory", "nvme_dir",
                   "nvme_offload_fraction", "nvme_pipeline_depth", "static_param_device_fraction",
                   "static_optimizer_offload_fraction", "gpu_margin_mem_ratio")


def _gemini_config(args: argparse.Namespace, **overrides) -> GeminiConfig:
    values = {name: getattr(args, name) for name in _CONFIG_OPTIONS if hasattr(args, name)}
    values["device"] = values.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    values["report_path"] = getattr(args, "report", None)
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
    """Prints each step as it ends, "step   2/8 | ...", counted from 1 like every line of the
    CLI (and the warm-up's plan when a step carries one)."""

    def on_step(result: StepResult) -> None:
        r = result.report
        if not quiet:
            print(summary_line(r, loss=result.loss, unit=unit, total=total), flush=True)
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
    # The batch before the engine: its own generator, so the model's weights are the same either way.
    x, y = synthetic_batch(cfg, args.batch, args.seq, generator=torch.Generator().manual_seed(1),
                           device=config.resolved_device())
    gmodel, opt = initialize(model, config, lr=args.lr, weight_decay=0.1)
    try:
        mgr = opt._rt.manager
        print(f"chunks: {len(mgr.groups)} chunk groups of {mgr.chunk_size:,} elements "
              f"({mgr.waste_elements():,} elements of padding)", flush=True)
        if config.placement == "auto" and not args.quiet:
            print(f"step   1/{args.steps}: warm-up, tracing the first iteration ...", flush=True)
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
    from gemini.tools.plots import plot_memory, plot_timeline  # matplotlib is optional: only when asked

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


class _TuneModel:
    """The tuner's model_fn: the seeded GPT (a module-level class, so a trial process can rebuild it)."""

    def __init__(self, cfg: GPTConfig) -> None:
        self.cfg = cfg

    def __call__(self) -> GPT:
        return _seeded_gpt(self.cfg)


class _TuneLoss:
    """The tuner's loss_fn on one fixed batch (made here on the host, moved to the device where the trial runs)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, device: str) -> None:
        self.x, self.y, self.device = x, y, device

    def __call__(self, model) -> torch.Tensor:
        if self.x.device.type != torch.device(self.device).type:
            self.x, self.y = self.x.to(self.device), self.y.to(self.device)
        return GPT.loss(model(self.x), self.y)


def cmd_tune_margin(args: argparse.Namespace) -> int:
    cfg = _gpt_config(args)
    budget = args.device_memory or int(_model_data_bytes(cfg, args) / args.model_to_budget)
    config = _gemini_config(args, placement="auto", device_memory=budget, report_path=None)
    device = str(config.resolved_device())
    ratios = list(dict.fromkeys(args.ratios))
    total = len(ratios) * args.rounds
    print(f"tuning gpu_margin_mem_ratio over {','.join(f'{r:g}' for r in ratios)} with a "
          f"{format_size(config.device_memory)} budget: {args.rounds} round(s) of {args.steps} steps per ratio "
          f"(the first a warm-up), {total} trials, each in its own process", flush=True)
    done = [0]

    def on_trial(t: MarginTrial) -> None:
        done[0] += 1
        if t.failed:
            what = "failed: " + t.error.splitlines()[0]
        else:
            needed = "-" if t.needed_bytes is None else format_size(t.needed_bytes)
            what = f"{t.step_seconds:.3f} s/step, needs {needed}, measured peak {format_size(t.device_peak_bytes)}"
        print(f"[trial {done[0]}/{total}] ratio {t.ratio:g} round {t.round + 1}: {what}", file=sys.stderr, flush=True)

    x, y = synthetic_batch(cfg, args.batch, args.seq, generator=torch.Generator().manual_seed(1), device="cpu")
    tuning = tune_margin(_TuneModel(cfg), _TuneLoss(x, y, device), config, ratios=ratios,
                         steps=args.steps, rounds=args.rounds, headroom_fraction=args.headroom_fraction,
                         on_trial=on_trial, lr=args.lr)
    print(tuning.table())
    print(tuning.recommendation())
    print(tuning.host_memory())
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
    # The configured device, even one this machine lacks: GPU bytes are not host bytes.
    config = _gemini_config(args, report_path=None)
    # One forward and backward of a batch on the meta device counts the activations.
    targets = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    plan = plan_placement(model, config, example_inputs=(((args.batch, args.seq), torch.long),),
                          loss_fn=lambda logits: GPT.loss(logits, targets))
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


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What one option's type cannot check alone, before a model is built or a file read;
    exits like argparse (status 2), in the words of the command's own usage."""
    sub = _subparser(parser, args.command)
    embd, heads = getattr(args, "embd", None), getattr(args, "heads", None)
    if embd is not None and heads is not None and embd % heads:
        sub.error(f"argument --embd: {embd} is not a multiple of --heads {heads}")
    plot_dir = getattr(args, "plot_dir", None)
    if plot_dir is not None:
        if os.path.exists(plot_dir) and not os.path.isdir(plot_dir):
            sub.error(f"argument --plot-dir: {plot_dir!r} is a file, not a folder")
        # Plots are drawn after training: a missing matplotlib found then would cost the whole run.
        from gemini.tools.plots import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as e:
            sub.error(f"argument --plot-dir: {plot_dir!r} asks for plots, but {e}")


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser


# "1751392 bytes" in a message, not already followed by a readable size; and budgets written as
# the config's fields with an int ("device_memory=100000").
_RAW_BYTES = re.compile(r"(?<![\w.])(\d{4,}) bytes(?! \()")
_RAW_BUDGET = re.compile(r"\b((?:device|cpu)_memory=)(\d{4,})\b(?! \()")


def readable_sizes(message: str) -> str:
    """``message`` with each raw byte count followed by the same size in readable units:
    "1751392 bytes" -> "1751392 bytes (1.67 MiB)", "device_memory=100000" ->
    "device_memory=100000 (97.66 KiB)". The library's errors count exact bytes (what a
    program compares); a person at a terminal reads the units."""
    message = _RAW_BYTES.sub(lambda m: f"{m.group(1)} bytes ({format_size(int(m.group(1)))})", message)
    return _RAW_BUDGET.sub(lambda m: f"{m.group(1)}{m.group(2)} ({format_size(int(m.group(2)))})", message)


_BY_MODEL_TO_BUDGET = "the model data divided by --model-to-budget"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemini", description="gemini-offload: train models larger than the device",
                                formatter_class=_HelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log the engine's decisions (INFO)")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description or help, formatter_class=_HelpFormatter)

    demo_params = "19.5M parameters, about 300 MiB of model data with its gradients and Adam states"
    d = command("demo", "train a GPT several times larger than the device budget, with per-step reports",
                f"Train a GPT (by default {demo_params}) under placement auto with a device budget "
                "--model-to-budget times smaller than its model data, printing a report line per step.")
    _add_model_args(d, _DEMO_MODEL)
    # The demo shows placement auto: no --placement, so no static placement and no --static-*.
    _add_engine_args(d, placement=False, static=False, budget_default=_BY_MODEL_TO_BUDGET)
    d.add_argument("--model-to-budget", type=_number_in(1.0), default=4.0,
                   help="model data / device budget when --device-memory is not given")
    _add_run_args(d, steps=10)
    d.set_defaults(func=cmd_demo)

    t = command("train", "train a GPT of a chosen size, placement, precision and budgets")
    _add_model_args(t, _TRAIN_MODEL)
    _add_engine_args(t, placement=True, static=True)
    _add_margin_arg(t)
    _add_run_args(t, steps=10)
    t.set_defaults(func=cmd_train)

    m = command("tune-margin", "try gpu_margin_mem_ratio values and recommend the fastest within headroom")
    _add_model_args(m, _DEMO_MODEL)
    # The tuner runs placement auto (the margin is auto's): the --static-* options would be ignored.
    _add_engine_args(m, placement=False, static=False, budget_default=_BY_MODEL_TO_BUDGET)
    m.add_argument("--model-to-budget", type=_number_in(1.0), default=4.0,
                   help="model data / device budget when --device-memory is not given")
    m.add_argument("--ratios", type=_ratios, default=list(DEFAULT_RATIOS),
                   help="comma-separated, each in [0, 1], e.g. 0,0.5,1 (default: "
                        + ",".join(f"{v:g}" for v in DEFAULT_RATIOS) + ")")
    m.add_argument("--steps", type=_int_in(2), default=4, help="steps per trial, the first a warm-up")
    m.add_argument("--rounds", type=_int_in(1), default=3,
                   help="trials per ratio, interleaved (each round in a rotated order); ratios within the "
                        "rounds' spread of the fastest are a tie, won by the one needing the least device memory")
    m.add_argument("--headroom-fraction", type=_number_in(0.0, 1.0, high_open=True), default=0.1,
                   help="share of the budget kept free")
    m.add_argument("--lr", type=_number_in(0.0), default=1e-3, help="AdamW learning rate")
    m.set_defaults(func=cmd_tune_margin)

    r = command("report", "summarise (and plot) a JSON Lines file of memory reports")
    r.add_argument("file", help="JSON Lines file written by --report or GeminiConfig.report_path")
    which = r.add_mutually_exclusive_group()
    which.add_argument("--run", type=_run_number, default=-1,
                       help="which run of the file (each initialize appends one): 1 the first, -1 the last")
    which.add_argument("--all-runs", action="store_true", help="every run of the file, one after another")
    r.add_argument("--plot-dir", default=None,
                   help="write memory.png and timeline.png here (needs matplotlib; default: no plots)")
    r.add_argument("--quiet", action="store_true", help="only the run's summary, no per-step lines")
    r.add_argument("--unit", choices=tuple(UNITS), default=None,
                   help="sizes in summaries (default: GiB when the largest device budget, or without one "
                        "the device peak, is 1 GiB or more, else MiB)")
    r.set_defaults(func=cmd_report)

    pl = command("plan", "before training: does it fit, and where will params, grads and states go")
    _add_model_args(pl, _TRAIN_MODEL)
    _add_engine_args(pl, placement=True, static=True)
    _add_margin_arg(pl)
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_arguments(parser, args)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, DeviceBudgetError, NotImplementedError, ImportError, OSError) as e:
        # Configuration and budget errors are the user's to fix: their message, no traceback.
        print(f"gemini {args.command}: error: {readable_sizes(str(e))}", file=sys.stderr)
        return 2
