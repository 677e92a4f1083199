"""The largest GPT that trains under a fixed device budget (a consumer card's 8 GiB on a big GPU).

    python benchmarks/bench_gpu_capacity.py --device cuda                        # states on the host
    python benchmarks/bench_gpu_capacity.py --device cuda --nvme-dir /tmp/nvme --cpu-memory 32GiB
    python benchmarks/bench_gpu_capacity.py --device cuda --fit                  # auto / cuda when all fits
    python benchmarks/bench_gpu_capacity.py --device cpu --budget 24MiB --embd 128 --heads 4 --seq 64 --vocab 1024 --batch 2  # smoke test

A GPT of width ``--embd`` (activation checkpointing on every block, fp32 weights) is built on
the meta device, so the host never holds it whole before ``gemini.initialize`` fills the chunks
(each module's ``reset_parameters``), and trains ``--steps`` steps under placement "auto" with
``device_memory=--budget`` and ``gpu_margin_mem_ratio`` 0 (``--ratio``; every optimizer state on the host, or
on NVMe with ``--nvme-dir`` and ``--cpu-memory``). The depth grows by doubling until a trial
fails (the engine's DeviceBudgetError, an out-of-memory on either side, or the trial's time
limit), then bisects. A trial passes only if every step's measured peak stays under the budget:
the report's ``device_peak_bytes`` (on CUDA the allocator's peaks over the step's intervals).
Reported per trial: parameters, model data (16 bytes a parameter) / budget (issue 18's goal:
>= 5x), the peak, step time and tokens/s.

``--fit`` instead takes the deepest model whose model data fits the budget with room to
spare (a quarter of it, for activations) and times placement auto (same budget, ratio 1: the
margin keeps the optimizer states on the device) against placement cuda (no budget) on it,
each in its own process: issue 18's goal, auto / cuda <= 1.2. On the CPU stand-in a budget
also measures every operator (a Python dispatch mode), which a GPU does not need.

Each trial runs in a process of its own (CUDA's caching allocator and the host's memory start
clean), so a failure is a row, not the end of the run. The search stops after
``--time-limit`` seconds (default 540: the lent GPU allows 10 minutes a command) with what it
found; ``--start-layers`` continues a search. Results: benchmarks/results/gpu_capacity.json
and .md on CUDA (``capacity_fixed_budget_cpu.*`` on the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemini  # noqa: E402
from bench_step import machine_info, write_results  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig  # noqa: E402
from offload import format_size, parse_size  # noqa: E402

MODEL_DATA_BYTES_PER_PARAM = 16  # fp32 parameters, gradients, Adam m and v


def gpt_config(args, layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers, n_head=args.heads,
                     n_embd=args.embd, activation_checkpointing=True)


def run_trial(args, layers: int, placement: str) -> dict:
    """One model, in this process: build on meta, initialize, train, measure."""
    cfg = gpt_config(args, layers)
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    budget = parse_size(args.budget) if placement == "auto" else None
    config = gemini.GeminiConfig(
        device=args.device, placement=placement, device_memory=budget,
        gpu_margin_mem_ratio=args.ratio if placement == "auto" else 0.0,
        cpu_memory=parse_size(args.cpu_memory) if args.cpu_memory and placement == "auto" else None,
        nvme_dir=args.nvme_dir if placement == "auto" else None)
    start = time.perf_counter()
    gmodel, opt = gemini.initialize(model, config, lr=1e-4, weight_decay=0.1)
    init_seconds = time.perf_counter() - start
    g = torch.Generator().manual_seed(1)
    seconds, peaks = [], []
    try:
        for _ in range(args.steps):
            tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
            x, y = tokens[:, :-1].to(args.device), tokens[:, 1:].to(args.device)
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            begin = time.perf_counter()
            opt.backward(GPT.loss(gmodel(x), y))
            opt.step()
            opt.zero_grad()
            if args.device == "cuda":
                torch.cuda.synchronize()
            # The allocator's peak of the whole step as gemini measured it: it resets
            # torch.cuda's peak statistic at each move of model data, so max_memory_allocated()
            # holds only the last interval (see [Note: gemini's peak in a benchmark] in bench_peers.py).
            peaks.append(opt.report.device_peak_bytes)
            seconds.append(time.perf_counter() - begin)
    finally:
        opt.close()
    timed = seconds[1:] or seconds  # the first step is auto's warm-up
    step = statistics.median(timed)
    return {"layers": layers, "placement": placement, "n_params": n_params,
            "model_data_bytes": MODEL_DATA_BYTES_PER_PARAM * n_params, "budget_bytes": budget,
            "ok": budget is None or max(peaks) <= budget, "peaks": peaks, "step_seconds": seconds,
            "median_step_s": step, "tokens_per_s": args.batch * args.seq / step, "init_seconds": init_seconds}


def trial(args, layers: int, placement: str = "auto", timeout: float | None = None) -> dict:
    """One model in a process of its own; a failure (or a timeout) is a row, and so is a model
    the host cannot hold (not tried)."""
    shortfall = host_shortfall(args, layers) if placement == "auto" else None
    if shortfall is not None:
        return {"layers": layers, "placement": placement, "ok": False, "error": shortfall}
    cmd = [sys.executable, __file__, "--one", str(layers), "--one-placement", placement, *args.passthrough]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"layers": layers, "placement": placement, "ok": False, "timed_out": True,
                "error": f"no result in {timeout:.0f} s"}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = (out.stderr or out.stdout).strip().splitlines() or [f"exit {out.returncode}"]
    # The exception's own line (DeviceBudgetError: ..., torch.OutOfMemoryError: ...), shortened.
    last = next((line for line in reversed(lines) if "Error" in line), lines[-1])
    return {"layers": layers, "placement": placement, "ok": False, "error": last[:200]}


def host_shortfall(args, layers: int) -> str | None:
    """Why a trial cannot train with its states in host memory, before it runs: its model data
    above the host's available memory (the H200 run of 2026-11-26 spent its last 78 s pinning
    184 GB on a 125 GiB host, and ending that process outlasted the stage)."""
    if args.nvme_dir:
        return None
    need = MODEL_DATA_BYTES_PER_PARAM * gpt_config(args, layers).num_params()
    available = psutil.virtual_memory().available
    if need <= available:
        return None
    return f"model data {format_size(need)} above the host's available {format_size(available)}: not tried"


def search(args, rows: list[dict] | None = None) -> list[dict]:
    """Double the depth until a trial fails, then bisect, within the time limit; ``rows``
    collects each trial's row as it ends (an interrupted search still has them)."""
    deadline = time.monotonic() + args.time_limit
    rows = [] if rows is None else rows

    def attempt(layers: int) -> dict | None:
        """The trial's row, or None once the time is up (a trial the deadline cut short is no
        failure of the model: the search stops there, and --start-layers goes on)."""
        left = deadline - time.monotonic()
        if left < 10:
            return None
        row = trial(args, layers, timeout=left)
        print(_line(row), flush=True)
        if row.get("timed_out"):
            return None
        rows.append(row)
        return row

    good, bad = 0, None
    layers = args.start_layers
    while bad is None:
        row = attempt(layers)
        if row is None:
            return rows
        if row["ok"]:
            good, layers = layers, layers * 2
        else:
            bad = layers
    while bad - good > 1:
        mid = (good + bad) // 2
        row = attempt(mid)
        if row is None:
            return rows
        good, bad = (mid, bad) if row["ok"] else (good, mid)
    return rows


