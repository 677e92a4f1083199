"""Optimizer states on the host, side by side: gemini, DeepSpeed ZeRO-2 with ``offload_optimizer:
cpu``, torchao's ``CPUOffloadOptimizer`` and plain PyTorch, same model, same data, one run.

    python benchmarks/bench_peers.py --device cuda                   # a 1.3B GPT on the GPU
    python benchmarks/bench_peers.py --device cuda --model gpt-350m  # a smaller one
    python benchmarks/bench_peers.py --device cpu --model gpt-small  # smoke test of the script
    python benchmarks/bench_peers.py --device cuda --micro-batches 4 # gradient accumulation: 4 a step

Each contender trains the same GPT (fp32 weights, the same initial values and batches) for
``--steps`` steps in a process of its own (so that CUDA's caching allocator, DeepSpeed's
process group and its JIT-built op start clean), and reports the median step time after
``--warmup`` steps, tokens per second, the peak of ``torch.cuda.max_memory_allocated`` over the
whole run (gemini's: the most of its reports' ``device_peak_bytes``, see [Note: gemini's peak in a
benchmark]; on the CPU: none), the whole GPU's used-memory peak (NVML), and its losses, whose agreement with plain AdamW the table shows:

- ``torch AdamW(fused)``: everything on the device; the reference (skipped with --no-plain
  when the model does not fit);
- ``gemini auto (ratio 0)``: placement "auto" with ``gpu_margin_mem_ratio`` 0, so every
  optimizer state lives on the host and the host Adam updates it, as ZeRO-Offload does;
- ``gemini auto (ratio 0; one host call)``: the same with the host's Adam as one call after
  every gradient has landed, as before [Note: host groups updated as their gradients land] (in
  gemini/optim/adam_batches.py): what the runs of groups save;
- ``gemini auto (ratio 1)``: the same with the warm-up's margin holding optimizer states on the
  device (what gemini adds over ZeRO-Offload); ``--device-memory`` sets both runs' budget;
- ``DeepSpeed ZeRO-2 offload``: ``deepspeed.initialize`` with ZeRO stage 2 and
  ``offload_optimizer: {device: cpu, pin_memory: true}`` on a world of 1 (DeepSpeedCPUAdam);
- ``gemini auto (ratio 1) at torchao CPUOffloadOptimizer's peak`` (``--at-peak-of``, last): the
  budget is that peer's measured peak, and auto holds in its margin the optimizer states that fit
  there ([Note: gemini at a peer's peak]: the goal's "equal or lower peak memory", asked of the
  planner rather than of a ratio);
- ``torchao CPUOffloadOptimizer``: ``torch.optim.AdamW(fused=True)`` on the host behind
  torchao's offload wrapper (CUDA only).

A peer that is not installed, or fails, is a row saying why; the others still run. Issue 18's
goal: gemini faster than both peers at equal or lower peak memory. Writes
benchmarks/results/gpu_peers.json and .md on CUDA, peers_cpu.* on the CPU.

On a machine without network (the lent GPU), carry the peers' wheels with the working tree
and install them first: ``pip download deepspeed torchao --no-deps -d wheels/`` here, then
``pip install --no-index --find-links wheels/ deepspeed torchao`` there (DeepSpeed also needs
hjson, ninja, py-cpuinfo, pydantic, msgpack and einops, and builds its CPU Adam with g++).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemini  # noqa: E402
from bench_step import machine_info, write_results  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from tracer.nvml_monitor import NvmlMonitor  # noqa: E402

MODELS = {  # name -> (GPTConfig fields, batch, seq)
    "gpt-small": (dict(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=128), 4, 64),
    "gpt-350m": (dict(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024), 4, 1024),
    "gpt-1.3b": (dict(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=2048), 4, 1024),
}
CONTENDERS = ["torch AdamW(fused)", "gemini auto (ratio 0)", "gemini auto (ratio 0; one host call)",
              "gemini auto (ratio 1)", "DeepSpeed ZeRO-2 offload", "torchao CPUOffloadOptimizer"]
LR, WEIGHT_DECAY = 1e-4, 0.1


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_model(name: str) -> tuple[GPT, GPTConfig, int, int]:
    fields, batch, seq = MODELS[name]
    cfg = GPTConfig(**fields)
    torch.manual_seed(0)
    return GPT(cfg), cfg, batch, seq


def make_batches(cfg: GPTConfig, batch: int, seq: int, steps: int, device: str):
    g = torch.Generator().manual_seed(1)
    return [synthetic_batch(cfg, batch, seq, generator=g, device=device) for _ in range(steps)]


# Each builder returns step(micro) -> loss, training the model one step on the (x, y) pairs of
# ``micro`` (--micro-batches of them: gradient accumulation, each loss divided by their number).

def torch_loop(model: GPT, opt: torch.optim.Optimizer):
    """The plain loop, for any torch optimizer (AdamW itself, or behind torchao's wrapper)."""
    def step(micro):
        total = 0.0
        for x, y in micro:
            loss = GPT.loss(model(x), y) / len(micro)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        return total
    return step


def build_plain(model: GPT, device: str, args):
    model = model.to(device)
    return torch_loop(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True))


