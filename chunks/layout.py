"""Where tensors lie in chunks: `TensorSlot`, the next-fit packing of a param group's tensors
into chunks (`plan_layout`) and the capacity a chunk is allocated for what it holds
(`chunk_capacity`). Pure bookkeeping: nothing here allocates memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from offload import round_up

__all__ = ["CAPACITY_ALIGN_ELEMENTS", "TensorSlot", "chunk_capacity", "plan_layout"]


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor sits in its chunk."""

    index: int  # position in the chunk's slot list
    offset: int  # first element
    numel: int
    shape: torch.Size
    name: str  # the parameter's (first) qualified name in the module
    # First element within the flattened tensor: 0 for a whole tensor, else where a ZeRO
    # shard's piece of it begins (see chunks/shard.py; ``shape`` is then flat).
    tensor_offset: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.numel


def plan_layout(numels: Sequence[int], chunk_size: int) -> list[list[int]]:
    """Next-fit packing of tensors (in the given order) into chunks of ``chunk_size``.

    Returns, per chunk, the indices of the tensors it holds. A tensor larger than the chunk
    size gets a chunk of its own (sized to it), so nothing is ever split.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be a positive number of elements")
    chunks: list[list[int]] = []
    fill = chunk_size  # forces a new chunk for the first tensor
    for i, n in enumerate(numels):
        if n > chunk_size:
            chunks.append([i])
            fill = chunk_size  # the oversized chunk is closed
        elif fill + n > chunk_size or not chunks:  # not chunks: an empty tensor first
            chunks.append([i])
            fill = n
        else:
            chunks[-1].append(i)
            fill += n
    return chunks


# [Note: chunks sized to their content]
# Next-fit packing closes a chunk when the next tensor does not fit, so a chunk may hold far
# less than ``chunk_size`` (the last of a group, or a LayerNorm before a large Linear). Such a
# chunk is allocated for what it holds, rounded up to CAPACITY_ALIGN_ELEMENTS (4 KiB of fp32:
# aligned views, whole pages for NVMe's direct I/O) and never beyond ``chunk_size``: a full
# ``chunk_size`` buffer cost a nearly empty chunk the device memory and the copies of a full
# one. Host buffers still come from the pinned pool's size classes, so chunks of nearby sizes
# reuse each other's buffers.
CAPACITY_ALIGN_ELEMENTS = 1024


def chunk_capacity(used_numel: int, chunk_size: int, *, world: int = 1) -> int:
    """Elements allocated for a chunk holding ``used_numel`` (see [Note: chunks sized to their
    content]); a multiple of ``world``, so that every rank's shard is equal."""
    # max(.., 1): a chunk of zero-element tensors only (an empty bias) still has a buffer to view.
    capacity = min(max(chunk_size, used_numel), round_up(max(used_numel, 1), CAPACITY_ALIGN_ELEMENTS))
    return round_up(capacity, world)
