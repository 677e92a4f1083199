"""Train a GPT whose training state is larger than this machine's RAM, states on NVMe.

Run from the repository root on a quiet machine (~6 minutes on the 2-core, 24 GiB VM; needs
~26 GB free under --dir):

    python benchmarks/bench_larger_than_ram.py
    python benchmarks/bench_larger_than_ram.py --layers 26 --embd 2560 --cpu-memory 3GiB --steps 3

The default GPT has ~2.07B parameters in bf16 with fp32 masters: parameters 2 + gradients 2 +
master 4 + Adam m 4 + v 4 = 16 bytes per parameter, ~33 GB of training state against 24 GiB
of RAM. The CPU is the compute device (placement "cpu"); parameters and gradients live in host
memory, and masters, m and v in files under --dir, streamed through each step's pipeline
(read ahead, CPU Adam, write behind) within ``cpu_memory``. The model is built with bf16
weights (``torch.set_default_dtype``), so that its construction does not need 8 GB of fp32.
Each step sees 2 tokens: on a CPU without avx512_bf16, torch's bf16 backward matmuls fall back
to a naive single-threaded GEMM (2.5 s for one 2560x10240 layer at 16 tokens), and the point
here is the memory and the NVMe traffic, which do not depend on the batch.

Recorded per step: step time, optimizer-step time, bytes read from and written to NVMe, the
disk bandwidth achieved during the optimizer step, time spent waiting on NVMe, and the
process's resident memory (sampled every 50 ms, and the kernel's high-water mark).
Results go to benchmarks/results/larger_than_ram.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemini  # noqa: E402
from bench_step import machine_info  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from offload import format_size, parse_size  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class RssSampler:
    """The process's resident set size, sampled on a thread: the peak and when it happened."""

    def __init__(self, interval_seconds: float = 0.05) -> None:
        self.interval_seconds = interval_seconds
        self.peak_bytes = 0
        self.phase = "start"
        self.peak_phase = "start"
        self._stop = threading.Event()
        self._process = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            rss = self._process.memory_info().rss
            if rss > self.peak_bytes:
                self.peak_bytes, self.peak_phase = rss, self.phase

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=str(RESULTS / "tmp"), help="folder on the NVMe drive")
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--embd", type=int, default=2560)
    parser.add_argument("--seq", type=int, default=2, help="tokens per step (batch 1)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu-memory", default="3GiB", help="host budget for optimizer states")
    parser.add_argument("--chunk", type=int, default=None,
                        help="chunk size in elements (default: the search for the least padding)")
    parser.add_argument("--depth", type=int, default=2, help="nvme_pipeline_depth")
    parser.add_argument("--out-prefix", default="larger_than_ram")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    ram_bytes = psutil.virtual_memory().total
    cfg = GPTConfig(vocab_size=8192, block_size=max(64, args.seq), n_layer=args.layers, n_head=max(1, args.embd // 128),
                    n_embd=args.embd)

    with RssSampler() as rss:
        rss.phase = "build"
        start = time.perf_counter()
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = GPT(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        state_bytes = 16 * n_params
        print(f"GPT {n_params / 1e9:.2f}B parameters: training state {format_size(state_bytes)} "
              f"({state_bytes / 1e9:.1f} GB) against {format_size(ram_bytes)} of RAM", flush=True)
        rss.phase = "initialize"
        config = gemini.GeminiConfig(device="cpu", placement="cpu", precision="bf16", chunk_size=args.chunk,
                                     cpu_memory=parse_size(args.cpu_memory), nvme_dir=args.dir,
                                     nvme_pipeline_depth=args.depth)
        gmodel, opt = gemini.initialize(model, config, lr=1e-4, weight_decay=0.1)
        init_seconds = time.perf_counter() - start
        layout = opt._rt.nvme.layout
        print(f"initialize: {init_seconds:.1f} s; {len(layout.nvme_groups)} of {len(opt._rt.manager.trainable_groups)} "
              f"chunk groups' states on NVMe ({format_size(layout.nvme_bytes)}), "
              f"{format_size(layout.host_bytes)} in host memory; RSS {format_size(psutil.Process().memory_info().rss)}",
              flush=True)
        gen = torch.Generator().manual_seed(1)
        rows = []
        for step in range(args.steps):
            x, y = synthetic_batch(cfg, 1, args.seq, generator=gen)
            rss.phase = f"step {step} forward/backward"
            start = time.perf_counter()
            loss = GPT.loss(gmodel(x), y)
            opt.backward(loss)
            rss.phase = f"step {step} optimizer"
            opt_start = time.perf_counter()
            opt.step()
            opt_seconds = time.perf_counter() - opt_start
            opt.zero_grad()
            step_seconds = time.perf_counter() - start
            r = opt.report
            moved = r.nvme_read_bytes + r.nvme_write_bytes
            row = dict(step=step, loss=loss.item(), step_seconds=step_seconds, optimizer_step_seconds=opt_seconds,
                       nvme_read_bytes=r.nvme_read_bytes, nvme_write_bytes=r.nvme_write_bytes,
                       nvme_gbps_during_step=moved / opt_seconds / 1e9, nvme_wait_seconds=r.nvme_wait_seconds,
                       optimizer_cpu_seconds=r.optimizer_cpu_seconds, host_model_bytes=r.host_model_bytes,
                       nvme_bytes=r.nvme_bytes, host_pool_bytes=r.host_pool_bytes, rss_bytes=r.host_rss_bytes)
            rows.append(row)
            print(f"step {step}: loss {row['loss']:.4f}, {step_seconds:.1f} s (optimizer {opt_seconds:.1f} s), "
                  f"NVMe read {format_size(r.nvme_read_bytes)} + write {format_size(r.nvme_write_bytes)} "
                  f"= {row['nvme_gbps_during_step']:.2f} GB/s, waited {r.nvme_wait_seconds:.1f} s; "
                  f"RSS {format_size(r.host_rss_bytes)}", flush=True)
        rss.phase = "close"
        opt.close()
    max_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    result = dict(machine=machine_info("cpu"), command=" ".join(["python", "benchmarks/bench_larger_than_ram.py",
                                                                *sys.argv[1:]]),
                  params=n_params, training_state_bytes=state_bytes, ram_bytes=ram_bytes, config=vars(args),
                  chunk_groups=len(opt._rt.manager.groups), nvme_groups=len(layout.nvme_groups),
                  nvme_state_bytes=layout.nvme_bytes, host_state_bytes=layout.host_bytes,
                  initialize_seconds=init_seconds, steps=rows, peak_rss_bytes=rss.peak_bytes,
                  peak_rss_phase=rss.peak_phase, ru_maxrss_bytes=max_rss_bytes)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out_prefix}.json").write_text(json.dumps(result, indent=2))
    m = result["machine"]
    depth = f"{layout.depth}" + (f" (asked {args.depth}: cpu_memory holds no more)" if layout.depth != args.depth else "")
    lines = [
        "# A GPT larger than RAM: optimizer states on NVMe",
        "",
        f"Generated by `{result['command']}` on {m['date']}; {m['cpu']}, {m['cores']} cores, "
        f"{format_size(ram_bytes)} RAM, torch {m['torch']}.",
        "",
        f"GPT of **{n_params / 1e9:.2f}B parameters**, bf16 with fp32 masters: training state "
        f"**{state_bytes / 1e9:.1f} GB** (16 bytes per parameter) against **{format_size(ram_bytes)}** of RAM. "
        f"Placement cpu (the CPU is the device), cpu_memory {args.cpu_memory}, chunks of "
        f"{opt._rt.manager.chunk_size} elements, "
        f"pipeline depth {depth}: {len(layout.nvme_groups)} of {len(opt._rt.manager.trainable_groups)} chunk "
        f"groups' masters and Adam states on NVMe ({layout.nvme_bytes / 1e9:.1f} GB). "
        f"initialize took {init_seconds:.0f} s (it writes those states once).",
        "",
        "| step | loss | step s | optimizer step s | NVMe read GB | NVMe write GB | NVMe GB/s during the step | waited on NVMe s | RSS GiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['step']} | {r['loss']:.4f} | {r['step_seconds']:.1f} | {r['optimizer_step_seconds']:.1f} | "
                     f"{r['nvme_read_bytes'] / 1e9:.2f} | {r['nvme_write_bytes'] / 1e9:.2f} | "
                     f"{r['nvme_gbps_during_step']:.2f} | {r['nvme_wait_seconds']:.1f} | {r['rss_bytes'] / 2**30:.2f} |")
    lines += ["", f"**Peak RSS {rss.peak_bytes / 2**30:.2f} GiB ({rss.peak_bytes / ram_bytes:.0%} of RAM; during "
                  f"{rss.peak_phase}); kernel high-water mark {max_rss_bytes / 2**30:.2f} GiB.**", ""]
    (RESULTS / f"{args.out_prefix}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
