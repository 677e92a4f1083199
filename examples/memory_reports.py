"""Write a memory report per step to JSON Lines, read it back, summarise it and plot it.

    python examples/memory_reports.py --out reports/
    python -m gemini report reports/reports.jsonl --plot-dir reports/   # the same from the shell

Writes ``reports.jsonl`` (one ``gemini.MemoryReport`` per step), ``memory.png`` (memory per
step by tier and chunk kind, with the device's peak against the budget) and ``timeline.png``
(the warm-up iteration's non-model peak per period against the budget) into ``--out``.
Plots need matplotlib (``pip install 'gemini-offload[plot]'``).
"""

from __future__ import annotations

import argparse
import os

import torch

import gemini
from gemini.tools.cli_options import POSITIVE, byte_size
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=POSITIVE, default=6)
    p.add_argument("--layers", type=POSITIVE, default=4)
    p.add_argument("--embd", type=POSITIVE, default=256)
    p.add_argument("--budget", type=byte_size, default="24MiB", help="device_memory")
    args = p.parse_args(argv)

    cfg = GPTConfig(vocab_size=1024, block_size=32, n_layer=args.layers, n_head=4, n_embd=args.embd)
    torch.manual_seed(0)
    path = os.path.join(args.out, "reports.jsonl")
    config = gemini.GeminiConfig(device=args.device, placement="auto", device_memory=args.budget,
                                 gpu_margin_mem_ratio=0.5, report_path=path)
    model, optimizer = gemini.initialize(GPT(cfg), config, lr=1e-3)
    x, y = synthetic_batch(cfg, 2, 32, generator=torch.Generator().manual_seed(1), device=args.device)
    for _ in range(args.steps):
        optimizer.backward(GPT.loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    optimizer.close()

    reports = gemini.read_reports(path)  # the file holds exactly what optimizer.report held, step by step
    first = reports[0]
    print(f"step 1 (the warm-up) traced {len(first.timeline.periods)} periods; "
          f"its largest non-model peak was {first.timeline.max_non_model_bytes / 2**20:.2f} MiB")
    print("on the host at the end of the last step, by chunk kind (bytes):", reports[-1].model_bytes_by_tier["host"])
    print(gemini.run_summary(reports, unit="MiB"))
    try:
        print("wrote", gemini.plot_memory(reports, os.path.join(args.out, "memory.png")))
        print("wrote", gemini.plot_timeline(first.timeline, os.path.join(args.out, "timeline.png")))
    except ImportError as e:  # matplotlib is an optional extra
        print(f"no plots: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
