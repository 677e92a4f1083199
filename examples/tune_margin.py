"""Tune ``gpu_margin_mem_ratio``: run a few steps at each ratio, recommend the fastest within headroom.

    python examples/tune_margin.py
    python examples/tune_margin.py --device cuda --layers 24 --embd 1024 --budget 8GiB --ratios 0,0.25,0.5,1

Under placement "auto", the margin left on the device after the warm-up's needs can hold
optimizer-state chunk groups, updated there by the device Adam instead of on the host. The
ratio is the share of the margin they get; the best one depends on the model and the machine,
so the tuner measures. (The same as ``python -m gemini tune-margin``.)
"""

from __future__ import annotations

import argparse

import torch

import gemini
from gemini.tools.cli_options import POSITIVE, byte_size, ratio_list
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=POSITIVE, default=4)
    p.add_argument("--embd", type=POSITIVE, default=384)
    p.add_argument("--vocab", type=POSITIVE, default=1024)
    p.add_argument("--seq", type=POSITIVE, default=32)
    p.add_argument("--batch", type=POSITIVE, default=2)
    p.add_argument("--budget", type=byte_size, default="64MiB", help="device_memory")
    p.add_argument("--ratios", type=ratio_list, default="0,0.25,0.5,0.75,1")
    p.add_argument("--steps", type=POSITIVE, default=4, help="per ratio; the first is the warm-up")
    args = p.parse_args(argv)

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    x, y = synthetic_batch(cfg, args.batch, args.seq, generator=torch.Generator().manual_seed(1), device=args.device)

    def make_model() -> GPT:  # the same model for every trial
        torch.manual_seed(0)
        return GPT(cfg)

    config = gemini.GeminiConfig(device=args.device, placement="auto", device_memory=args.budget)
    tuning = gemini.tune_margin(
        make_model, lambda model: GPT.loss(model(x), y), config,
        ratios=args.ratios, steps=args.steps, headroom_fraction=0.1, lr=1e-3,
        on_trial=lambda t: print(f"ratio {t.ratio:g} done", flush=True),
    )
    print(tuning.table())
    print(tuning.recommendation())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
