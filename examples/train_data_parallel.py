"""Train a GPT on 2 data-parallel ranks with ZeRO: each rank keeps half of every chunk's
fp32 master, Adam m and v and gradients (and, with --shard-params, parameters).

    torchrun --standalone --nproc-per-node 2 examples/train_data_parallel.py
    torchrun --standalone --nproc-per-node 2 examples/train_data_parallel.py --shard-params --checkpoint ckpt/

On GPUs each rank takes the GPU of its LOCAL_RANK and the ranks talk over NCCL; on a CPU-only
machine they use gloo and the CPU stands in for the device. Every rank trains on its own
part of each global batch; rank 0 prints the loss averaged over the ranks and its memory
report. With --checkpoint the run saves a consolidated checkpoint (``model.pt``: a plain
module loads its "model" part) and a sharded one (``sharded/``, a file per rank), then loads
the consolidated one back.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import gemini
from gemini.tools.cli_options import POSITIVE
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=POSITIVE, default=5)
    p.add_argument("--layers", type=POSITIVE, default=4)
    p.add_argument("--embd", type=POSITIVE, default=256)
    p.add_argument("--vocab", type=POSITIVE, default=4096)
    p.add_argument("--seq", type=POSITIVE, default=64)
    p.add_argument("--batch", type=POSITIVE, default=8, help="global batch, split between the ranks")
    p.add_argument("--placement", default="cpu", choices=["cpu", "auto", "cuda", "static"])
    p.add_argument("--shard-params", action="store_true", help="ZeRO-3: shard the parameters too")
    p.add_argument("--checkpoint", default=None, help="folder for the checkpoints")
    args = p.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.batch % world:
            raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")
        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
        torch.manual_seed(0)  # the same initial model on every rank
        config = gemini.GeminiConfig(device=str(device), placement=args.placement, process_group=dist.group.WORLD,
                                     shard_params=args.shard_params)
        model, optimizer = gemini.initialize(GPT(cfg), config, lr=3e-4, weight_decay=0.01)
        g = torch.Generator().manual_seed(1)  # the same global batches on every rank
        n = args.batch // world
        for _ in range(args.steps):
            x, y = synthetic_batch(cfg, args.batch, args.seq, generator=g)
            x, y = x[rank * n : (rank + 1) * n].to(device), y[rank * n : (rank + 1) * n].to(device)
            loss = GPT.loss(model(x), y)
            optimizer.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            mean_loss = loss.detach().float().cpu()
            dist.all_reduce(mean_loss)
            if rank == 0:
                # The loss of the whole global batch (the mean over ranks); steps counted from 1.
                print(gemini.summary_line(optimizer.report, loss=mean_loss.item() / world), flush=True)
        if args.checkpoint:
            gemini.save_checkpoint(os.path.join(args.checkpoint, "model.pt"), model, optimizer)
            gemini.save_checkpoint(os.path.join(args.checkpoint, "sharded"), model, optimizer, sharded=True)
            gemini.load_checkpoint(os.path.join(args.checkpoint, "model.pt"), model, optimizer)
            if rank == 0:
                print(f"checkpoints saved in {args.checkpoint} (model.pt consolidated, sharded/ one file per rank)")
        optimizer.close()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
