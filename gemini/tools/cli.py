"""Command line: ``python -m gemini`` (and the ``gemini`` console script).

Commands: ``demo`` (a GPT several times the device budget, trained with per-step reports), ``train`` (a GPT of a
chosen size under any placement and budgets), ``tune-margin`` (the margin tuner), ``report`` (summarise and plot a
JSON Lines file of reports), ``plan`` (before training: whether a model fits and where its bytes go) and
``consolidate`` (a sharded checkpoint made one file for any number of ranks). This module builds the parser and runs
a command, showing the user's errors without a traceback; the options are in :mod:`gemini.tools.cli_options`, what
each command runs in :mod:`gemini.tools.cli_commands`.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import warnings

from gemini.engine.memory import DeviceBudgetError
from gemini.tools.cli_commands import cmd_consolidate, cmd_demo, cmd_plan, cmd_report, cmd_train, cmd_tune_margin
from gemini.tools.cli_options import HelpFormatter, add_engine_args, add_margin_arg, add_model_args, add_output_args
from gemini.tools.cli_options import POSITIVE, add_run_args, check_arguments, int_in, number_in, ratio_list, run_number
from gemini.tools.tune import DEFAULT_RATIOS
from offload import format_size

__all__ = ["build_parser", "main"]

# The demo's model: 19.5M parameters (about 300 MiB of model data), a step in a fraction of a second on a 2-core CPU
# under a budget a quarter of that; its small activations (batch 2 x 32 tokens) leave room for the chunks in use.
_DEMO_MODEL = dict(layers=6, embd=512, heads=8, vocab=1024, seq=32, batch=2)
_TRAIN_MODEL = dict(layers=4, embd=256, heads=4, vocab=4096, seq=128, batch=8)


# "1751392 bytes" in a message, not already followed by a readable size; and budgets as the config's int fields
# ("device_memory=100000").
_RAW_BYTES = re.compile(r"(?<![\w.])(\d{4,}) bytes(?! \()")
_RAW_BUDGET = re.compile(r"\b((?:device|cpu)_memory=)(\d{4,})\b(?! \()")


def readable_sizes(message: str) -> str:
    """``message`` with each raw byte count followed by its readable size: "1751392 bytes" -> "1751392 bytes
    (1.67 MiB)". The library's errors count exact bytes (what a program compares); a person reads the units."""
    message = _RAW_BYTES.sub(lambda m: f"{m.group(1)} bytes ({format_size(int(m.group(1)))})", message)
    return _RAW_BUDGET.sub(lambda m: f"{m.group(1)}{m.group(2)} ({format_size(int(m.group(2)))})", message)


