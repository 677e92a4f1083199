"""Optimizer step with Adam states on NVMe against the same step with them in host memory.

Run from the repository root (a quiet machine; ~3 minutes on the 2-core development VM):

    python benchmarks/bench_nvme_step.py
    python benchmarks/bench_nvme_step.py --dir /mnt/nvme/tmp --layers 8 --rounds 7

Two copies of one GPT train side by side with placement "cpu" (CPU Adam): "host" keeps every
optimizer state in host memory, "nvme" keeps them all on NVMe (``nvme_offload_fraction=1``)
and streams them through the step's pipeline. Rounds interleave, each round timing:

    host step     optimizer.step() of the host copy
    nvme step     optimizer.step() of the NVMe copy (read ahead, update, write behind)
    transfer      the same bytes moved by the NVMe store alone in the same chunks: every
                  chunk written, then every chunk read back, all requests in flight at once
                  (the disk's own bandwidth for this traffic, measured in the same minute)

The figure of merit is ``(nvme step - host step) / transfer``: the time the NVMe tier adds to
a step as a share of the time the disk needs for its bytes. 1.0 means no overlap at all;
the target is <= 1.2. Both steps see the same gradients (one backward each per round).

Results go to benchmarks/results/nvme_step.json and nvme_step.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemini  # noqa: E402
from bench_step import machine_info  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from offload import IoMode, NvmeStore, PinnedHostPool, parse_size  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def pure_transfer_seconds(folder: str, sizes: list[int]) -> tuple[float, float]:
    """Write then read ``sizes`` bytes (one key each, all in flight) with the store alone."""
    pool = PinnedHostPool()
    bufs = [pool.acquire(n) for n in sizes]
    for b in bufs:
        b.random_(0, 256)  # not zeros: a thin-provisioned disk must not shortcut them
    with NvmeStore(folder) as store:
        if store.io_mode is not IoMode.DIRECT:
            print(f"warning: {folder} refuses O_DIRECT; the page cache will flatter both sides")
        start = time.perf_counter()
        for f in [store.write(i, b) for i, b in enumerate(bufs)]:
            f.result()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for f in [store.read(i, b) for i, b in enumerate(bufs)]:
            f.result()
        read_s = time.perf_counter() - start
    for b in bufs:
        pool.release(b)
    pool.close()
    return write_s, read_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=str(RESULTS / "tmp"), help="folder on the drive under test")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=1024)
    parser.add_argument("--chunk", default="4Mi", help="chunk size in elements (e.g. 4Mi = 4194304)")
    parser.add_argument("--depth", type=int, default=2, help="nvme_pipeline_depth")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-prefix", default="nvme_step")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    chunk = parse_size(args.chunk.replace("Mi", "MiB").replace("Ki", "KiB"))
    cfg = GPTConfig(vocab_size=8192, block_size=64, n_layer=args.layers, n_head=args.embd // 64, n_embd=args.embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    n_params = sum(p.numel() for p in base.parameters())
    common = dict(device="cpu", placement="cpu", chunk_size=chunk)
    models = {
        "host": gemini.initialize(copy.deepcopy(base), gemini.GeminiConfig(**common), lr=1e-4),
        "nvme": gemini.initialize(base, gemini.GeminiConfig(**common, nvme_dir=args.dir, nvme_offload_fraction=1.0,
                                                            nvme_pipeline_depth=args.depth), lr=1e-4),
    }
    nvme_opt = models["nvme"][1]
    sizes = [c.nbytes for g in nvme_opt._rt.manager.trainable_groups for c in nvme_opt._rt.nvme.chunks_of(g)]
    x, y = synthetic_batch(cfg, 1, 64, generator=torch.Generator().manual_seed(1))

    def step(name: str) -> tuple[float, gemini.MemoryReport]:
        model, opt = models[name]
        opt.backward(GPT.loss(model(x), y))
        start = time.perf_counter()
        opt.step()
        seconds = time.perf_counter() - start
        opt.zero_grad()
        return seconds, opt.report

    for name in models:  # warm-up: first-step allocations, page faults
        step(name)
    rows = []
    for r in range(args.rounds):
        host_s, _ = step("host")
        nvme_s, report = step("nvme")
        write_s, read_s = pure_transfer_seconds(args.dir, sizes)
        transfer_s = write_s + read_s
        row = dict(round=r, host_step_seconds=host_s, nvme_step_seconds=nvme_s, extra_seconds=nvme_s - host_s,
                   transfer_seconds=transfer_s, write_gbps=sum(sizes) / write_s / 1e9,
                   read_gbps=sum(sizes) / read_s / 1e9, ratio=(nvme_s - host_s) / transfer_s,
                   nvme_read_bytes=report.nvme_read_bytes, nvme_write_bytes=report.nvme_write_bytes,
                   nvme_wait_seconds=report.nvme_wait_seconds, optimizer_cpu_seconds=report.optimizer_cpu_seconds)
        rows.append(row)
        print(f"round {r}: host {host_s:.3f} s, nvme {nvme_s:.3f} s, extra {nvme_s - host_s:.3f} s, "
              f"transfer {transfer_s:.3f} s (w {row['write_gbps']:.2f} / r {row['read_gbps']:.2f} GB/s) "
              f"-> ratio {row['ratio']:.2f}", flush=True)
    assert all(r["nvme_read_bytes"] == sum(sizes) == r["nvme_write_bytes"] for r in rows), "bytes moved differ"
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    for _, opt in models.values():
        opt.close()
    result = dict(machine=machine_info("cpu"), folder=args.dir, params=n_params, chunk_elements=chunk,
                  pipeline_depth=args.depth, nvme_bytes_per_step=2 * sum(sizes), rounds=rows, median=med,
                  command=" ".join(["python", "benchmarks/bench_nvme_step.py", *sys.argv[1:]]))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out_prefix}.json").write_text(json.dumps(result, indent=2))
    m = result["machine"]
    lines = [
        "# Optimizer step with Adam states on NVMe vs in host memory",
        "",
        f"Generated by `{result['command']}` on {m['date']}; {m['cpu']}, {m['cores']} cores, torch {m['torch']}.",
        f"GPT of {n_params / 1e6:.1f}M parameters (fp32), placement cpu, chunks of {chunk} elements, "
        f"pipeline depth {args.depth}; per step {2 * sum(sizes) / 1e9:.2f} GB moved "
        f"({sum(sizes) / 1e9:.2f} GB read + the same written). {args.rounds} interleaved rounds; medians.",
        "",
        "| round | host step s | NVMe step s | extra s | pure transfer s (write + read) | write GB/s | read GB/s | extra / transfer |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows + [dict(med, round="median")]:
        lines.append(f"| {row['round']} | {row['host_step_seconds']:.3f} | {row['nvme_step_seconds']:.3f} | "
                     f"{row['extra_seconds']:.3f} | {row['transfer_seconds']:.3f} | {row['write_gbps']:.2f} | "
                     f"{row['read_gbps']:.2f} | {row['ratio']:.2f} |")
    lines += ["", f"**Extra time of the NVMe step / pure transfer time: {med['ratio']:.2f} (target <= 1.2).**", ""]
    (RESULTS / f"{args.out_prefix}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
