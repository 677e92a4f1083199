"""The command line's options: what each accepts and what the subcommands share.

Numeric options are checked as they are parsed (argparse's type functions): a bad value ends the command at once
(exit status 2, naming the option and the accepted range), before a model is built. The option groups (model,
engine, run) are added the same way to every subcommand that takes them, with GeminiConfig's own defaults;
:func:`check_arguments` checks what no single option's type can.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from gemini.config import CONFIG_DEFAULTS, PLACEMENTS, PRECISIONS
from gemini.tools.summary import UNITS
from offload import parse_size

__all__ = ["CONFIG_DEFAULTS", "FRACTION", "POSITIVE", "HelpFormatter", "add_engine_args", "add_margin_arg",
           "add_model_args", "add_output_args", "add_run_args", "byte_size", "check_arguments", "int_in",
           "number_in", "ratio_list", "run_number"]


# ------------------------------------------------------------------------------ value types
def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
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


def number_in(low: float, high: float | None = None, *, high_open: bool = False) -> Callable[[str], float]:
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


def byte_size(text: str) -> int:
    try:
        value = parse_size(text)
    except (ValueError, TypeError) as e:
        # parse_size's reason (not a size, not whole bytes) and what it accepts
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size: {e}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size: bytes, or a size like 512MiB or 8GiB")
    return value


POSITIVE = int_in(1)
FRACTION = number_in(0.0, 1.0)


def ratio_list(text: str) -> list[float]:
    ratios = []
    for v in text.split(","):
        if v.strip():
            try:
                ratios.append(FRACTION(v.strip()))
            except argparse.ArgumentTypeError:
                ratios = []
                break
    if not ratios:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers in [0, 1]")
    return ratios


def run_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a run number: 1 is the first run, -1 the last")
    return value


# ---------------------------------------------------------------------------- option groups
# The engine options' defaults are GeminiConfig's own (CONFIG_DEFAULTS): every command defaults to what the library
# does when the option is left out.


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with "(default: 4)", except flags (off unless given) and options whose help says
    the default in words (a default of None means something: "the whole device", "searched")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def add_model_args(p: argparse.ArgumentParser, defaults: dict[str, int], *, batch: bool = True) -> None:
    g = p.add_argument_group("model (a nanoGPT-style GPT on synthetic tokens)")
    g.add_argument("--layers", type=POSITIVE, default=defaults["layers"], help="transformer blocks")
    g.add_argument("--embd", type=POSITIVE, default=defaults["embd"], help="width (a multiple of --heads)")
    g.add_argument("--heads", type=POSITIVE, default=defaults["heads"], help="attention heads per block")
    g.add_argument("--vocab", type=POSITIVE, default=defaults["vocab"], help="vocabulary size")
    g.add_argument("--seq", type=POSITIVE, default=defaults["seq"], help="sequence length (and block size)")
    if batch:
        g.add_argument("--batch", type=POSITIVE, default=defaults["batch"], help="sequences per step")
        g.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")


def add_engine_args(p: argparse.ArgumentParser, *, placement: bool, static: bool, device: bool = True,
                    budget_default: str = "the whole device") -> None:
    """GeminiConfig's options. ``placement=False`` for a command that fixes the placement itself (demo and
    tune-margin run ``auto``); ``static=False`` where no ``static`` placement can be chosen, so that a command never
    accepts the ``--static-*`` options only to ignore them. ``budget_default``: the help's default budget."""
    g = p.add_argument_group("engine (GeminiConfig)")
    d = CONFIG_DEFAULTS
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
    g.add_argument("--chunk-size", type=POSITIVE, default=d["chunk_size"],
                   help="elements per chunk (default: searched for the least padding)")
    g.add_argument("--device-memory", type=byte_size, default=d["device_memory"],
                   help=f"device budget, bytes or a size like 512MiB (default: {budget_default})")
    g.add_argument("--cpu-memory", type=byte_size, default=d["cpu_memory"],
                   help="host budget for optimizer states, bytes or a size like 8GiB; beyond it -> NVMe "
                        "(default: no limit)")
    g.add_argument("--nvme-dir", default=d["nvme_dir"],
                   help="existing folder for NVMe-resident optimizer states (default: none, no NVMe tier)")
    g.add_argument("--nvme-offload-fraction", type=FRACTION, default=d["nvme_offload_fraction"],
                   help="share of optimizer-state chunk groups kept on NVMe (needs --nvme-dir), in [0, 1]")
    g.add_argument("--nvme-pipeline-depth", type=int_in(1, 64), default=d["nvme_pipeline_depth"],
                   help="chunk groups whose NVMe-resident optimizer states are read ahead of (and written "
                        "behind) the one being updated; host memory holds 2 * depth + 1 groups (a shallower "
                        "pipeline when --cpu-memory cannot), in [1, 64]")
    if static:
        g.add_argument("--static-param-device-fraction", type=FRACTION, default=d["static_param_device_fraction"],
                       help="--placement static: share of parameter chunk groups (the first ones) kept on the "
                            "device, in [0, 1]")
        g.add_argument("--static-optimizer-offload-fraction", type=FRACTION,
                       default=d["static_optimizer_offload_fraction"],
                       help="--placement static: share of optimizer-state chunk groups (the last ones) kept on "
                            "the host, in [0, 1]")


def add_margin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-margin-mem-ratio", type=FRACTION, default=CONFIG_DEFAULTS["gpu_margin_mem_ratio"],
                   help="placement auto: share of the margin left on the device after the warm-up's peak that "
                        "holds optimizer-state chunks (updated there), in [0, 1]")


def add_run_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=POSITIVE, default=steps, help="training steps, the first a warm-up")
    g.add_argument("--lr", type=number_in(0.0), default=1e-3, help="AdamW learning rate")
    g.add_argument("--report", default=None,
                   help="write one MemoryReport per step to this JSON Lines file (default: none)")
    add_output_args(g, quiet_help="no per-step lines, only the run's summary",
                    unit_help="sizes in summaries (default: GiB when the device budget, or without one the model "
                              "data, is 1 GiB or more, else MiB)")


def add_output_args(g: argparse.ArgumentParser | argparse._ArgumentGroup, *, quiet_help: str, unit_help: str) -> None:
    """How reports are shown, for a run (``train``, ``demo``) and for a file of them (``report``)."""
    g.add_argument("--plot-dir", default=None,
                   help="write memory.png and timeline.png here (needs matplotlib; default: no plots)")
    g.add_argument("--quiet", action="store_true", help=quiet_help)
    g.add_argument("--unit", choices=tuple(UNITS), default=None, help=unit_help)


# ----------------------------------------------------------------------- checks across options
def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What one option's type cannot check alone, before a model is built or a file read; exits like argparse
    (status 2), in the words of the command's own usage."""
    sub = _subparser(parser, args.command)
    embd, heads = getattr(args, "embd", None), getattr(args, "heads", None)
    if embd is not None and heads is not None and embd % heads:
        sub.error(f"argument --embd: {embd} is not a multiple of --heads {heads}")
    if getattr(args, "shard_params", False) and (args.world_size or 1) < 2:
        sub.error("argument --shard-params: ZeRO-3 shards the parameters over the data-parallel ranks: give "
                  "--world-size (2 or more); one rank keeps them whole")
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