_BY_MODEL_TO_BUDGET = "the model data divided by --model-to-budget"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemini", description="gemini-offload: train models larger than the device",
                                formatter_class=HelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log the engine's decisions (INFO)")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help, description=description or help, formatter_class=HelpFormatter)
        # Also after the command (`gemini plan -v ...`); absent there, the one before it stands.
        parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                            help="log the engine's decisions (INFO)")
        return parser

    demo_params = "19.5M parameters, about 300 MiB of model data with its gradients and Adam states"
    d = command("demo", "train a GPT several times larger than the device budget, with per-step reports",
                f"Train a GPT (by default {demo_params}) under placement auto with a device budget "
                "--model-to-budget times smaller than its model data, printing a report line per step.")
    add_model_args(d, _DEMO_MODEL)
    # The demo shows placement auto: no --placement, so no static placement and no --static-*.
    add_engine_args(d, placement=False, static=False, budget_default=_BY_MODEL_TO_BUDGET)
    d.add_argument("--model-to-budget", type=number_in(1.0), default=4.0,
                   help="model data / device budget when --device-memory is not given")
    add_run_args(d, steps=10)
    d.set_defaults(func=cmd_demo)

    t = command("train", "train a GPT of a chosen size, placement, precision and budgets")
    add_model_args(t, _TRAIN_MODEL)
    add_engine_args(t, placement=True, static=True)
    add_margin_arg(t)
    add_run_args(t, steps=10)
    t.set_defaults(func=cmd_train)

    m = command("tune-margin", "try gpu_margin_mem_ratio values and recommend the fastest within headroom")
    add_model_args(m, _DEMO_MODEL)
    # The tuner runs placement auto (the margin is auto's): the --static-* options would be ignored.
    add_engine_args(m, placement=False, static=False, budget_default=_BY_MODEL_TO_BUDGET)
    m.add_argument("--model-to-budget", type=number_in(1.0), default=4.0,
                   help="model data / device budget when --device-memory is not given")
    m.add_argument("--ratios", type=ratio_list, default=list(DEFAULT_RATIOS),
                   help="comma-separated, each in [0, 1], e.g. 0,0.5,1 (default: "
                        + ",".join(f"{v:g}" for v in DEFAULT_RATIOS) + ")")
    m.add_argument("--steps", type=int_in(2), default=4, help="steps per trial, the first a warm-up")
    m.add_argument("--rounds", type=int_in(1), default=3,
                   help="trials per ratio, interleaved (each round in a rotated order); ratios within the "
                        "rounds' spread of the fastest are a tie, won by the one needing the least device memory")
    m.add_argument("--headroom-fraction", type=number_in(0.0, 1.0, high_open=True), default=0.1,
                   help="share of the budget kept free")
    m.add_argument("--lr", type=number_in(0.0), default=1e-3, help="AdamW learning rate")
    m.set_defaults(func=cmd_tune_margin)

    r = command("report", "summarise (and plot) a JSON Lines file of memory reports")
    r.add_argument("file", help="JSON Lines file written by --report or GeminiConfig.report_path")
    which = r.add_mutually_exclusive_group()
    which.add_argument("--run", type=run_number, default=-1,
                       help="which run of the file (each initialize appends one): 1 the first, -1 the last")
    which.add_argument("--all-runs", action="store_true", help="every run of the file, one after another")
    add_output_args(r, quiet_help="only the run's summary, no per-step lines",
                    unit_help="sizes in summaries (default: GiB when the largest device budget, or without one "
                              "the device peak, is 1 GiB or more, else MiB)")
    r.set_defaults(func=cmd_report)

    pl = command("plan", "before training: does it fit, and where will params, grads and states go")
    add_model_args(pl, _TRAIN_MODEL)
    add_engine_args(pl, placement=True, static=True)
    add_margin_arg(pl)
    z = pl.add_argument_group("ZeRO (plan a data-parallel run: one rank's figures)")
    z.add_argument("--world-size", type=POSITIVE, default=None, help="data-parallel ranks (default 1)")
    z.add_argument("--ranks-per-host", type=POSITIVE, default=None,
                   help="ranks sharing one host's memory and drive (default: all of --world-size)")
    z.add_argument("--shard-params", action="store_true", help="ZeRO-3: each rank keeps 1/world of the parameters")
    pl.set_defaults(func=cmd_plan)

    c = command("consolidate", "make a sharded checkpoint (one file per rank) one file for any number of ranks",
                "Read every rank's file of a checkpoint saved with save_checkpoint(..., sharded=True) (or by "
                "GeminiTrainer on several ranks: checkpoint-N/gemini_optimizer) and write the consolidated "
                "checkpoint: the model's fp32 state_dict and AdamW's optimizer state, as "
                "save_checkpoint(..., sharded=False) writes it (DeepSpeed's zero_to_fp32.py).")
    c.add_argument("folder", help="the sharded checkpoint's folder (rank00000-of-0000N.pt, ...)")
    c.add_argument("out", help="the consolidated checkpoint file to write")
    c.set_defaults(func=cmd_consolidate)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        # One line, as the errors below: not Python's "file:line: Category" with the source line.
        print(f"gemini {args.command}: warning: {message}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = show
            return args.func(args)
    except (ValueError, DeviceBudgetError, NotImplementedError, ImportError, OSError) as e:
        # Configuration and budget errors are the user's to fix: their message, no traceback.
        print(f"gemini {args.command}: error: {readable_sizes(str(e))}", file=sys.stderr)
        return 2
