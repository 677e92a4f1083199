"""`ChunkGroup`: chunk k of a param group in every flavour (param, grad, master, m, v, ZeRO
shards), sharing one layout, and the views Adam reads and writes through."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from chunks.chunk import Chunk
from chunks.layout import TensorSlot
from chunks.shard import Shard
from chunks.storage import Tier

__all__ = ["ChunkGroup"]


@dataclass(eq=False)
class ChunkGroup:
    """Chunk k of a param group in all its flavours, with one layout.

    The optimizer-state chunk group (``master`` — the param chunk itself under fp32 — plus
    ``exp_avg`` and ``exp_avg_sq``) moves as a unit and is updated wherever it lies.

    Under ZeRO (``shard`` set, see [Note: ZeRO shards of a chunk] in chunks/shard.py) the
    master, m and v chunks hold this rank's range only; ``grad`` is the full-size bucket the
    backward pass fills, reduce-scattered into ``grad_shard``. With parameter sharding
    ``param_shard`` holds this rank's parameters and ``param`` is the gathered copy, RELEASED
    outside compute. Under fp32 the master is ``param_shard``, or without parameter sharding
    this rank's range of ``param`` (see :attr:`master_offset`).
    """

    index: int
    param_group: int  # index into the optimizer's param groups; -1 for frozen parameters
    slots: tuple[TensorSlot, ...]
    params: tuple[nn.Parameter, ...]  # by slot
    param: Chunk
    grad: Chunk | None = None
    master: Chunk | None = None
    exp_avg: Chunk | None = None
    exp_avg_sq: Chunk | None = None
    # Adam step count of each tensor (torch keeps one per parameter; they differ only when a
    # parameter got no gradient in some step). Lives with the optimizer states.
    steps: torch.Tensor | None = None
    # All step counts equal: the group can be updated as one flat tensor with one count.
    steps_uniform: bool = True
    # Per slot: does the gradient chunk hold a gradient for it since the last zero_grad?
    grad_ready: list[bool] = field(default_factory=list)
    # Slots whose gradient arrived in the backward pass now running.
    grads_this_backward: int = 0
    # ZeRO: this rank's range, the reduced gradients and (ZeRO-3) the parameters' shard.
    shard: Shard | None = None
    grad_shard: Chunk | None = None
    param_shard: Chunk | None = None
    grad_shard_filled: bool = False  # grad_shard holds a reduced gradient since zero_grad

    # Flat views of (master, grad, m, v) on one tier, and the chunk versions they were cut at.
    _step_views: tuple | None = field(default=None, repr=False)
    # (steps, its first count, the others) as views, cut once per steps tensor.
    _count_views: tuple | None = field(default=None, repr=False)

    @property
    def trainable(self) -> bool:
        return self.param_group >= 0

    def step_views(self, tier: Tier) -> tuple[torch.Tensor, ...]:
        """(master, grad, m, v) over this rank's range on ``tier``, cut once per move of any of them,
        without waiting for copies into the host copies: their reader waits (``Chunk.wait_host``)."""
        chunks = self.step_chunks
        key = (tier, *(c.version for c in chunks))
        if self._step_views is None or self._step_views[0] != key:
            n = self.os_numel
            offsets = (self.master_offset, 0, 0, 0)
            self._step_views = (key, tuple(c.payload(tier, wait=False)[o : o + n] for c, o in zip(chunks, offsets)))
        return self._step_views[1]

    def count_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first step count, the others) as views of :attr:`steps`: a whole group's update
        increments the first, and the others follow it."""
        cached = self._count_views
        if cached is None or cached[0] is not self.steps:
            cached = self._count_views = (self.steps, self.steps[0], self.steps[1:])
        return cached[1], cached[2]

    def slot_views(self, slot: TensorSlot, tier: Tier) -> tuple[torch.Tensor, ...]:
        """(master, grad, m, v) of one of :attr:`os_slots` on ``tier``, flat (as :meth:`step_views`)."""
        offsets = (self.master_offset, 0, 0, 0)
        return tuple(c.payload(tier, wait=False)[o + slot.offset : o + slot.end]
                     for c, o in zip(self.step_chunks, offsets))

    @property
    def step_chunks(self) -> tuple[Chunk, Chunk, Chunk, Chunk]:
        """The chunks Adam reads and writes: (master, gradient, m, v)."""
        return (self.master_chunk, self.step_grad, self.exp_avg, self.exp_avg_sq)

    @property
    def master_chunk(self) -> Chunk:
        """The fp32 weights Adam updates: the master chunk, or the param chunk (or, with
        parameter sharding, the param shard) under fp32."""
        if self.master is not None:
            return self.master
        return self.param_shard if self.param_shard is not None else self.param

    @property
    def master_offset(self) -> int:
        """Where this rank's range starts in :attr:`master_chunk` (non-zero only when the master
        is the whole param chunk of a sharded group)."""
        return self.shard.start if self.shard is not None and self.master_chunk is self.param else 0

    @property
    def step_grad(self) -> Chunk:
        """The gradients the step uses: the reduced shard under ZeRO, else the gradient chunk."""
        return self.grad_shard if self.grad_shard is not None else self.grad

    def is_shard(self, chunk: Chunk) -> bool:
        """``chunk`` holds this rank's range only (a ZeRO shard chunk)."""
        return self.shard is not None and chunk.capacity != self.param.capacity

    def write_value(self, chunk: Chunk, slot: TensorSlot, value: torch.Tensor) -> None:
        """Write tensor ``slot``'s full ``value`` into ``chunk``: all of it, or (a shard chunk)
        the piece of it inside this rank's range."""
        flat = value.reshape(-1)
        if not self.is_shard(chunk):
            chunk.write_range(slot.offset, flat)
            return
        for piece in chunk.slots:
            if piece.index == slot.index:
                chunk.write_range(piece.offset, flat[piece.tensor_offset : piece.tensor_offset + piece.numel])

    @functools.cached_property
    def os_slots(self) -> tuple[TensorSlot, ...]:
        """The tensors (or, under ZeRO, pieces of them) this rank's optimizer states cover."""
        return self.shard.cut(self.slots) if self.shard is not None else self.slots

    @property
    def os_numel(self) -> int:
        """Elements of this rank's optimizer states (the whole shard, or the chunk's used part)."""
        return self.shard.numel if self.shard is not None else self.param.used_numel

    @property
    def optimizer_chunks(self) -> tuple[Chunk, ...]:
        assert self.trainable, f"group {self.index} is frozen"
        return (self.master_chunk, self.exp_avg, self.exp_avg_sq)

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return tuple(c for c in (self.param, self.param_shard, self.grad, self.grad_shard, self.master, self.exp_avg,
                                 self.exp_avg_sq) if c is not None)

    @property
    def all_grads_ready(self) -> bool:
        return all(self.grad_ready)

    @property
    def any_grad_ready(self) -> bool:
        return any(self.grad_ready)
