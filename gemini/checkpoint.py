"""Checkpoint files: consolidated (one file, any world size) or sharded (one file per rank).

- Consolidated: ``model.state_dict()`` (the wrapped module's keys, full fp32 values: a plain
  ``nn.Module`` loads it) and ``optimizer.state_dict()`` (``torch.optim.AdamW``'s format), both
  gathered from every rank's shards and written by rank 0. It loads into any number of ranks:
  each rank takes its own range of every tensor.
- Sharded: each rank writes its own ranges (``optimizer.sharded_state_dict()``) and the
  module's buffers, with no communication; it loads only into the same world size and layout.

Under ZeRO both functions are collectives: every rank of the group calls them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gemini.module import GeminiModel
from gemini.optimizer import HybridAdam

__all__ = ["load_checkpoint", "save_checkpoint"]


def _shard_file(folder: Path, rank: int, world: int) -> Path:
    return folder / f"rank{rank:05d}-of-{world:05d}.pt"


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a truncated checkpoint under the name


def _buffers(model: GeminiModel) -> dict[str, torch.Tensor]:
    own = model.module.state_dict(keep_vars=True)
    return {k: v.detach().cpu().clone() for k, v in own.items() if not isinstance(v, nn.Parameter)}


def save_checkpoint(path: str | os.PathLike, model: GeminiModel, optimizer: HybridAdam, *,
                    sharded: bool = False) -> None:
    """Write a consolidated checkpoint file at ``path`` (rank 0 writes), or with ``sharded`` one
    file per rank into the folder ``path``."""
    zero, manager = optimizer._rt.zero, optimizer._rt.manager
    rank, world = manager.rank, manager.world
    path = Path(path)
    if sharded:
        path.mkdir(parents=True, exist_ok=True)
        _atomic_save({"buffers": _buffers(model), "optimizer": optimizer.sharded_state_dict()},
                     _shard_file(path, rank, world))
    else:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_save(state, path)
    if zero is not None:
        zero.barrier()  # on return the checkpoint is complete for every rank


def load_checkpoint(path: str | os.PathLike, model: GeminiModel, optimizer: HybridAdam | None = None, *,
                    sharded: bool = False) -> None:
    """Load what ``save_checkpoint`` wrote (the optimizer part only if ``optimizer`` is given)."""
    path = Path(path)
    if sharded:
        if optimizer is None:
            raise ValueError("a sharded checkpoint holds the parameters in the optimizer's masters: pass the optimizer")
        rank, world = optimizer._rt.manager.rank, optimizer._rt.manager.world
        file = _shard_file(path, rank, world)
        if not file.exists():
            found = sorted(p.name for p in path.glob("rank*-of-*.pt"))
            raise FileNotFoundError(f"no shard {file.name} in {path} for rank {rank} of {world} (found {found}); "
                                    f"a sharded checkpoint loads only into the world size that saved it")
        state = torch.load(file, map_location="cpu", weights_only=False)
        with torch.no_grad():
            own = model.module.state_dict(keep_vars=True)
            for key, value in state["buffers"].items():
                own[key].copy_(value)
        optimizer.load_sharded_state_dict(state["optimizer"])
        return
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
