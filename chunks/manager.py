"""`ChunkManager`: packs a model's parameters into chunk groups and keeps their views right."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from chunks.chunk import Chunk, ChunkKind, ChunkState, TensorSlot
from chunks.shard import Shard
from chunks.storage import ChunkStorage, Tier
from offload import round_up

logger = logging.getLogger(__name__)

__all__ = ["CAPACITY_ALIGN_ELEMENTS", "ChunkGroup", "ChunkManager", "ValueSource", "chunk_capacity", "plan_layout",
           "values_of_params"]

NamedParams = Sequence[tuple[str, nn.Parameter]]

# [Note: where a chunk's first values come from]
# ``register`` fills each chunk group from a *value source*: called as ``source(param, slot,
# start, stop)`` it returns elements ``[start, stop)`` of the flattened tensor of ``slot`` (any
# dtype: the chunk casts). The manager asks once per tensor per group, for the range that the
# group's chunks need (the whole tensor, or under ZeRO with parameter sharding only this
# rank's piece), fills the param and master chunks from that one value, and drops it before the
# next group is built. So a source that reads from disk (gemini/pretrained.py) or initializes
# module by module holds one group's values at a time, and a group is complete — and can be
# spilled to NVMe by ``on_group`` — before the next one is read. The default source is the
# parameters' own data.
ValueSource = Callable[[nn.Parameter, "TensorSlot", int, int], torch.Tensor]


def values_of_params(param: nn.Parameter, slot: TensorSlot, start: int, stop: int) -> torch.Tensor:
    """The default :data:`ValueSource`: the parameter's own values (a view, no copy)."""
    if param.is_meta:
        raise ValueError(
            f"parameter {slot.name} is on the meta device: it has no values to pack into a chunk; "
            f"initialize it (or pass gemini.initialize(..., weights=...)) first"
        )
    return param.detach().reshape(-1)[start:stop]


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
        elif fill + n > chunk_size:
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
    capacity = min(max(chunk_size, used_numel), round_up(used_numel, CAPACITY_ALIGN_ELEMENTS))
    return round_up(capacity, world)


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

    @property
    def trainable(self) -> bool:
        return self.param_group >= 0

    def step_views(self, tier: Tier) -> tuple[torch.Tensor, ...]:
        """(master, grad, m, v) over this rank's range on ``tier``, cut once per move of any of them."""
        chunks = self.step_chunks
        key = (tier, *(c.version for c in chunks))
        if self._step_views is None or self._step_views[0] != key:
            n = self.os_numel
            offsets = (self.master_offset, 0, 0, 0)
            self._step_views = (key, tuple(c.payload(tier)[o : o + n] for c, o in zip(chunks, offsets)))
        return self._step_views[1]

    def slot_views(self, slot: TensorSlot, tier: Tier) -> tuple[torch.Tensor, ...]:
        """(master, grad, m, v) of one of :attr:`os_slots` on ``tier``, flat."""
        offsets = (self.master_offset, 0, 0, 0)
        return tuple(c.payload(tier)[o + slot.offset : o + slot.end] for c, o in zip(self.step_chunks, offsets))

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