def build_gemini(ratio: float, *, one_host_call: bool = False):
    def build(model: GPT, device: str, args):
        if one_host_call:  # the step as before runs of host groups (this contender's process only)
            from gemini.optim import adam_batches
            adam_batches.HOST_BATCH_ELEMENTS = 1 << 62
        config = gemini.GeminiConfig(device=device, placement="auto", gpu_margin_mem_ratio=ratio,
                                     device_memory=args.device_memory)
        gmodel, opt = gemini.initialize(model, config, lr=LR, weight_decay=WEIGHT_DECAY)

        def step(micro):
            total = 0.0
            for x, y in micro:
                loss = GPT.loss(gmodel(x), y) / len(micro)
                opt.backward(loss)
                total += loss.detach()
            if device == "cuda":  # see [Note: does the step begin before the GPU's backward ends?]
                done = torch.cuda.Event()
                done.record()
                GEMINI_AHEAD.append(not done.query())
            opt.step()
            opt.zero_grad()
            GEMINI_PEAKS.append(opt.report.device_peak_bytes)
            GEMINI_MOVED.append((opt.report.h2d_bytes, opt.report.d2h_bytes))
            return total
        return step
    return build


# [Note: the NVML sampler's thread]
# The GPU's used memory (NVML) is sampled by a Python thread in the contender's own process,
# which takes the GIL at each sample. Gemini's hooks and step are Python between the kernels,
# torch's and torchao's steps mostly C++, so the sampler may slow gemini more than the others:
# ``--nvml-interval-ms 0`` runs without it (the table's NVML column then empty) to measure that.
# [Note: gemini's peak in a benchmark]
# On CUDA gemini measures each step's non-model peak in intervals between moves of model data,
# resetting the allocator's peak statistic at each (gemini/engine/memory.py), so after a step
# torch.cuda.max_memory_allocated() holds only the peak since the last move (the first GPU run
# read 65 MiB for a 355M GPT). Gemini's own reading, each report's device_peak_bytes (the
# allocator's peaks of all the step's intervals), is its peak; the whole GPU's used memory
# (NVML, every contender alike, the CUDA context and the allocator's cache included) checks it.
GEMINI_PEAKS: list[int] = []
GEMINI_MOVED: list[tuple[int, int]] = []  # each step's bytes to the device and to the host

# [Note: does the step begin before the GPU's backward ends?]
# The host's Adam overlaps the GPU's backward only if ``opt.backward`` returns while the GPU
# still runs it (the CPU launching kernels ahead, nothing in gemini's hooks waiting for the GPU;
# see [Note: host groups updated as their gradients land] in gemini/optim/adam_batches.py). An
# event recorded when it returns, not yet complete, says so: the row's "ahead" counts the steps.
GEMINI_AHEAD: list[bool] = []

# [Note: gemini at a peer's peak]
# "Faster at equal or lower peak memory" compares configurations, and gemini's is a budget:
# ``device_memory`` set to the peak a peer measured makes auto plan within it, evicting what
# must go and holding in the margin as many optimizer-state groups as fit, so its step is
# updated partly on the GPU and partly by CPU Adam. The ratio-0 and ratio-1 rows bracket it
# (every state on the host; every state the unbudgeted margin holds).


def build_deepspeed(model: GPT, device: str, args):
    # A world of one: DeepSpeed wants a process group even so.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    _, batch, _ = MODELS[args.model]
    ds_config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": [0.9, 0.999],
                                                  "eps": 1e-8}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": device == "cuda"},
                              "contiguous_gradients": True, "overlap_comm": device == "cuda"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step(micro):
        total = 0.0
        for x, y in micro:  # DeepSpeed divides by gradient_accumulation_steps, and steps at the last
            loss = GPT.loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / len(micro)
        return total
    return step


