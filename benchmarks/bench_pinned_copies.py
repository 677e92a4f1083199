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

Results go to benchmarks/results/pinned_copies.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_step import machine_info  # noqa: E402
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
    result = dict(machine=machine_info("cuda"), size_bytes=nbytes, rounds=args.rounds, gbps=rows, seconds=times,
                  pinned_footprints=footprints)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pinned_copies.json").write_text(json.dumps(result, indent=2))
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
    (RESULTS / "pinned_copies.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
