"""`ChunkManager`: packs a model's parameters into chunk groups and keeps their views right."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from chunks.chunk import Chunk, ChunkState
from chunks.edits import ParamEdits
from chunks.group import ChunkGroup
from chunks.kind import ChunkKind
from chunks.layout import CAPACITY_ALIGN_ELEMENTS, TensorSlot, chunk_capacity, plan_layout, slot_offsets
from chunks.shard import Shard
from chunks.storage import ChunkStorage, Tier

logger = logging.getLogger(__name__)

# ChunkGroup and the layout helpers live in chunks/group.py and chunks/layout.py; they stay
# importable from here, where they were first defined.
__all__ = ["CAPACITY_ALIGN_ELEMENTS", "ChunkGroup", "ChunkManager", "ValueSource", "chunk_capacity", "plan_layout",
           "values_of_params"]

NamedParams = Sequence[tuple[str, nn.Parameter]]

# [Note: where a chunk's first values come from]
# ``register`` fills each chunk group from a *value source*: called as ``source(param, slot,
# start, stop)`` it returns elements ``[start, stop)`` of the flattened tensor of ``slot`` (any
# dtype: the chunk casts). The manager asks once per tensor per group, for the range that the
# group's chunks need (the whole tensor, or under ZeRO with parameter sharding only this
# rank's piece), fills the param and master chunks from that one value, and drops it before the
# next group is built. So a source that reads from disk (gemini/pretrained/) or initializes
# module by module holds one group's values at a time, and a group is complete — and can be
# spilled to NVMe by ``on_group`` — before the next one is read. The default source is the
# parameters' own data. With ``sync`` (ZeRO: rank 0's values broadcast, see [Note: ranks agree
# at initialize] in gemini/parallel/agreement.py) every rank reads whole tensors, packs the
# group's values into one fp32 buffer (what the chunks keep at most: fp32 parameters or
# masters) and ``sync`` makes it equal on every rank before any chunk is filled from it.
ValueSource = Callable[[nn.Parameter, "TensorSlot", int, int], torch.Tensor]


def values_of_params(param: nn.Parameter, slot: TensorSlot, start: int, stop: int) -> torch.Tensor:
    """The default :data:`ValueSource`: the parameter's own values (a view, no copy)."""
    if param.is_meta:
        raise ValueError(
            f"parameter {slot.name} is on the meta device: it has no values to pack into a chunk; "
            f"initialize it (or pass gemini.initialize(..., weights=...)) first"
        )
    return param.detach().reshape(-1)[start:stop]


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
        self._trainable: tuple[int, tuple[ChunkGroup, ...]] = (0, ())  # (len(groups) when cut, trainable ones)
        self._where: dict[nn.Parameter, tuple[ChunkGroup, TensorSlot]] = {}
        # Per group: (parameter, its slot's offset in bytes), for adopt_assigned's one pass.
        self._offsets: list[tuple[tuple[nn.Parameter, int], ...]] = []

    # ------------------------------------------------------------------------ registration
    def register(
        self,
        param_groups: Sequence[NamedParams],
        frozen: NamedParams,
        *,
        initial_tier: Callable[[ChunkKind], Tier],
        on_group: Callable[[ChunkGroup], None] = lambda group: None,
        source: ValueSource = values_of_params,
        sync: Callable[[torch.Tensor], object] | None = None,
    ) -> None:
        """Pack each param group (and the frozen parameters) into chunk groups.

        Tensors keep the order given (the order the model uses them); groups never share a
        chunk because each has its own learning rate and weight decay. Frozen parameters get
        param chunks only: no gradients, no optimizer states. ``on_group`` sees each chunk
        group as soon as it is built (the NVMe tier spills it then, so that a model's states
        never need to fit in host memory all at once). ``source`` gives the values, one group
        at a time (see [Note: where a chunk's first values come from]); parameters on the meta
        device are given storage as their group is built (see :meth:`_materialize`). ``sync``
        (optional) makes each group's values, one flat fp32 tensor, equal across ranks.
        """
        if self.groups:
            raise RuntimeError("register() was already called")
        for members, pg_index, capacity in self.layout(param_groups, frozen):
            named = param_groups[pg_index] if pg_index >= 0 else frozen
            offsets = slot_offsets([named[i][1].numel() for i in members])
            slots = [TensorSlot(j, offsets[j], named[i][1].numel(), named[i][1].shape, named[i][0])
                     for j, i in enumerate(members)]
            self._build_group(tuple(slots), tuple(named[i][1] for i in members), capacity, pg_index, initial_tier,
                              source, sync)
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
                used = slot_offsets([numels[i] for i in members])[-1] + numels[members[-1]]
                out.append((members, pg_index, chunk_capacity(used, self.chunk_size, world=self.world)))
        return out

    def _build_group(self, slots, params, capacity, pg_index, initial_tier, source: ValueSource, sync) -> None:
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
        values = self._read_values(filled, params, source) if sync is None else self._synced_values(group, source, sync)
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
        self._offsets.append(tuple((p, s.offset * self.param_dtype.itemsize) for s, p in zip(slots, params)))
        self._materialize(params, slots)
        group.param.on_move = self.repoint
        self.repoint(group.param)
        group.param.edits = ParamEdits(params)  # see [Note: writes through the parameters] in chunks/edits.py

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

    @classmethod
    def _synced_values(cls, group: ChunkGroup, source: ValueSource, sync) -> dict[int, tuple[int, torch.Tensor]]:
        """``_read_values`` of every whole tensor of ``group``, made equal across ranks by ``sync``
        (see [Note: where a chunk's first values come from])."""
        slots = group.param.slots
        flat = torch.empty(slots[-1].end if slots else 0, dtype=torch.float32)
        with torch.no_grad():
            for index, (_, value) in cls._read_values([group.param], group.params, source).items():
                flat[slots[index].offset : slots[index].end] = value
        sync(flat)
        return {s.index: (0, flat[s.offset : s.end]) for s in slots}

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

    # [Note: parameters whose .data was assigned]
    # ``p.data = t`` (re-initialising a weight, ``torch.nn.utils.vector_to_parameters``,
    # ``prune.remove``, ``module.double()`` on the module given to initialize) points ``p`` away
    # from its slot: the forward would read ``t`` while the step updates the chunk, or the next
    # move would re-point ``p`` and drop ``t`` unseen. As FSDP's ``use_orig_params`` does
    # (``_writeback_orig_params``), the engine looks, when the root module's forward begins, when
    # the step begins and in ``state_dict``, whether each parameter still views its slot in one
    # of the chunk's copies, by address (one pass over the parameters, nothing allocated). A
    # tensor of the slot's shape and dtype is copied into the chunk (every copy, and this rank's
    # shard under ZeRO-3) and ``p`` re-pointed; another shape or dtype is a ValueError: layout
    # and precision are fixed at initialize.
    def adopt_assigned(self) -> list[ChunkGroup]:
        """Copy the tensors assigned to ``p.data`` into their chunks and re-point; the groups that
        took one (see [Note: parameters whose .data was assigned])."""
        adopted = []
        for g, offsets in zip(self.groups, self._offsets):
            bases = g.param.addresses
            for p, offset in offsets:  # a plain loop: all() over a generator costs twice as much
                if (p.data_ptr() - offset not in bases) if bases else p.numel():  # RELEASED: empty stand-ins
                    adopted.append(g)
                    break
        for g in adopted:
            bases = g.param.addresses
            for (p, offset), slot in zip(self._offsets[g.index], g.slots):
                if (p.data_ptr() - offset not in bases) if bases else p.numel():
                    self._adopt(g, slot, p.data)
            self.repoint(g.param)
        if self.shard_params:
            self._refuse_lost_writes(adopted)
        return adopted

    # [Note: writes between steps under ZeRO-3]
    # Under ZeRO-3 a parameter holds its values only around the module calls that use it (its
    # chunk gathered); between them, and so between steps, it is an empty stand-in, and each
    # rank keeps a shard of it. A write in place there (``with torch.no_grad(): p.mul_(0.5)``,
    # ``nn.init.*``) reached the stand-in: it was lost, silently, and training went on from the
    # unwritten values. Carrying it would need the whole parameter on every rank between steps
    # (what ZeRO-3 exists to avoid), so it is refused, loudly: the write still bumped the
    # parameter's version counter ([Note: writes through the parameters] in chunks/edits.py),
    # which is read here, where the next forward, step or state_dict begins, before any gather.
    # What works instead: assigning ``p.data`` (copied into each rank's shard, see [Note:
    # parameters whose .data was assigned]) and writes inside forward (the chunk is gathered;
    # each rank keeps its range of the write). Cost: one sum of version counters per gathered-
    # on-use group and call, under ZeRO-3 only. Not seen: an in-place write to one parameter of
    # a group another of whose parameters was assigned at the same time (the sum is per group).
    def _refuse_lost_writes(self, adopted: list[ChunkGroup]) -> None:
        for g in self.groups:
            edits = g.param.edits
            if g.param.state is not ChunkState.RELEASED or edits is None or not edits.new() or g in adopted:
                continue
            raise RuntimeError(
                f"parameters {[s.name for s in g.slots]} (one or more) were written in place between their uses "
                f"(p.mul_(), p.copy_(), nn.init.*), but under ZeRO-3 (GeminiConfig(shard_params=True)) a parameter "
                f"holds no values between the module calls that use it (each rank keeps a shard): the write reached "
                f"an empty tensor and is lost; nothing else changed. Assign instead (p.data = new_value, a tensor of "
                f"the parameter's shape, e.g. from model.state_dict(): each rank copies its range into its shard), "
                f"write inside the module's forward, or use shard_params=False")

    @staticmethod
    @torch.no_grad()
    def _adopt(g: ChunkGroup, slot: TensorSlot, value: torch.Tensor) -> None:
        chunk = g.param
        if value.shape != slot.shape or value.dtype != chunk.dtype or value.is_meta:
            raise ValueError(
                f"parameter {slot.name}: a tensor of shape {tuple(value.shape)}, dtype {value.dtype}"
                f"{' on the meta device' if value.is_meta else ''} was assigned to its .data, but gemini holds it in "
                f"a chunk as shape {tuple(slot.shape)}, dtype {chunk.dtype}, fixed at gemini.initialize (the "
                f"parameter still points at the assigned tensor). Assign a tensor of that shape and dtype, or copy "
                f"in place (with torch.no_grad(): p.copy_(t)); casting the module given to gemini.initialize "
                f"(.double(), .half(), .to(dtype)) is not supported: GeminiConfig(precision=...) sets the dtype")
        if chunk.state is not ChunkState.RELEASED:
            chunk.write(slot, value)
        if g.param_shard is not None:  # ZeRO-3: this rank's piece
            g.write_value(g.param_shard, slot, value)
        chunk.edits.edited = True  # low precision: the step brings it into the master

    # ---------------------------------------------------------------------------- lookups
    def manages(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is one of the parameters laid out in these chunks."""
        return param in self._where

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
    def trainable_groups(self) -> tuple[ChunkGroup, ...]:
        """Groups only ever join (at registration), and a group's parameter group is fixed then."""
        if self._trainable[0] != len(self.groups):
            self._trainable = (len(self.groups), tuple(g for g in self.groups if g.trainable))
        return self._trainable[1]

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
