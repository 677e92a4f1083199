"""Where tensors lie in chunks: `TensorSlot`, the next-fit packing of a param group's tensors
into chunks (`plan_layout`) and the capacity a chunk is allocated for what it holds
(`chunk_capacity`). Pure bookkeeping: nothing here allocates memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from offload import round_up

__all__ = ["CAPACITY_ALIGN_ELEMENTS", "SLOT_ALIGN_ELEMENTS", "TensorSlot", "chunk_capacity", "aligned_start",
           "plan_layout", "slot_offsets"]


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


# [Note: aligned slots]
# Each tensor of a chunk begins at a multiple of SLOT_ALIGN_ELEMENTS (16 elements: at least 16
# bytes of any dtype; chunk payloads themselves are 512-byte aligned by either allocator). cuBLAS
# and cuDNN choose kernels by the alignment of their operands, and kernels of different
# vector widths sum in different orders: parameters packed back to back (a 96-element bias
# starting 4 bytes into a cache line) made gemini's GPU runs differ from torch's own, whose
# tensors the allocator aligns, by 1e-7 relative, and Adam blew that up to steps of the
# learning rate's order on parameters whose gradient is rounding noise (an attention key's
# bias, a bias before BatchNorm). scripts/gpu_diag.py trained a GPT on an H200 (2026-11-26) with
# its parameters as views of one buffer: packed at an odd offset, 29 of 29 tensors differed from
# torch; aligned to 16 bytes, 512 bytes or 4 KiB, none did. The gaps cost at most 15 elements a
# tensor; they are zeros in every copy (see ``Chunk.has_gaps``) so that whole-chunk reductions
# (norms, Adam, inf checks) see nothing there.
SLOT_ALIGN_ELEMENTS = 16


def slot_offsets(numels: Sequence[int]) -> list[int]:
    """Where each of ``numels`` (tensors in one chunk, in order) begins; see [Note: aligned slots]."""
    offsets, end = [], 0
    for n in numels:
        start = aligned_start(end, n)
        offsets.append(start)
        end = start + n
    return offsets


def aligned_start(end: int, numel: int) -> int:
    """Where a tensor of ``numel`` elements begins after slots ending at ``end``: the next
    aligned element (an empty tensor, which no kernel reads, right at ``end``)."""
    return round_up(end, SLOT_ALIGN_ELEMENTS) if numel else end


def plan_layout(numels: Sequence[int], chunk_size: int) -> list[list[int]]:
    """Next-fit packing of tensors (in the given order) into chunks of ``chunk_size``, each tensor
    at an aligned offset (see [Note: aligned slots]).

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
        elif aligned_start(fill, n) + n > chunk_size or not chunks:  # not chunks: an empty tensor first
            chunks.append([i])
            fill = n
        else:
            chunks[-1].append(i)
            fill = aligned_start(fill, n) + n
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
