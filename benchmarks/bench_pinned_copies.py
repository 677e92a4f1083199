"""Host<->GPU copy bandwidth: PinnedHostPool buffers against plain pinned and pageable tensors.

Needs a CUDA GPU (says so and exits 0 without one). Run from the repository root:

    python benchmarks/bench_pinned_copies.py
    python benchmarks/bench_pinned_copies.py --size 256MiB --rounds 9

Each round copies one buffer of --size host-to-device and device-to-host, for every kind of
host memory, interleaved in a rotating order; timed with CUDA events around a non_blocking
copy; the table gives medians. The pool's buffers should equal a plain pinned tensor (both
are page-locked; the pool only recycles them), and both should beat pageable memory, which
CUDA stages through a bounce buffer. It also reports the pinned memory torch's allocator holds
for one pool buffer of three sizes (its cache may round blocks up to a power of two).

Then the copies inside training steps: a GPT under placement "auto" with a device budget
below its parameters and gradients and every optimizer state on the host (ratio 0), so each step
evicts and prefetches chunks; the profiler's records of one step's host<->device copies (CUDA's
own timing of each ``Memcpy``) give bytes over busy time per direction, against the link's peak
measured above (issue 18: >= 90%), and how many copies were pageable.

Results go to benchmarks/results/gpu_pinned_copies.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemini  # noqa: E402
from bench_step import machine_info  # noqa: E402
from gemini.errors import DeviceBudgetError  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig  # noqa: E402
from offload import PinnedHostPool, parse_size  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def pinned_footprint(nbytes: int) -> dict:
    """What torch's pinned-memory allocator holds for one pool buffer of ``nbytes`` (its
    ``host_memory_stats`` before and after): its cache may round a block up to a power of
    two, which the pool's 1 MiB size classes would not see."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return {"note": "torch.cuda.host_memory_stats is not in this torch"}
    pool = PinnedHostPool(pin_memory=True)
    before = stats()
    buffer = pool.acquire(nbytes)
    after = stats()
    held = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    del buffer
    pool.close()
    reserved = next((v for k, v in held.items() if k.startswith("reserved_bytes") and k.endswith("current")), None)
    return {"requested_bytes": nbytes, "reserved_bytes": reserved, "stats_delta": held}


