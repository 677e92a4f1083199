"""Train a GPT whose model data is several times the device budget.

    python examples/train_gpt_larger_than_device.py
    python examples/train_gpt_larger_than_device.py --device cuda --layers 24 --embd 1024 --model-to-budget 4

The planner first sizes the model data (and from it the device budget; ``gemini plan`` says
where every byte will go, before a run); then placement "auto" traces one warm-up
iteration and from then on keeps the device under ``device_memory`` by moving chunks between
the device and the host. Each step prints its memory report as one line. On a machine without
a GPU the CPU stands in for the device (``--device cpu``, the default there), with real copies
between a "device" tier held to the budget and a host tier.
"""

from __future__ import annotations

import argparse

import torch

import gemini
from gemini.tools.cli_options import POSITIVE, number_in
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=POSITIVE, default=6)
    p.add_argument("--embd", type=POSITIVE, default=512)
    p.add_argument("--vocab", type=POSITIVE, default=1024)
    p.add_argument("--seq", type=POSITIVE, default=32)
    p.add_argument("--batch", type=POSITIVE, default=2)
    p.add_argument("--steps", type=POSITIVE, default=8)
    p.add_argument("--model-to-budget", type=number_in(1.0), default=4.0, help="model data / device budget")
    args = p.parse_args(argv)

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.embd)
    torch.manual_seed(0)
    model = GPT(cfg)

    # Before training: how much model data there is, and so the budget this run gives the device.
    plan = gemini.plan_placement(model, gemini.GeminiConfig(device=args.device, placement="cpu"))
    model_bytes = sum(plan.tier_bytes(tier) for tier in ("device", "host", "nvme"))
    budget = int(model_bytes / args.model_to_budget)
    print(f"model data {model_bytes / 2**20:.1f} MiB; device budget {budget / 2**20:.1f} MiB")

    config = gemini.GeminiConfig(device=args.device, placement="auto", device_memory=budget, clip_grad_norm=1.0)
    model, optimizer = gemini.initialize(model, config, lr=1e-3, weight_decay=0.1)
    x, y = synthetic_batch(cfg, args.batch, args.seq, generator=torch.Generator().manual_seed(1), device=args.device)
    for _ in range(args.steps):
        loss = GPT.loss(model(x), y)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        print(gemini.summary_line(optimizer.report, loss=loss.item(), unit="MiB"), flush=True)
        assert optimizer.report.device_peak_bytes <= budget  # the budget is a promise
    optimizer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
