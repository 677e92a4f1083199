"""Command line: ``python -m gemini demo`` (and the ``gemini`` console script)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

import gemini
from gemini.gpt import GPT, GPTConfig, synthetic_batch

GiB = 2**30


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def summary_line(loss: float, r: gemini.MemoryReport) -> str:
    """One readable line per step."""
    skipped = " SKIPPED (fp16 overflow)" if r.skipped else ""
    return (
        f"step {r.step:>3}  loss {loss:7.4f}  {r.step_seconds:6.2f} s  "
        f"device peak {_fmt_bytes(r.device_peak_bytes)} (model {_fmt_bytes(r.device_model_bytes)})  "
        f"host {_fmt_bytes(r.host_model_bytes)}  h2d {_fmt_bytes(r.h2d_bytes)}  d2h {_fmt_bytes(r.d2h_bytes)}  "
        f"transfer {r.transfer_seconds:.2f} s  adam cpu {r.optimizer_cpu_seconds:.2f} s "
        f"device {r.optimizer_device_seconds:.2f} s{skipped}"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT: {n_params / 1e6:.1f}M parameters, {args.layers} layers, width {args.embd}; "
          f"device={device} placement={args.placement} precision={args.precision}")
    config = gemini.GeminiConfig(
        device=device, placement=args.placement, precision=args.precision, chunk_size=args.chunk_size,
        report_path=args.report, clip_grad_norm=1.0,
    )
    gmodel, opt = gemini.initialize(model, config, lr=args.lr, weight_decay=0.1)
    mgr = opt._rt.manager
    print(f"chunks: {len(mgr.groups)} chunk groups of {mgr.chunk_size} elements "
          f"({mgr.waste_elements()} elements of padding)")
    gen = torch.Generator().manual_seed(1)
    batch = synthetic_batch(cfg, args.batch, args.seq, generator=gen, device=device)
    first = last = None
    start = time.perf_counter()
    for _ in range(args.steps):
        x, y = batch  # one batch, learned by heart: the loss visibly falls
        loss = GPT.loss(gmodel(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        last = loss.item()
        first = last if first is None else first
        print(summary_line(last, opt.report), flush=True)
    print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s, loss {first:.3f} -> {last:.3f}"
          + (f"; reports in {args.report}" if args.report else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemini", description="gemini-offload: train models larger than the device")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a small GPT for a few steps with per-step memory reports")
    d.add_argument("--device", choices=["cpu", "cuda"], default=None, help="compute device (default: cuda if present)")
    d.add_argument("--placement", choices=["cuda", "cpu"], default="cpu")
    d.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    d.add_argument("--steps", type=int, default=10)
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--embd", type=int, default=256)
    d.add_argument("--heads", type=int, default=4)
    d.add_argument("--vocab", type=int, default=4096)
    d.add_argument("--seq", type=int, default=128)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--chunk-size", type=int, default=None, help="elements per chunk (default: searched)")
    d.add_argument("--report", default=None, help="write one JSON line per step to this file")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