def memcpy_records(trace_path: str) -> list[dict]:
    """The host<->device copies of a chrome trace the profiler wrote: direction, bytes, the
    copy's time on the GPU (microseconds) and its kind of host memory (CUDA names it)."""
    events = json.loads(Path(trace_path).read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    records = []
    for e in events:
        name = e.get("name", "")
        if e.get("cat") != "gpu_memcpy" or ("HtoD" not in name and "DtoH" not in name):
            continue
        records.append({"direction": "h2d" if "HtoD" in name else "d2h", "bytes": int(e["args"].get("bytes", 0)),
                        "us": float(e.get("dur", 0.0)), "pageable": "Pageable" in name})
    return records


def in_step_copies(layers: int = 8, embd: int = 1024, steps: int = 3, device: str = "cuda") -> dict:
    """One profiled training step under an evicting budget (see the module's docstring)."""
    cfg = GPTConfig(vocab_size=8192, block_size=512, n_layer=layers, n_head=8, n_embd=embd,
                    activation_checkpointing=True)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g) for _ in range(steps + 1)]
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(cfg).parameters())
    for share in (0.5, 0.75, 1.0, 1.5):  # of the parameters and gradients: the smallest that trains
        budget = int(share * 8 * n_params) + (256 << 20)  # and room for the activations (the logits' mostly)
        torch.manual_seed(0)
        model, opt = gemini.initialize(GPT(cfg), gemini.GeminiConfig(
            device=device, placement="auto", device_memory=budget, gpu_margin_mem_ratio=0.0), lr=1e-4)
        try:
            for tokens in batches[:steps]:  # the warm-up and the steps it plans
                tokens = tokens.to(device)
                opt.backward(GPT.loss(model(tokens[:, :-1]), tokens[:, 1:]))
                opt.step()
                opt.zero_grad()
            tokens = batches[steps].to(device)
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
                opt.backward(GPT.loss(model(tokens[:, :-1]), tokens[:, 1:]))
                opt.step()
                opt.zero_grad()
                sync()
            with tempfile.TemporaryDirectory() as tmp:
                trace = str(Path(tmp) / "trace.json")
                prof.export_chrome_trace(trace)
                records = memcpy_records(trace)
            report = opt.report
        except DeviceBudgetError as e:
            print(f"in-step copies: budget {budget} refused ({str(e)[:120]}...); a larger one", flush=True)
            continue
        finally:
            opt.close()
        out = {"layers": layers, "n_embd": embd, "n_params": n_params, "budget_bytes": budget,
               "report_h2d_bytes": report.h2d_bytes, "report_d2h_bytes": report.d2h_bytes,
               "step_seconds": report.step_seconds}
        for d in ("h2d", "d2h"):
            mine = [r for r in records if r["direction"] == d]
            big = [r for r in mine if r["bytes"] >= 1 << 20]
            busy_us = sum(r["us"] for r in mine)
            out[d] = {"copies": len(mine), "bytes": sum(r["bytes"] for r in mine),
                      "pageable_copies": sum(r["pageable"] for r in mine),
                      "gbps": sum(r["bytes"] for r in mine) / busy_us / 1e3 if busy_us else None,
                      "gbps_copies_over_1MiB": (sum(r["bytes"] for r in big) / sum(r["us"] for r in big) / 1e3)
                      if big else None}
        return out
    return {"error": "no budget trained"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (this benchmark needs a GPU)")
        return
    nbytes = parse_size(args.size)
    pool = PinnedHostPool(pin_memory=True)
    hosts = {
        "PinnedHostPool": pool.acquire(nbytes),
        "torch.empty(pin_memory=True)": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "pageable": torch.empty(nbytes, dtype=torch.uint8),
    }
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for h in hosts.values():
        h.random_(0, 256)
        timed_copy(device, h)  # warm-up
    times = {name: {"h2d": [], "d2h": []} for name in hosts}
    names = list(hosts)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name]["h2d"].append(timed_copy(device, hosts[name]))
            times[name]["d2h"].append(timed_copy(hosts[name], device))
    rows = {name: {d: nbytes / statistics.median(t[d]) / 1e9 for d in t} for name, t in times.items()}
    footprints = [pinned_footprint(n) for n in (nbytes, parse_size("148MiB"), parse_size("300MiB"))]
    del hosts, device
    pool.close()
    try:
        in_step = in_step_copies()
    except Exception as e:  # a row saying why, not the end of the copies' results
        in_step = {"error": f"{type(e).__name__}: {e}"[:300]}
    result = dict(machine=machine_info("cuda"), size_bytes=nbytes, rounds=args.rounds, gbps=rows, seconds=times,
                  pinned_footprints=footprints, in_step=in_step)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_pinned_copies.json").write_text(json.dumps(result, indent=2))
    lines = ["# Host<->GPU copies by kind of host memory", "",
             f"`python benchmarks/bench_pinned_copies.py {' '.join(sys.argv[1:])}` on {result['machine']['date']}, "
             f"{result['machine'].get('gpu')}; {args.size} per copy, {args.rounds} interleaved rounds, medians.", "",
             "| host memory | H2D GB/s | D2H GB/s |", "|---|---:|---:|"]
    lines += [f"| {name} | {r['h2d']:.1f} | {r['d2h']:.1f} |" for name, r in rows.items()]
    lines += ["", "Pinned memory torch holds for one pool buffer (`torch.cuda.host_memory_stats`, reserved bytes):", "",
              "| requested | held | held / requested |", "|---:|---:|---:|"]
    lines += [f"| {f['requested_bytes']} | {f['reserved_bytes']} | "
              f"{f['reserved_bytes'] / f['requested_bytes']:.2f} |" if f.get("reserved_bytes") else
              f"| {f.get('requested_bytes', '-')} | - | {f.get('note', 'no reserved_bytes key: see the JSON')} |"
              for f in footprints]
    peak = {d: max(r[d] for r in rows.values()) for d in ("h2d", "d2h")}
    if "error" in in_step:
        lines += ["", f"Copies inside a training step: {in_step['error']}"]
    else:
        lines += ["", f"Copies inside a profiled training step (GPT {in_step['n_params'] / 1e6:.0f}M parameters, "
                  f"budget {in_step['budget_bytes'] / 2**20:.0f} MiB, ratio 0; CUDA's timing of each copy):", "",
                  "| direction | copies | MiB | pageable | GB/s (all) | GB/s (>= 1 MiB) | share of the peak |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for d in ("h2d", "d2h"):
            r = in_step[d]
            rate = r["gbps_copies_over_1MiB"] or r["gbps"]
            lines.append(f"| {d} | {r['copies']} | {r['bytes'] / 2**20:.0f} | {r['pageable_copies']} | "
                         f"{r['gbps'] or 0:.1f} | {r['gbps_copies_over_1MiB'] or 0:.1f} | "
                         f"{rate / peak[d] if rate else 0:.0%} |")
    (RESULTS / "gpu_pinned_copies.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