def build_torchao(model: GPT, device: str, args):
    if device != "cuda":
        raise RuntimeError("torchao's CPUOffloadOptimizer needs CUDA")
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:  # releases before torchao.optim existed
        from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
    model = model.to(device)
    return torch_loop(model, CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR,
                                                 weight_decay=WEIGHT_DECAY, fused=True))


BUILDERS = {
    "torch AdamW(fused)": build_plain,
    "gemini auto (ratio 0)": build_gemini(0.0),
    "gemini auto (ratio 0; one host call)": build_gemini(0.0, one_host_call=True),
    "gemini auto (ratio 1)": build_gemini(1.0),
    "DeepSpeed ZeRO-2 offload": build_deepspeed,
    "torchao CPUOffloadOptimizer": build_torchao,
}


def run_one(name: str, args) -> dict:
    """One contender, in this process: build, train, measure."""
    device = args.device
    model, cfg, batch, seq = make_model(args.model)
    n = args.micro_batches
    flat = make_batches(cfg, batch, seq, (args.warmup + args.steps) * n, device)
    batches = [flat[i : i + n] for i in range(0, len(flat), n)]
    nvml = None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        if args.nvml_interval_ms > 0 and NvmlMonitor.is_available(torch.cuda.current_device()):
            # a thread of the process under test: see [Note: the NVML sampler's thread]
            nvml = NvmlMonitor(torch.cuda.current_device(), sample_interval_s=args.nvml_interval_ms / 1e3)
            nvml.start()
    step = BUILDERS[name](model, device, args)
    losses, seconds = [], []
    for micro in batches:
        sync(device)
        start = time.perf_counter()
        loss = step(micro)
        sync(device)
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
    timed = seconds[args.warmup:]
    median = statistics.median(timed)
    return {
        "contender": name, "ok": True, "median_step_s": median, "min_step_s": min(timed),
        "tokens_per_s": n * batch * seq / median, "losses": losses,
        # See [Note: gemini's peak in a benchmark].
        "peak_device_bytes": (max(GEMINI_PEAKS) if GEMINI_PEAKS else torch.cuda.max_memory_allocated())
        if device == "cuda" else None,
        "gpu_used_peak_bytes": nvml.peak_bytes() if nvml is not None else None,
        "backward_returned_ahead": f"{sum(GEMINI_AHEAD)} of {len(GEMINI_AHEAD)}" if GEMINI_AHEAD else None,
        "moved_bytes_per_step": GEMINI_MOVED[-1] if GEMINI_MOVED else None,  # the last step's (h2d, d2h)
        "n_params": cfg.num_params(), "batch": batch, "seq": seq,
    }