def fit_comparison(args) -> list[dict]:
    """auto (the budget) against cuda (no budget) on the deepest model whose model data fits
    three quarters of the budget."""
    budget = parse_size(args.budget)
    one, two = _params(args, 1), _params(args, 2)
    per_layer, rest = two - one, 2 * one - two  # the embeddings and the final norm
    layers = max(1, int((0.75 * budget / MODEL_DATA_BYTES_PER_PARAM - rest) // per_layer))
    rows = []
    for placement in ("cuda", "auto", "cuda", "auto"):  # alternated: drift hits both
        row = trial(args, layers, placement, timeout=args.time_limit / 4)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _params(args, layers: int) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(gpt_config(args, layers)).parameters())


def _line(row: dict) -> str:
    if "n_params" not in row:
        return f"  {row['placement']} {row['layers']} layers: {row.get('error')}"
    ratio = "" if row["budget_bytes"] is None else f", model data / budget {row['model_data_bytes'] / row['budget_bytes']:.1f}x"
    return (f"  {row['placement']} {row['layers']} layers, {row['n_params'] / 1e6:.0f}M parameters{ratio}: "
            f"{'trains' if row['ok'] else 'OVER BUDGET'}, peak {format_size(max(row['peaks']))}, "
            f"{row['median_step_s']:.2f} s a step")


def markdown(result: dict) -> str:
    m, args = result["machine"], result["args"]
    where = f"NVMe under {args['nvme_dir']} (cpu_memory {args['cpu_memory']})" if args["nvme_dir"] else "host memory"
    lines = [f"# The largest GPT under a {args['budget']} device budget (device {m['device']})", "",
             f"{m['date']} on {m.get('gpu', m['cpu'])} (torch {m['torch']}"
             + (f", CUDA {m['cuda']}, driver {m['driver']}" if m.get("cuda") else "") + "). GPT width "
             f"{args['embd']}, {args['heads']} heads, batch {args['batch']}x{args['seq']}, activation checkpointing, "
             f"fp32; placement auto (gpu_margin_mem_ratio {args['ratio']:g}), optimizer states otherwise in {where}; "
             f"{args['steps']} steps a trial, the peak of each "
             f"(the report's device_peak_bytes) under the budget.", "",
             f"Command: `{result['command']}`", "",
             "| placement | layers | parameters | model data / budget | trains | peak | median step s | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "n_params" not in r:
            lines.append(f"| {r['placement']} | {r['layers']} | - | - | no: {r.get('error')} | - | - | - |")
            continue
        ratio = "-" if r["budget_bytes"] is None else f"**{r['model_data_bytes'] / r['budget_bytes']:.1f}x**"
        lines.append(f"| {r['placement']} | {r['layers']} | {r['n_params'] / 1e6:.0f}M | {ratio} | "
                     f"{'yes' if r['ok'] else 'over budget'} | {format_size(max(r['peaks']))} | "
                     f"{r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} |")
    if result.get("auto_over_cuda") is not None:
        lines += ["", f"auto / cuda on a model that fits (medians of two alternated runs each): "
                      f"**{result['auto_over_cuda']:.3f}** (goal <= 1.2)"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--budget", default="8GiB", help="device_memory of every auto trial")
    p.add_argument("--embd", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--start-layers", type=int, default=8)
    p.add_argument("--nvme-dir", default=None, help="optimizer states on NVMe, in this folder")
    p.add_argument("--cpu-memory", default=None, help="host memory for optimizer states (with --nvme-dir)")
    p.add_argument("--fit", action="store_true", help="auto / cuda on a model that fits instead of the search")
    p.add_argument("--ratio", type=float, default=None,
                   help="auto's gpu_margin_mem_ratio (default: 0 for the search, states on the host; 1 with --fit)")
    p.add_argument("--time-limit", type=float, default=540.0, help="seconds for the whole search")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a trial, run by trial()
    p.add_argument("--one-placement", default="auto", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --device cpu with a small --budget for a smoke test)")
        return 1
    if args.ratio is None:
        args.ratio = 1.0 if args.fit else 0.0
    if args.one is not None:
        print("RESULT " + json.dumps(run_trial(args, args.one, args.one_placement)), flush=True)
        return 0
    args.passthrough = ["--device", args.device, "--budget", args.budget, "--embd", str(args.embd), "--heads",
                        str(args.heads), "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch),
                        "--steps", str(args.steps), "--ratio", str(args.ratio)]
    if args.nvme_dir:
        args.passthrough += ["--nvme-dir", args.nvme_dir]
    if args.cpu_memory:
        args.passthrough += ["--cpu-memory", args.cpu_memory]
    rows: list[dict] = []
    try:
        rows = fit_comparison(args) if args.fit else search(args, rows)
    except KeyboardInterrupt:  # a stage's time limit: the trials that ended are still results
        print(f"interrupted: writing the {len(rows)} rows measured so far", flush=True)
    result = {"machine": machine_info(args.device), "args": {k: v for k, v in vars(args).items() if k not in ("passthrough", "one")},
              "rows": rows, "command": "python benchmarks/bench_gpu_capacity.py " + " ".join(sys.argv[1:])}
    if args.fit:
        med = {pl: statistics.median(r["median_step_s"] for r in rows if r["placement"] == pl and "n_params" in r)
               for pl in ("cuda", "auto") if any(r["placement"] == pl and "n_params" in r for r in rows)}
        result["auto_over_cuda"] = med["auto"] / med["cuda"] if len(med) == 2 else None
    stem = ("gpu_capacity" if args.device == "cuda" else "capacity_fixed_budget_cpu") + ("_fit" if args.fit else "") \
        + ("_nvme" if args.nvme_dir else "")
    write_results(stem, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
