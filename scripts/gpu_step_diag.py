"""What a GPU step spends, for the questions gpu_peers.md left open (not a test, not a benchmark):

1. Where gemini's peak goes: with every optimizer state on the GPU (auto, ratio 1) its peak was
   14022 MiB against plain torch's 12668 on the same 355M GPT, about one fp32 copy of the
   parameters more. The CUDA allocator's history (``torch.cuda.memory._record_memory_history``)
   is replayed to the moment of the peak, and the allocations live then are summed by the first
   frame of this repository (else of torch) that made them.
2. Where the step's time goes with every state on the host (ratio 0): the wall time of forward,
   backward and step, whether ``opt.backward`` returned before the GPU ended the backward (the
   overlap [Note: host groups updated as their gradients land] in gemini/optim/adam_batches.py
   depends on it), and the GPU's time of the backward.

    python scripts/gpu_step_diag.py --contender gemini-ratio1      # one contender per process
    python scripts/gpu_step_diag.py --contender torch --model gpt-small --device cpu   # smoke test

3. With ``--profile``, one more step under torch.profiler: per name of interest (gemini's phases,
   the fused Adam kernels, the waits), how many, when the first began and the last ended and
   how long they took in all, against the GPU's busy span, so that gemini's host step can be set
   beside torchao's per-parameter one on the same timeline.

Contenders: torch (AdamW fused, everything on the device), gemini-ratio0, gemini-ratio1, torchao
(CPUOffloadOptimizer over AdamW(fused), its wheel installed as for bench_peers.py).
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import gemini  # noqa: E402
from bench_peers import MODELS  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

OURS = ("gemini/", "chunks/", "offload/", "tracer/", "benchmarks/", "scripts/")


def build(contender: str, model: GPT, device: str):
    """(model, backward(loss), step(), zero_grad())."""
    if contender == "torch":
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        return model, lambda loss: loss.backward(), opt.step, lambda: opt.zero_grad(set_to_none=True)
    if contender == "torchao":
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError:  # releases before torchao.optim existed
            from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
        model = model.to(device)
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, weight_decay=0.1, fused=True)
        return model, lambda loss: loss.backward(), opt.step, opt.zero_grad
    ratio = {"gemini-ratio0": 0.0, "gemini-ratio1": 1.0}[contender]
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device=device, placement="auto",
                                                               gpu_margin_mem_ratio=ratio), lr=1e-4, weight_decay=0.1)
    return gmodel, opt.backward, opt.step, opt.zero_grad


def where(frames: list[dict]) -> str:
    """The first frame of this repository that made an allocation, else the first of torch."""
    for f in frames:
        name = f.get("filename", "")
        if any(part in name for part in OURS) and "gpu_step_diag" not in name:
            return f"{name.split('/work/main/')[-1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        if "torch/" in f.get("filename", ""):
            return f"{f['filename'].split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(no frame)"


def live_at_peak(snapshot: dict, device: int) -> tuple[int, list[tuple[str, int, int]]]:
    """(peak bytes, [(where, bytes, count)] of the allocations live at the peak, largest first)."""
    trace = snapshot["device_traces"][device]
    total = peak = peak_at = 0
    sizes: dict[int, int] = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in sizes:
            total -= sizes.pop(e["addr"])
        if total > peak:
            peak, peak_at = total, i
    live: dict[int, dict] = {}
    for e in trace[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    by_site: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for e in live.values():
        site = by_site[where(e.get("frames", []))]
        site[0] += e["size"]
        site[1] += 1
    rows = sorted(((k, v[0], v[1]) for k, v in by_site.items()), key=lambda r: -r[1])
    return peak, rows


class _GcPauses:
    """Milliseconds the garbage collector paused this thread since :meth:`reset`."""

    def __init__(self) -> None:
        self.ms, self.full, self._began = 0.0, 0, 0.0
        gc.callbacks.append(self._seen)

    def reset(self) -> None:
        self.ms, self.full = 0.0, 0

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        self.ms += (time.perf_counter() - self._began) * 1e3
        self.full += info["generation"] == 2

    def close(self) -> None:
        gc.callbacks.remove(self._seen)


INTEREST = ("diag::", "gemini::", "aten::_fused_adamw_", "aten::_fused_adam_", "cudaStreamSynchronize",
            "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "Optimizer.step")


def profile_step(model, backward, step, zero_grad, x, y, cuda: bool) -> None:
    """One step under torch.profiler: a timeline of the names in INTEREST (ms from the step's start)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        with record_function("diag::forward"):
            loss = GPT.loss(model(x), y)
        with record_function("diag::backward"):
            backward(loss)
        with record_function("diag::step"):
            step()
        with record_function("diag::zero_grad"):
            zero_grad()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    t0 = min(e.time_range.start for e in events)
    rows: dict[str, list[float]] = {}
    gpu = [None, None]
    for e in events:
        start, end = (e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3  # us -> ms
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu = [start if gpu[0] is None else min(gpu[0], start), end if gpu[1] is None else max(gpu[1], end)]
            continue
        name = e.name
        if not any(name.startswith(k) for k in INTEREST):
            continue
        r = rows.setdefault(name, [0, start, end, 0.0])
        r[0] += 1
        r[1], r[2], r[3] = min(r[1], start), max(r[2], end), r[3] + (end - start)
    print("  profiled step (ms from its start): name, count, first start, last end, summed duration")
    if gpu[0] is not None:
        print(f"    GPU kernels and copies busy from {gpu[0]:.1f} to {gpu[1]:.1f}")
    for name, (n, a, b, total) in sorted(rows.items(), key=lambda kv: kv[1][1]):
        print(f"    {name[:60]:60s} {n:6d} {a:9.1f} {b:9.1f} {total:9.1f}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contender", choices=["torch", "gemini-ratio0", "gemini-ratio1", "torchao"], required=True)
    p.add_argument("--model", default="gpt-350m", choices=list(MODELS))
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--profile", action="store_true", help="one more step under torch.profiler (see 3. above)")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after the first step: the collector no longer walks what lives by then")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    fields, batch, seq = MODELS[args.model]
    cfg = GPTConfig(**fields)
    cuda = args.device == "cuda"
    if cuda:  # from before the model reaches the device, so that the replay sees every allocation
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    torch.manual_seed(0)
    model, backward, step, zero_grad = build(args.contender, GPT(cfg), args.device)
    g = torch.Generator().manual_seed(1)
    phases = collections.defaultdict(list)
    pauses = _GcPauses()
    rows = []
    for i in range(args.steps):
        if i == 1 and args.gc_freeze:
            gc.collect()
            gc.freeze()
        pauses.reset()
        x, y = synthetic_batch(cfg, batch, seq, generator=g, device=args.device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = GPT.loss(model(x), y)
        t1 = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        backward(loss)
        t2 = time.perf_counter()
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            ahead = not end.query()
        step()
        t3 = time.perf_counter()
        zero_grad()
        if cuda:
            torch.cuda.synchronize()
        t4 = time.perf_counter()
        rows.append((i, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t4 - t0) * 1e3, pauses.ms, pauses.full))
        if i == 0:
            continue  # auto's warm-up
        phases["forward returns, ms"].append((t1 - t0) * 1e3)
        phases["backward returns, ms"].append((t2 - t1) * 1e3)
        phases["step returns, ms"].append((t3 - t2) * 1e3)
        phases["whole step (synchronized), ms"].append((t4 - t0) * 1e3)
        if cuda:
            phases["backward on the GPU, ms"].append(start.elapsed_time(end))
            phases["backward returned ahead of the GPU (1 = yes)"].append(float(ahead))
    print(f"{args.contender} on {args.model} ({cfg.num_params() / 1e6:.0f}M parameters, batch {batch}x{seq}), "
          f"{args.device}, medians of {args.steps - 1} steps after the first:")
    for name, values in phases.items():
        print(f"  {name}: {statistics.median(values):.1f}")
    print("  step by step: backward returns, step returns, whole step (ms), the garbage collector's pauses "
          "(ms; collections of the oldest generation)")
    for i, back, stp, whole, gc_ms, full in rows:
        print(f"    {i:3d} {back:8.1f} {stp:8.1f} {whole:8.1f} {gc_ms:8.1f} ({full})")
    pauses.close()
    if args.profile:
        x, y = synthetic_batch(cfg, batch, seq, generator=g, device=args.device)
        profile_step(model, backward, step, zero_grad, x, y, cuda)
    if cuda:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, rows = live_at_peak(snapshot, torch.cuda.current_device())
        print(f"  allocated at the peak of the recorded history: {peak / 2**20:.0f} MiB "
              f"(torch.cuda.max_memory_allocated: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB)")
        for site, nbytes, count in rows[:15]:
            print(f"    {nbytes / 2**20:9.1f} MiB in {count:5d} allocations: {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