def run_isolated(name: str, args, *, device_memory: int | str | None = None) -> dict:
    """One contender in a process of its own (gemini's budget: ``device_memory``, else
    ``--device-memory``)."""
    cmd = [sys.executable, __file__, "--one", name, "--device", args.device, "--model", args.model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--port", str(args.port),
           "--micro-batches", str(args.micro_batches), "--nvml-interval-ms", str(args.nvml_interval_ms)]
    budget = device_memory if device_memory is not None else args.device_memory
    if budget is not None:
        cmd += ["--device-memory", str(budget)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:  # a row saying so; the other contenders still run
        return {"contender": name, "ok": False, "error": f"no result in --timeout {args.timeout} s"}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    return {"contender": name, "ok": False, "error": f"exit {out.returncode}: " + " | ".join(tail)[-400:]}


def markdown(result: dict) -> str:
    m, rows = result["machine"], result["rows"]
    ref = next((r for r in rows if r["contender"] == "torch AdamW(fused)" and r["ok"]), None)
    lines = [f"# Optimizer states on the host: gemini against its peers ({result['model']}, device {m['device']})", "",
             f"{m['date']} on {m.get('gpu', m['cpu'])} (torch {m['torch']}"
             + (f", CUDA {m['cuda']}, driver {m['driver']}" if m.get("cuda") else "") + f"). {result['steps']} timed "
             f"steps after {result['warmup']} of warm-up, each contender in a process of its own; fp32 weights; "
             f"{result['n_params'] / 1e6:.3g}M parameters, batch {result['batch']}x{result['seq']}"
             + (f", {result['micro_batches']} micro-batches a step (gradient accumulation)"
                if result.get("micro_batches", 1) > 1 else "") + ".", "",
             f"Command: `{result['command']}`", ""]
    if m["device"] == "cpu":
        lines += ["A smoke test of the script, not a comparison: on the CPU stand-in placement auto measures "
                  "every operator through a Python dispatch mode to plan (a GPU's allocator counters cost "
                  "nothing), DeepSpeed's \"offload\" moves nothing, and torchao needs CUDA.", ""]
    lines += ["| contender | median step s | tokens/s | peak device MiB | GPU used peak MiB (NVML) | max abs Δ loss vs torch | note |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['contender']} | - | - | - | - | - | {r['error']} |")
            continue
        peak = "-" if r["peak_device_bytes"] is None else f"{r['peak_device_bytes'] / 2**20:.0f}"
        used = "-" if r.get("gpu_used_peak_bytes") is None else f"{r['gpu_used_peak_bytes'] / 2**20:.0f}"
        diff = "-" if ref is None else f"{max(abs(a - b) for a, b in zip(r['losses'], ref['losses'])):.1e}"
        ahead, moved = r.get("backward_returned_ahead"), r.get("moved_bytes_per_step")
        notes = [f"backward returned before the GPU ended it: {ahead} steps"] if ahead else []
        if moved:
            notes.append(f"a step moved {moved[0] / 2**20:.0f} MiB to the device, {moved[1] / 2**20:.0f} MiB to the host")
        note = "; ".join(notes)
        lines.append(f"| {r['contender']} | {r['median_step_s']:.4f} | {r['tokens_per_s']:.0f} | {peak} | {used} | {diff} | "
                     f"{note} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--model", default="gpt-1.3b", choices=list(MODELS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batches", type=int, default=1, help="forward/backward passes a step (accumulation)")
    p.add_argument("--at-peak-of", default="torchao CPUOffloadOptimizer",
                   help="after the others, gemini auto (ratio 1) with device_memory = this contender's measured peak")
    p.add_argument("--device-memory", default=None, help="gemini's device budget (bytes or '8GiB'); default none")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset of: " + ", ".join(CONTENDERS))
    p.add_argument("--nvml-interval-ms", type=float, default=5.0,
                   help="the whole GPU's used memory sampled this often by a thread of each contender's "
                        "process (0: not sampled; see [Note: the NVML sampler's thread])")
    p.add_argument("--port", type=int, default=29517, help="DeepSpeed's process group (a world of one)")
    p.add_argument("--timeout", type=int, default=540, help="seconds per contender")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a contender, run by run_isolated
    args = p.parse_args()
    if args.micro_batches < 1:
        p.error(f"--micro-batches {args.micro_batches}: expected 1 or more")
    if args.device_memory is not None and args.device_memory.isdigit():
        args.device_memory = int(args.device_memory)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --device cpu for a smoke test)")
        return 1
    if args.one is not None:
        try:
            print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        except Exception as e:  # a peer that fails is a row, not the end of the run
            traceback.print_exc()
            print("RESULT " + json.dumps({"contender": args.one, "ok": False,
                                          "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
        return 0
    names = [n.strip() for n in args.contenders.split(",")]
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        p.error(f"--contenders: unknown {unknown}; expected some of {CONTENDERS}")
    rows = []
    for name in names:
        print(f"{name} ...", flush=True)
        rows.append(run_isolated(name, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
    peer = next((r for r in rows if r["contender"] == args.at_peak_of and r["ok"] and r.get("peak_device_bytes")), None)
    if peer is not None:
        # [Note: gemini at a peer's peak]: the budget is the peer's measured peak, and auto puts
        # in the margin what fits (the question of equal memory asked of gemini itself).
        name = f"gemini auto (ratio 1) at {args.at_peak_of}'s peak"
        print(f"{name} ...", flush=True)
        row = run_isolated("gemini auto (ratio 1)", args, device_memory=peer["peak_device_bytes"])
        row["contender"] = name
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    info = machine_info(args.device)
    fields, batch, seq = MODELS[args.model]
    result = {"machine": info, "model": args.model, "n_params": GPTConfig(**fields).num_params(), "batch": batch,
              "seq": seq, "steps": args.steps, "warmup": args.warmup, "micro_batches": args.micro_batches, "rows": rows,
              "command": "python benchmarks/bench_peers.py " + " ".join(sys.argv[1:])}
    stem = ("gpu_peers" if args.device == "cuda" else "peers_cpu") + (
        f"_accum{args.micro_batches}" if args.micro_batches > 1 else "")
    write_results(stem, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
