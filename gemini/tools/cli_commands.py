"""What each ``python -m gemini`` subcommand runs, once its arguments are parsed and checked.

``demo`` and ``train`` train a seeded GPT on one synthetic batch with a line per step, ``tune-margin`` runs the
margin tuner on that GPT, ``report`` summarises (and plots) a JSON Lines file of reports, ``plan`` plans a GPT built
on the meta device, ``consolidate`` makes a sharded checkpoint whole. Each returns the exit status; the parser and
error handling are in :mod:`gemini.tools.cli`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gemini.checkpoint_file import atomic_save
from gemini.config import CONFIG_DEFAULTS, GeminiConfig
from gemini.consolidate import consolidate_checkpoint
from gemini.initialize import initialize
from gemini.policies import StaticPlacement, placement_type
from gemini.report import MemoryReport, ReportRun, WarmupTimeline, read_report_runs
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch
from gemini.tools.loop import StepResult, train_steps
from gemini.tools.planner import plan_placement
from gemini.tools.summary import readable_unit, run_summary, summary_line
from gemini.tools.tune import tune_margin
from gemini.tools.tune_results import MarginTrial
from offload import format_size

__all__ = ["cmd_consolidate", "cmd_demo", "cmd_plan", "cmd_report", "cmd_train", "cmd_tune_margin"]


# ------------------------------------------------------------------------ model and config
def _gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.embd, activation_checkpointing=getattr(args, "activation_checkpointing", False))


# Options named after GeminiConfig fields go into the config as they are; a command without one gets the default.
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
    """Bytes of every chunk (params, grads, Adam states) as the planner lays them out, built on meta (no memory)."""
    with torch.device("meta"):
        model = GPT(cfg)
    config = _gemini_config(args, device="cpu", placement="cpu", device_memory=None, cpu_memory=None,
                            nvme_dir=None, nvme_offload_fraction=0.0, gpu_margin_mem_ratio=0.0, report_path=None,
                            **{name: CONFIG_DEFAULTS[name] for name in StaticPlacement.own_fields})
    plan = plan_placement(model, config)
    return sum(plan.tier_bytes(t) for t in plan.model_bytes_by_tier)


# ------------------------------------------------------------------------------ training
def _progress(total: int, *, quiet: bool, unit: str) -> Callable[[StepResult], None]:
    """Prints each step as it ends ("step   2/8 | ...", counted from 1), and the warm-up's plan when it comes."""

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
    config.check_device_available()  # before the batch is made there: a one-line error, not torch's
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
        if placement_type(config.placement).plans_from_measurement and not args.quiet:
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
    config = _gemini_config(args, report_path=None, shard_params=args.shard_params)
    # One forward and backward of a batch on the meta device counts the activations.
    targets = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    plan = plan_placement(model, config, example_inputs=(((args.batch, args.seq), torch.long),),
                          loss_fn=lambda logits: GPT.loss(logits, targets), world_size=args.world_size,
                          ranks_per_host=args.ranks_per_host)
    print(plan.table())
    return 0 if plan.fits else 1



def cmd_consolidate(args: argparse.Namespace) -> int:
    out, folder = Path(args.out), Path(args.folder)
    if folder.is_dir() and out.resolve().parent == folder.resolve():  # a rank's file replaced: the input lost
        raise ValueError(f"out={args.out!r} is inside the sharded checkpoint's folder {args.folder!r}: write the "
                         f"consolidated file elsewhere")
    whole = consolidate_checkpoint(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(whole, out)  # with checksums, durable: what save_checkpoint(..., sharded=False) writes
    state = whole["optimizer"]["state"]
    print(f"{args.out}: {len(whole['model'])} model entries, optimizer state of {len(state)} parameters "
          f"(load_checkpoint into any number of ranks; torch.load(..., weights_only=True)['model'] into a plain module)")
    return 0
