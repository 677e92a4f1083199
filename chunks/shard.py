"""`Shard`: the part of a chunk one data-parallel rank owns (ZeRO), and the tensors it cuts.

[Note: ZeRO shards of a chunk]
A chunk of ``capacity`` elements (a multiple of the world size) is cut into ``world`` equal
contiguous ranges; rank r owns ``[r * numel, (r + 1) * numel)``. The rank keeps its range of
the fp32 master, Adam's m and v and the reduced gradient (and, with parameter sharding, of the
parameters); the tensors of the chunk fall across ranges wherever the cut lands, so a tensor
may be split between two ranks. ``Shard.slots`` lists the pieces of tensors inside this rank's
range, with offsets relative to the range's start, so that the optimizer can index its shard
chunks (``numel`` elements) exactly as it indexes whole chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chunks.layout import TensorSlot

__all__ = ["Shard"]


@dataclass(frozen=True)
class Shard:
    """Rank ``rank``'s range of a chunk of ``numel * world`` elements."""

    rank: int
    world: int
    numel: int  # elements per rank

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world, f"{self.rank=} outside {self.world=}"

    @property
    def start(self) -> int:
        return self.rank * self.numel

    @property
    def end(self) -> int:
        return self.start + self.numel

    @classmethod
    def of(cls, capacity: int, *, rank: int, world: int) -> Shard:
        if capacity % world:
            raise ValueError(f"chunk capacity {capacity} is not divisible by the world size {world}")
        return cls(rank=rank, world=world, numel=capacity // world)

    def cut(self, slots: Sequence[TensorSlot]) -> tuple[TensorSlot, ...]:
        """The pieces of ``slots`` inside this range, offsets relative to :attr:`start`."""
        out = []
        for s in slots:
            lo, hi = max(s.offset, self.start), min(s.end, self.end)
            if lo < hi:
                out.append(TensorSlot(s.index, lo - self.start, hi - lo, torch.Size([hi - lo]), s.name,
                                      tensor_offset=lo - s.offset))
        return tuple(out)
