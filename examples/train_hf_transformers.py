"""Train a Hugging Face ``transformers`` model, built from a config (nothing is downloaded).

    python examples/train_hf_transformers.py
    python examples/train_hf_transformers.py --device cuda --layers 12 --embd 768 --budget 2GiB

Any ``nn.Module`` works with ``gemini.initialize``; here a GPT-2 language model made from a
``GPT2Config`` with random weights, under placement "auto" and a device budget below its model
data. Needs ``pip install transformers``; without it the script says so and exits cleanly.
"""

from __future__ import annotations

import argparse

import torch

import gemini
from gemini.tools.cli_options import POSITIVE, byte_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=POSITIVE, default=4)
    p.add_argument("--embd", type=POSITIVE, default=256)
    p.add_argument("--vocab", type=POSITIVE, default=2048)
    p.add_argument("--seq", type=POSITIVE, default=32)
    p.add_argument("--steps", type=POSITIVE, default=5)
    p.add_argument("--budget", type=byte_size, default="16MiB", help="device_memory")
    args = p.parse_args(argv)
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("transformers is not installed: skipping this example (pip install transformers)")
        return 0
    transformers.logging.set_verbosity_error()  # its notes on config defaults are not for this demo

    torch.manual_seed(0)
    hf_config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.embd, n_layer=args.layers,
                           n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(hf_config)  # random weights from the config: no download
    config = gemini.GeminiConfig(device=args.device, placement="auto", device_memory=args.budget)
    model, optimizer = gemini.initialize(model, config, lr=1e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (2, args.seq), generator=generator).to(args.device)
    for _ in range(args.steps):
        loss = model(input_ids=tokens, labels=tokens).loss  # transformers shifts the labels itself
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        print(gemini.summary_line(optimizer.report, loss=loss.item(), unit="MiB"), flush=True)
    optimizer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
