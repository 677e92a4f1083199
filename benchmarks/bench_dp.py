"""Data parallelism: per-rank memory and step time for 1 and 2 ranks, gemini ZeRO vs PyTorch's
DDP + ZeroRedundancyOptimizer, side by side in the same run.

Run from the repository root (a quiet machine; ~3 minutes on the 2-core development VM):

    python benchmarks/bench_dp.py                       # CPU, gloo, ranks on 127.0.0.1
    python benchmarks/bench_dp.py --backend nccl        # one GPU per rank (torchrun-free)
    python benchmarks/bench_dp.py --layers 8 --embd 512 --heads 8 --steps 8

For each world size (1, then 2) the ranks train the same GPT on the same global batch (split
between the ranks), each rank with one CPU thread on gloo so that the cores are not shared
unevenly. Per rank and world size it records:

    gemini ZeRO-2   gemini.initialize(process_group=WORLD), placement cpu (CPU Adam on the
                    rank's shard), or placement auto on a GPU with NCCL
    gemini ZeRO-3   the same with shard_params=True
    peer            torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW, fused)

- step seconds: median over the steps after the first two (forward + backward + step)
- optimizer-state bytes on the rank: gemini from its MemoryReport (masters, m, v on every
  tier); the peer from the sizes of its optimizer's state tensors
- peak RSS of the rank's process (host memory; each configuration runs in fresh processes)

With one rank the peer is plain DDP-less AdamW(fused) and gemini has nothing to shard.
Results: benchmarks/results/dp_<backend>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import gemini  # noqa: E402
from bench_step import machine_info  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from multiprocess import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SYSTEMS = ("gemini-zero2", "gemini-zero3", "ddp+ZeroRedundancyOptimizer")


def _rank_main(rank: int, world: int, port: int, system: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    backend = args.backend
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    elif os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        cfg = GPTConfig(vocab_size=4096, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
        torch.manual_seed(0)
        model = GPT(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        g = torch.Generator().manual_seed(1)
        data = [synthetic_batch(cfg, args.batch, args.seq, generator=g) for _ in range(args.steps)]
        per_rank = args.batch // world
        times, os_bytes = [], 0
        if system.startswith("gemini"):
            config = gemini.GeminiConfig(
                device=str(device), placement="auto" if backend == "nccl" else "cpu",
                process_group=dist.group.WORLD, shard_params=system == "gemini-zero3")
            gmodel, opt = gemini.initialize(model, config, lr=1e-4)
            for x, y in data:
                x, y = (t[rank * per_rank : (rank + 1) * per_rank].to(device) for t in (x, y))
                start = time.perf_counter()
                opt.backward(GPT.loss(gmodel(x), y))
                opt.step()
                opt.zero_grad()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            report = opt.report.to_dict()
            os_bytes = sum(kinds.get(k, 0) for kinds in report["model_bytes_by_tier"].values()
                           for k in ("master", "exp_avg", "exp_avg_sq"))
            opt.close()
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = model.to(device)
            if world > 1:
                ddp = DDP(model)
                opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                              fused=True)
            else:
                ddp, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            for x, y in data:
                x, y = (t[rank * per_rank : (rank + 1) * per_rank].to(device) for t in (x, y))
                start = time.perf_counter()
                GPT.loss(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            local = opt.optim if world > 1 else opt
            os_bytes = sum(t.numel() * t.element_size() for st in local.state.values() for t in st.values()
                           if torch.is_tensor(t) and t.dim() > 0)
        row = {"system": system, "world": world, "rank": rank, "params": n_params,
               "step_seconds": statistics.median(times[2:]) if len(times) > 2 else times[-1],
               "optimizer_state_bytes": os_bytes,
               "peak_rss_bytes": _peak_rss_bytes(),
               "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
        Path(out, f"{system}_{world}_{rank}.json").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()


def _peak_rss_bytes() -> int:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    except ImportError:
        return psutil.Process().memory_info().rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split between the ranks)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.backend == "nccl" and torch.cuda.device_count() < 2:
        sys.exit("--backend nccl needs 2 GPUs (one per rank)")
    out = RESULTS / "tmp" / "dp"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for world in (1, 2):
        for system in SYSTEMS:
            mp.start_processes(_rank_main, args=(world, free_port(), system, args, str(out)), nprocs=world,
                               start_method="spawn")
            for rank in range(world):
                rows.append(json.loads((out / f"{system}_{world}_{rank}.json").read_text()))
                r = rows[-1]
                print(f"{system:30s} world {world} rank {rank}: step {r['step_seconds']:.3f} s, optimizer state "
                      f"{r['optimizer_state_bytes'] / 2**20:.1f} MiB, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB",
                      flush=True)
    result = {"machine": machine_info("cuda" if args.backend == "nccl" else "cpu"), "args": vars(args),
              "command": " ".join(["python", "benchmarks/bench_dp.py", *map(shlex.quote, sys.argv[1:])]),
              "rows": rows}
    name = f"dp_{args.backend}"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    m = result["machine"]
    lines = [
        "# Data parallelism: per-rank memory and step time, 1 and 2 ranks",
        "",
        f"Generated by `{result['command']}` on {m['date']}; {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
        f"backend {args.backend}, one thread per rank.",
        f"GPT of {rows[0]['params'] / 1e6:.1f}M parameters (fp32), global batch {args.batch} x {args.seq} tokens "
        f"split between the ranks, {args.steps} steps; step time is " + ("the median after the first two." if args.steps > 2 else "the last step's."),
        "",
        "| system | ranks | rank | step s | optimizer state MiB | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['system']} | {r['world']} | {r['rank']} | {r['step_seconds']:.3f} | "
                     f"{r['optimizer_state_bytes'] / 2**20:.1f} | {r['peak_rss_bytes'] / 2**20:.0f} |")
    lines.append("")
    (RESULTS / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