class ChunkManager:
    """Registers parameters into chunk groups and owns every chunk.

    Parameters stay ``nn.Parameter`` objects of the user's module; their ``.data`` is always a
    view of their param chunk's current copy (the device copy when there is one), re-pointed
    on every move by :meth:`repoint`.
    """

    def __init__(
        self,
        storage: ChunkStorage,
        *,
        chunk_size: int,
        param_dtype: torch.dtype = torch.float32,
        rank: int = 0,
        world: int = 1,
        shard_params: bool = False,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size={chunk_size} must be a positive number of elements")
        if not 0 <= rank < world:
            raise ValueError(f"{rank=} must be in [0, {world=})")
        self.storage = storage
        self.chunk_size = chunk_size
        self.param_dtype = param_dtype
        # ZeRO: this rank's place among ``world`` data-parallel ranks (world 1: no sharding).
        self.rank = rank
        self.world = world
        self.shard_params = shard_params and world > 1
        self.groups: list[ChunkGroup] = []
        self._where: dict[nn.Parameter, tuple[ChunkGroup, TensorSlot]] = {}

    # ------------------------------------------------------------------------ registration
    def register(
        self,
        param_groups: Sequence[NamedParams],
        frozen: NamedParams,
        *,
        initial_tier: Callable[[ChunkKind], Tier],
        on_group: Callable[[ChunkGroup], None] = lambda group: None,
        source: ValueSource = values_of_params,
    ) -> None:
        """Pack each param group (and the frozen parameters) into chunk groups.

        Tensors keep the order given (the order the model uses them); groups never share a
        chunk because each has its own learning rate and weight decay. Frozen parameters get
        param chunks only: no gradients, no optimizer states. ``on_group`` sees each chunk
        group as soon as it is built (the NVMe tier spills it then, so that a model's states
        never need to fit in host memory all at once). ``source`` gives the values, one group
        at a time (see [Note: where a chunk's first values come from]); parameters on the meta
        device are given storage as their group is built (see :meth:`_materialize`).
        """
        if self.groups:
            raise RuntimeError("register() was already called")
        for members, pg_index, capacity in self.layout(param_groups, frozen):
            named = param_groups[pg_index] if pg_index >= 0 else frozen
            slots, offset = [], 0
            for i in members:
                name, p = named[i]
                slots.append(TensorSlot(len(slots), offset, p.numel(), p.shape, name))
                offset += p.numel()
            self._build_group(tuple(slots), tuple(named[i][1] for i in members), capacity, pg_index, initial_tier,
                              source)
            on_group(self.groups[-1])
        logger.info(
            "registered %d chunk groups of %d elements (%d trainable); host %d B, device %d B",
            len(self.groups),
            self.chunk_size,
            sum(g.trainable for g in self.groups),
            self.storage.ledger.bytes_on(Tier.HOST),
            self.storage.ledger.bytes_on(Tier.DEVICE),
        )

    def layout(self, param_groups: Sequence[NamedParams], frozen: NamedParams) -> list[tuple[list[int], int, int]]:
        """The chunk groups ``register`` will build, in order: (tensor indices, param group
        index or -1 for frozen, capacity in elements). Known before any memory is allocated.
        Capacities are multiples of the world size, so that every rank's shard is equal."""
        out = []
        for pg_index, named in [*enumerate(param_groups), (-1, frozen)]:
            numels = [p.numel() for _, p in named]
            for members in plan_layout(numels, self.chunk_size):
                used = sum(numels[i] for i in members)
                out.append((members, pg_index, chunk_capacity(used, self.chunk_size, world=self.world)))
        return out

    def _build_group(self, slots, params, capacity, pg_index, initial_tier, source: ValueSource) -> None:
        index = len(self.groups)
        trainable = pg_index >= 0
        low_precision = self.param_dtype != torch.float32

        def new(kind: ChunkKind, dtype: torch.dtype) -> Chunk:
            return Chunk(index=index, kind=kind, capacity=capacity, dtype=dtype, storage=self.storage, slots=slots)

        shard = Shard.of(capacity, rank=self.rank, world=self.world) if self.world > 1 else None

        def new_state(kind: ChunkKind, dtype: torch.dtype) -> Chunk:
            # Optimizer states: this rank's range under ZeRO, else the whole chunk.
            if shard is None:
                return new(kind, dtype)
            return Chunk(index=index, kind=kind, capacity=shard.numel, dtype=dtype, storage=self.storage,
                         slots=shard.cut(slots))

        group = ChunkGroup(index=index, param_group=pg_index, slots=slots, params=params,
                           param=new(ChunkKind.PARAM, self.param_dtype), shard=shard)
        # The chunks filled from the source: the parameters (or their shard) and the fp32 master.
        filled = [group.param]
        if self.shard_params:
            group.param_shard = new_state(ChunkKind.PARAM_SHARD, self.param_dtype)
            filled = [group.param_shard]
        if low_precision:
            group.master = new_state(ChunkKind.MASTER, torch.float32)
            filled.append(group.master)
        values = self._read_values(filled, params, source)
        self._fill(filled[0], values, initial_tier(ChunkKind.PARAM))
        if low_precision:
            # Frozen parameters keep an fp32 copy on the host too, so that the model's
            # state_dict returns their exact original values.
            self._fill(group.master, values, initial_tier(ChunkKind.MASTER) if trainable else Tier.HOST)
        del values  # this group's source values: the next group reads its own
        if trainable:
            group.grad = new(ChunkKind.GRAD, self.param_dtype)
            if shard is not None:
                group.grad_shard = new_state(ChunkKind.GRAD_SHARD, self.param_dtype)
            group.exp_avg = new_state(ChunkKind.EXP_AVG, torch.float32)
            group.exp_avg_sq = new_state(ChunkKind.EXP_AVG_SQ, torch.float32)
            os_tier = initial_tier(ChunkKind.EXP_AVG)
            group.exp_avg.allocate(os_tier)
            group.exp_avg_sq.allocate(os_tier)
            group.steps = torch.zeros(len(slots), dtype=torch.float32, device=self.storage.tier_device(os_tier))
            group.grad_ready = [False] * len(slots)
        for slot, p in zip(slots, params):
            assert p not in self._where, f"parameter {slot.name} registered twice"
            self._where[p] = (group, slot)
        self.groups.append(group)
        self._materialize(params, slots)
        group.param.on_move = self.repoint
        self.repoint(group.param)

    @staticmethod
    def _read_values(chunks: Sequence[Chunk], params: Sequence[nn.Parameter],
                     source: ValueSource) -> dict[int, tuple[int, torch.Tensor]]:
        """Per tensor of the group: (first element, flat values) covering every piece of it that
        ``chunks`` hold, read from ``source`` once (a shard chunk needs only this rank's piece)."""
        ranges: dict[int, tuple[int, int, TensorSlot]] = {}
        for chunk in chunks:
            for s in chunk.slots:  # whole tensors, or (a shard chunk) pieces of them
                lo, hi, _ = ranges.get(s.index, (s.tensor_offset, s.tensor_offset + s.numel, s))
                ranges[s.index] = (min(lo, s.tensor_offset), max(hi, s.tensor_offset + s.numel), s)
        values = {}
        with torch.no_grad():
            for index, (lo, hi, s) in ranges.items():
                value = source(params[index], s, lo, hi)
                if value.numel() != hi - lo:
                    raise ValueError(f"the value source gave {value.numel()} elements for {s.name}[{lo}:{hi}], "
                                     f"expected {hi - lo}")
                values[index] = (lo, value.reshape(-1))
        return values

    @staticmethod
    def _fill(chunk: Chunk, values: dict[int, tuple[int, torch.Tensor]], tier: Tier) -> None:
        # Padding is zeroed so that whole-chunk reductions (norms, Adam) see zeros there.
        chunk.allocate(tier, zero=True)
        ChunkManager._write_values(chunk, values)

    @staticmethod
    def _write_values(chunk: Chunk, values: dict[int, tuple[int, torch.Tensor]]) -> None:
        """Write ``_read_values``' output into every copy of ``chunk``, cast to its dtype."""
        with torch.no_grad():
            for slot in chunk.slots:
                lo, value = values[slot.index]
                start = slot.tensor_offset - lo
                chunk.write_range(slot.offset, value[start : start + slot.numel])

    def refill(self, group: ChunkGroup, source: ValueSource) -> None:
        """Overwrite ``group``'s parameter values as ``register`` first filled them — its param
        chunk (or ZeRO-3 shard) and fp32 master, each tensor read from ``source`` once — on
        every copy they have now. Adam's states are untouched."""
        chunks = [c for c in (group.param, group.param_shard, group.master)
                  if c is not None and c.state is not ChunkState.RELEASED]
        values = self._read_values(chunks, group.params, source)
        for chunk in chunks:
            self._write_values(chunk, values)

    @staticmethod
    def _materialize(params: Sequence[nn.Parameter], slots: Sequence[TensorSlot]) -> None:
        """Give parameters on the meta device real (empty) storage, so that :meth:`repoint` can
        point them at the chunk: ``.data`` cannot move a tensor off the meta device, so the
        tensor is swapped in place (``torch.utils.swap_tensors`` keeps the Python object, and
        with it ties between modules and every reference the optimizer or the user holds)."""
        for slot, p in zip(slots, params):
            if p.is_meta:
                stand_in = nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, stand_in)
                assert not p.is_meta, f"{slot.name} is still on the meta device"

    # ------------------------------------------------------------------------------ views
    def repoint(self, chunk: Chunk) -> None:
        """Point each parameter's ``.data`` at its view in the chunk's primary copy."""
        params = self.groups[chunk.index].params
        if chunk.state is ChunkState.RELEASED:
            for p in params:
                p.data = torch.empty(0, dtype=chunk.dtype)
            return
        for slot, p in zip(chunk.slots, params):
            p.data = chunk.view(slot)

    # ---------------------------------------------------------------------------- lookups
    def locate(self, param: nn.Parameter) -> tuple[ChunkGroup, TensorSlot]:
        try:
            return self._where[param]
        except KeyError:
            raise KeyError(f"parameter of shape {tuple(param.shape)} is not managed by this ChunkManager") from None

    def groups_of(self, params: Iterable[nn.Parameter]) -> list[ChunkGroup]:
        """The chunk groups holding ``params``, each once, in first-use order."""
        seen: dict[int, ChunkGroup] = {}
        for p in params:
            g = self._where.get(p)
            if g is not None:
                seen.setdefault(g[0].index, g[0])
        return list(seen.values())

    @property
    def trainable_groups(self) -> list[ChunkGroup]:
        return [g for g in self.groups if g.trainable]

    def chunks(self) -> Iterable[Chunk]:
        for g in self.groups:
            yield from g.chunks

    def bytes_by_kind(self, tier: Tier) -> dict[ChunkKind, int]:
        """Bytes of chunk payloads on ``tier`` now, every kind (the storage's ledger's count; a
        chunk in a file counts on NVMe)."""
        return {k: self.storage.ledger.kind_bytes(tier, k) for k in ChunkKind}

    def waste_elements(self) -> int:
        """Elements allocated per chunk flavour but holding no tensor."""
        return sum(g.param.capacity - g.param.used_numel for g in self.groups)
