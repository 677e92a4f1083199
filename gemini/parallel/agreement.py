"""What the ranks of a ZeRO group must agree on before the first chunk-sized collective.

[Note: ranks agree at initialize]
Every ZeRO collective is sized by the chunk layout and matched across ranks by issue order ([Note: the order of
collectives] in gemini/parallel/zero.py). Ranks that build different layouts (another ``chunk_size``, precision or
``shard_params``, one more layer) would pair buffers of different sizes: gloo aborts the process from C++, NCCL hangs
or reads past the end. So ``initialize`` first all-gathers a fixed-size digest of what decides the layout and the
collectives (:func:`describe`: one 64-bit hash per entry, the same entries on every rank, so this collective always
matches), and every rank raises the same ``ValueError`` when one differs; only then are the full descriptions
exchanged, to say what differs. Settings that only place chunks on this rank (placement, budgets, NVMe) may differ.

Then, as DDP's ``_sync_module_states``, each chunk group's first values (``ChunkManager.register``'s ``sync``:
``Collectives.broadcast``) and each buffer (:func:`sync_buffers`) are rank 0's, so ranks initialized from different
seeds train rank 0's model, not a splice of every rank's ranges. Chunk values read from a ``weights`` file are the
same on every rank and are not sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemini.config import SCALER_FIELDS, GeminiConfig
from gemini.parallel.collectives import Collectives

__all__ = ["check_ranks_agree", "describe", "sync_buffers"]



def describe(config: GeminiConfig, *, chunk_size: int, named_groups: Sequence[Sequence[tuple[str, nn.Parameter]]],
             frozen: Sequence[tuple[str, nn.Parameter]], model: nn.Module) -> dict[str, Any]:
    """This rank's entries of [Note: ranks agree at initialize]: always the same keys."""
    return {
        "chunk_size": chunk_size,
        "precision": config.precision,
        "shard_params": config.shard_params,
        "clip_grad_norm": config.clip_grad_norm,
        "fp16 loss scaler": {f: getattr(config, f) for f in SCALER_FIELDS} if config.precision == "fp16" else None,
        "trainable tensors per param group": [len(g) for g in named_groups],
        "parameters": [(n, tuple(p.shape), p.requires_grad) for g in (*named_groups, frozen) for n, p in g],
        "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
    }


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def check_ranks_agree(comm: Collectives, description: dict[str, Any]) -> None:
    """Raise ``ValueError`` on every rank when the ranks' descriptions differ, naming the entries."""
    mine = torch.tensor([_digest(v) for v in description.values()], dtype=torch.int64)
    every = torch.empty(comm.world * mine.numel(), dtype=torch.int64)
    comm.all_gather(every, mine).wait()
    every = every.view(comm.world, -1)
    if bool((every == every[0]).all()):
        return
    # Rare: every rank saw the same mismatch, so every rank takes this second collective.
    descriptions: list[Any] = [None] * comm.world
    dist.all_gather_object(descriptions, description, group=comm.group)
    problems = [_difference(key, descriptions) for i, key in enumerate(description)
                if not bool((every[:, i] == every[0, i]).all())]
    raise ValueError(
        f"the {comm.world} ranks of GeminiConfig.process_group disagree on what they train: "
        + "; ".join(problems)
        + ". Every rank must build the same model and give gemini.initialize the same values of these GeminiConfig "
          "fields"
    )


def _difference(key: str, descriptions: list[dict[str, Any]]) -> str:
    """``key``'s first rank differing from rank 0, and how."""
    first = descriptions[0][key]
    rank = next(r for r, d in enumerate(descriptions) if d[key] != first)
    other = descriptions[rank][key]
    if not isinstance(first, list):
        return f"{key}: rank {rank} has {other!r}, rank 0 {first!r}"
    at = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
    show = lambda v: repr(v[at]) if at < len(v) else "none"  # noqa: E731
    counts = f" rank {rank} has {len(other)} entries, rank 0 {len(first)};" if len(first) != len(other) else ""
    return f"{key}:{counts} at #{at} rank {rank} has {show(other)}, rank 0 {show(first)}"


@torch.no_grad()
def sync_buffers(comm: Collectives, model: nn.Module) -> None:
    """Every buffer of ``model`` becomes rank 0's, in ``named_buffers`` order (the same on every rank: checked by
    :func:`check_ranks_agree`)."""
    for _, buf in model.named_buffers():
        staged = buf if buf.is_contiguous() else buf.contiguous()
        comm.broadcast(staged)
        if staged is not buf:
            buf.copy_(staged)
