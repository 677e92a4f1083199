"""ZeRO across data-parallel ranks: gradient reduce-scatter, parameter all-gather, agreement.

Each rank owns one range of every chunk ([Note: ZeRO shards of a chunk] in chunks/shard.py). These pieces move data
between ranks; where chunks live is the placement's choice: the engine (gemini/engine/residency.py) drives them as it
moves chunks, and they know of the policy only the callables they are given.

[Note: the order of collectives]
Collectives are matched across ranks by issue order, so every rank must issue the same ones in the same order,
whatever its data, timing or memory.
- Gradients: each backward pass reduce-scatters every trainable chunk group in one fixed order (descending group
  index, about the order backward finishes them). A group is launched once its backward is done and every group
  before it in that order has been launched; a group with no gradient on this rank (an unused parameter, a branch not
  taken) is launched with zeros at the end of backward, so no rank waits for a reduction another never starts. At
  most ``max_in_flight`` reductions are outstanding (finished oldest first), so device memory for full-size gradient
  buckets stays bounded and the same on every rank.
- Which tensors had a gradient since ``zero_grad`` is agreed at the step (an all-reduce of per-tensor flags), so every
  rank updates, counts steps for, and gathers the same tensors.
- A rank that ran no backward since the last step (it skipped its batch) reduces zeros for every group at its step
  (or ``model.clip_grad_norm_``), pairing with the others' backward: it contributes a zero gradient to the mean, as an
  unused parameter does. See [Note: ranks out of step] for what cannot pair.
- Parameters (ZeRO-3) are gathered in the order modules ask for them (the same on every rank) and prefetched one group
  ahead in the order recorded in the first iteration. Gathered parameters are never evicted by memory pressure, only
  released after use, so whether a gather happens never depends on a rank's own memory.

[Note: ranks out of step]
Collectives pair by order, not by iteration, so a rank that drops an iteration the others run is one behind from then
on: its batches are reduced with the others' next ones, and the run hangs (or gloo reports a mismatch) only when the
first rank ends. The step's agreement all-reduce, which runs anyway, also compares each rank's count of training
forward passes that raised (under ZeRO-1/2 forward has no collective, so nothing else would notice a rank recovering
from its own error). Counts that differ raise the same RuntimeError on every rank at that step and every later one.
Not seen: an iteration skipped before calling the model, a backward that raises half-way or a different number of
backward passes per step (their reductions already paired wrongly), and under ZeRO-3 the other ranks' forward gathers
after an error in forward or while a rank skips its forward (they hang). Under ZeRO every rank must skip the same
iterations: agree on an error (e.g. ``all_reduce`` a flag) before skipping.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
import torch
import torch.distributed as dist

from chunks import ChunkGroup, ChunkManager, ChunkState, Tier
from gemini.errors import DeviceBudgetError
from gemini.parallel.collectives import Collectives, Pending
from offload.profiling import trace_range

logger = logging.getLogger(__name__)

__all__ = ["GradReducer", "ParamGatherer", "agree_grad_ready", "agree_on_budget", "agree_on_trace", "gather_params",
           "gather_state", "resolve_group", "sharded_grad_norm"]


def resolve_group(process_group) -> Collectives | None:
    """``GeminiConfig.process_group`` as collectives: None means WORLD when torch.distributed is initialized with more
    than one rank, else no sharding."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        process_group = dist.group.WORLD
    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):  # the type first: "WORLD"
        raise TypeError(f"GeminiConfig.process_group must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(process_group).__name__} {process_group!r}")
    if not dist.is_initialized():
        raise ValueError(
            f"GeminiConfig.process_group={process_group!r} is set but torch.distributed is not initialized: "
            f"call torch.distributed.init_process_group first (torchrun sets the environment it reads)"
        )
    comm = Collectives(process_group)
    return comm if comm.world > 1 else None


class GradReducer:
    """Reduce-scatters each group's gradient bucket into this rank's gradient shard, averaged over ranks, during
    backward; see [Note: the order of collectives]."""

    def __init__(self, comm: Collectives, manager: ChunkManager, *, optimizer_tier: Callable[[ChunkGroup], Tier],
                 quiet: Callable[[], AbstractContextManager], max_in_flight: int = 2) -> None:
        """``optimizer_tier(group)``: where the placement updates ``group``, so where its shard goes; ``quiet()``: the
        context in which host-side temporaries are not device memory."""
        self.comm = comm
        self.manager = manager
        self._optimizer_tier = optimizer_tier
        self._quiet = quiet
        self.max_in_flight = max_in_flight
        self.order = [g.index for g in reversed(manager.trainable_groups)]
        self._ready: set[int] = set()
        self._next = 0  # position in ``order`` of the next group to launch
        self._in_flight: deque[tuple[ChunkGroup, torch.Tensor, Pending]] = deque()
        self.rounds = 0  # backward passes reduced (each every group once)
        self.rounds_at_step = 0  # ``rounds`` at the last step's agreement

    def group_done(self, group: ChunkGroup) -> None:
        """``group``'s backward is over on this rank: reduce it when its turn comes."""
        self._ready.add(group.index)
        while self._next < len(self.order) and self.order[self._next] in self._ready:
            self._launch(self.manager.groups[self.order[self._next]])
            self._next += 1

    def end_backward(self) -> None:
        """The backward pass is over: reduce the rest (zeros where no gradient came) and wait."""
        with trace_range("gemini::reduce_scatter_rest"):
            while self._next < len(self.order):
                self._launch(self.manager.groups[self.order[self._next]])
                self._next += 1
            while self._in_flight:
                self._finish(*self._in_flight.popleft())
        self._ready.clear()
        self._next = 0
        self.rounds += 1

    def reduce_if_idle(self) -> None:
        """Before the step's agreement: no backward since the last step on this rank, so zeros for every group (see
        [Note: the order of collectives])."""
        if self.rounds == self.rounds_at_step:
            self.end_backward()

    def _launch(self, g: ChunkGroup) -> None:
        with trace_range("gemini::reduce_scatter"):
            if g.grad.state is ChunkState.RELEASED:
                # No gradient here this pass: contribute zeros (the padding is zero too).
                bucket = torch.zeros(g.grad.capacity, dtype=g.grad.dtype, device=self.manager.storage.device)
            else:
                bucket = g.grad.payload()
            out = torch.empty(g.shard.numel, dtype=bucket.dtype, device=bucket.device)
            self._in_flight.append((g, out, self.comm.reduce_scatter(out, bucket)))
            self.manager.storage.ledger.transfers.grad_reduce_bytes += bucket.numel() * bucket.element_size()
            while len(self._in_flight) > self.max_in_flight:
                self._finish(*self._in_flight.popleft())

    def _finish(self, g: ChunkGroup, out: torch.Tensor, pending: Pending) -> None:
        pending.wait()
        out.div_(self.comm.world)  # the mean over ranks, as DDP and one process on the global batch
        shard, tier = g.grad_shard, self._optimizer_tier(g)
        storage = self.manager.storage
        with self._quiet() if tier is Tier.HOST else contextlib.nullcontext():
            if not g.grad_shard_filled:
                if shard.state is ChunkState.RELEASED:
                    shard.allocate(tier, zero=False)
                else:
                    shard.move_to(tier)
                shard.host_copy_pending(storage.copy_(shard.payload(tier), out, src=Tier.DEVICE, dst=tier))
                g.grad_shard_filled = True
            else:
                shard.move_to(tier)
                dst = shard.payload(tier)
                dst.add_(out if out.device == dst.device else out.to(dst.device))
        if g.grad.state is not ChunkState.RELEASED:
            g.grad.release()  # ZeRO-2: the full-size bucket is gone until the next backward


class ParamGatherer:
    """ZeRO-3: gathers each group's parameters from the ranks' shards into its (full) param chunk on the device for
    compute, prefetching one group ahead in the recorded order."""

    def __init__(self, comm: Collectives, manager: ChunkManager) -> None:
        self.comm = comm
        self.manager = manager
        self._pending: dict[int, Pending] = {}
        # Gathered ahead of use, not yet used; the placement reads this very set (never rebind it).
        self.prefetched: set[int] = set()
        self.order: list[int] | None = None  # gather order of one iteration, once recorded
        self._recording: list[int] | None = None
        self._pos = 0

    def begin_iteration(self) -> None:
        """The root module's forward begins."""
        self._pos = 0
        if self.order is None and self._recording is None and torch.is_grad_enabled():
            self._recording = []

    def end_iteration(self) -> None:
        """The step: the first iteration's order is the one to prefetch by from now on."""
        if self._recording is not None:
            self.order, self._recording = self._recording, None
            logger.info("ZeRO-3: recorded a gather order of %d chunk groups", len(self.order))

    def gathered(self, g: ChunkGroup) -> bool:
        return g.param.state is not ChunkState.RELEASED

    def gather(self, groups: Sequence[ChunkGroup]) -> None:
        """Every group of ``groups`` gathered (waiting for prefetched ones), then prefetch."""
        # Unseen by dispatch modes, as chunk moves are: selective checkpointing numbers the forward's collectives and
        # views and looks them up in the recompute.
        with trace_range("gemini::all_gather_params"), self.manager.storage.unseen():
            for g in groups:
                if not self.gathered(g):
                    self._start(g)
                if self._recording is not None:
                    self._recording.append(g.index)
            for g in groups:
                self._wait(g)
                self.prefetched.discard(g.index)
            self._prefetch(groups[-1].index if groups else None)

    def _prefetch(self, last: int | None) -> None:
        order = self.order
        if order is None or last is None:
            return
        try:
            self._pos = order.index(last, self._pos) + 1
        except ValueError:
            return  # off the recorded order (the iteration diverged): no prefetch
        if self._pos < len(order):
            g = self.manager.groups[order[self._pos]]
            if not self.gathered(g):
                self._start(g)
                self.prefetched.add(g.index)

    def _start(self, g: ChunkGroup) -> None:
        g.param.allocate(Tier.DEVICE, zero=False)
        shard = g.param_shard
        self._pending[g.index] = self.comm.all_gather(g.param.payload(Tier.DEVICE), shard.payload())
        # [Note: what a gather counts] The report's param_gathers and param_gather_bytes count every gathered chunk
        # (prefetches too), whole; h2d_bytes counts this rank's range where its shard is in host memory, as it crosses
        # to the device (the other ranks' ranges arrive over the network). Other staging copies a backend needs (gloo
        # with CUDA tensors: [Note: which tensors a backend takes]) are not counted.
        ledger = self.manager.storage.ledger
        ledger.count_gather(g.param.nbytes)
        if not shard.is_on(Tier.DEVICE):
            ledger.count_copy(Tier.HOST, Tier.DEVICE, shard.nbytes, 0.0)

    def _wait(self, g: ChunkGroup) -> None:
        pending = self._pending.pop(g.index, None)
        if pending is not None:
            pending.wait()

    def release(self, g: ChunkGroup) -> None:
        """Free ``g``'s gathered parameters (its shard stays)."""
        self._wait(g)
        self.prefetched.discard(g.index)
        if self.gathered(g):
            with self.manager.storage.unseen():
                self._keep_edits(g)
                g.param.release()

    def _keep_edits(self, g: ChunkGroup) -> None:
        """Torch code wrote into the gathered parameters (``nn.Embedding(max_norm=...)`` in forward): this rank's
        range goes into its shard, as every rank's does ([Note: writes through the parameters] in chunks/edits.py)."""
        if not g.param.edits.new():
            return
        gathered = g.param.payload(Tier.DEVICE)[g.shard.start : g.shard.end]
        storage = self.manager.storage
        for tier in g.param_shard.tiers:
            out = g.param_shard.payload(tier)[: g.shard.numel]
            if tier is Tier.DEVICE:
                out.copy_(gathered)
            else:
                g.param_shard.host_copy_pending(storage.copy_(out, gathered, src=Tier.DEVICE, dst=tier))

    def release_all(self, busy: set[int]) -> None:
        """End of a backward pass: free every gathered group not in use (prefetched ones too: the step is next, and
        it makes them stale)."""
        for g in self.manager.groups:
            if g.index not in busy and self.gathered(g):
                self.release(g)


def agree_grad_ready(comm: Collectives, groups: Sequence[ChunkGroup], reducer: GradReducer, *, forwards_raised: int,
                     step: bool) -> None:
    """Make each tensor's "had a gradient since zero_grad" flag the OR over ranks, after this rank's zeros if it ran
    no backward since the last step; check that no rank's training forward raised where another's did not ([Note:
    ranks out of step]). ``step``: the step's agreement (``model.clip_grad_norm_`` agrees too, before it)."""
    reducer.reduce_if_idle()
    if step:
        reducer.rounds_at_step = reducer.rounds
    # [max, -min] of the count over ranks, then the flags: one all-reduce (MAX).
    flags = torch.tensor([forwards_raised, -forwards_raised, *(f for g in groups for f in g.grad_ready)],
                         dtype=torch.int32)
    comm.all_reduce(flags, dist.ReduceOp.MAX)
    most, fewest, *ready = flags.tolist()
    if most != -fewest:
        raise RuntimeError(
            f"the ranks of GeminiConfig.process_group are out of step: on one rank {most} training forward "
            f"pass(es) raised since initialize, on another {-fewest}. A rank that goes on after its own error "
            f"runs one iteration fewer, so its gradients are reduced with the other ranks' next batch and the run "
            f"hangs when they finish. Under ZeRO every rank must skip the same iterations: agree on an error "
            f"across ranks (e.g. torch.distributed.all_reduce of a flag) before skipping, or let it end the run "
            f"(see [Note: ranks out of step] in gemini/parallel/zero.py)")
    it = iter(ready)
    for g in groups:
        g.grad_ready = [bool(next(it)) for _ in g.slots]


def sharded_grad_norm(comm: Collectives, groups: Sequence[ChunkGroup], tiers: dict[int, Tier],
                      param_order: dict[int, int]) -> torch.Tensor:
    """The L2 norm (fp32, CPU) over every rank's gradient shards: each tensor's norm from its pieces' squared sums
    over ranks, then the norm of those (torch's clip_grad_norm_ order)."""
    sq = torch.zeros(len(param_order), dtype=torch.float64)
    index, views = [], []
    for g in groups:
        grad = g.step_grad
        for s in g.os_slots:
            if g.grad_ready[s.index]:
                index.append(param_order[id(g.params[s.index])])
                views.append(grad.payload(tiers[g.index])[s.offset : s.end])
    if views:
        norms = torch._foreach_norm(views, 2.0, dtype=torch.float32)
        sq.index_add_(0, torch.tensor(index), torch.stack([n.cpu() for n in norms]).double() ** 2)
    comm.all_reduce(sq)
    return torch.linalg.vector_norm(sq.sqrt().float())


def gather_params(comm: Collectives, groups: Sequence[ChunkGroup], storage, *, max_in_flight: int = 2) -> None:
    """ZeRO-1/2 after the step: every rank's updated range of each param chunk to every rank.

    Each rank has written its own range (``PlacementPolicy.after_step``) into the param chunk's primary copy (the
    device copy if any); the gather fills the rest in place, and a second copy, if any, is refreshed from it.
    """
    in_flight: deque[tuple[ChunkGroup, Tier, Pending]] = deque()

    def finish(g: ChunkGroup, primary: Tier, pending: Pending) -> None:
        pending.wait()
        for tier in g.param.tiers:
            if tier is not primary:
                g.param.host_copy_pending(storage.copy_(g.param.payload(tier), g.param.payload(primary), src=primary,
                                                     dst=tier))

    with trace_range("gemini::all_gather_params"):
        for g in groups:
            primary = g.param.primary_tier
            full = g.param.payload(primary)
            in_flight.append((g, primary, comm.all_gather(full, full[g.shard.start : g.shard.end])))
            storage.ledger.count_gather(g.param.nbytes)  # in place on its tier: no h2d or d2h
            while len(in_flight) > max_in_flight:
                finish(*in_flight.popleft())
        while in_flight:
            finish(*in_flight.popleft())


def gather_state(comm: Collectives, g: ChunkGroup, chunk, offset: int = 0) -> torch.Tensor:
    """``chunk``'s ranges from every rank as one CPU tensor of the group's capacity (checkpoints). ``offset``: where
    this rank's range starts inside ``chunk`` (see ``ChunkGroup.master_offset``)."""
    mine = chunk.payload()[offset : offset + g.shard.numel]
    full = torch.empty(g.shard.numel * comm.world, dtype=chunk.dtype, device=mine.device)
    comm.all_gather(full, mine).wait()
    return full.cpu()


# [Note: ranks agree on the budget]
# Each rank checks its own measured peak against its own budget, at the warm-up's end and at every step. Peaks differ
# slightly between ranks (gloo frees its buffers on its own thread), so a budget near the need could fail on one rank
# and pass on another: the failing rank would leave the step while the others go on into collectives: all hang.
# So the ranks all-reduce how many bytes each is missing before any raises: a short rank raises its own error, every
# other rank one saying another rank was short, and nothing is updated anywhere. One 8-byte all-reduce per check,
# every step under ZeRO (budget or not: ranks may differ there), after a rank with no backward since the last step has
# reduced its zeros (the others' backward reduced theirs before: see [Note: the order of collectives]).
def agree_on_budget(zero: Collectives | None, missing_bytes: int, *, what: str,
                    reducer: GradReducer | None = None) -> None:
    """Raise DeviceBudgetError on this rank when another rank of ``zero`` is short of its budget for ``what`` (this
    rank's own shortfall is its caller's to raise, after this returns)."""
    if zero is None:
        return
    if reducer is not None:
        reducer.reduce_if_idle()
    worst = zero.max_over_ranks(missing_bytes)
    if worst > 0 and missing_bytes == 0:
        raise DeviceBudgetError(
            f"another rank of the ZeRO group lacked {worst} bytes of its device budget for {what}; every rank "
            f"refuses the step together (see [Note: ranks agree on the budget] in gemini/parallel/zero.py). "
            f"Nothing was updated: raise that rank's GeminiConfig.device_memory.", missing_bytes=worst)


# [Note: ranks trace together]
# Auto traces an iteration again when its inputs are larger than the traced ones ([Note: a trace covers smaller
# inputs] in tracer/signature.py), and ranks see different inputs (with dynamic padding one rank's batch may outgrow
# its trace while another's does not). A rank that traces agrees on the warm-up's budget at the step, a collective
# the others would not call (gloo aborts on the mismatch). So before each training forward the ranks all-reduce
# whether any needs a trace, and all trace together, each on its own inputs. One 8-byte all-reduce per training
# forward under ZeRO with placement auto.
def agree_on_trace(zero: Collectives | None, mine: bool) -> bool:
    """Whether any rank of ``zero`` needs to trace this iteration (``mine``: this rank does)."""
    if zero is None:
        return mine
    return bool(zero.max_over_ranks(int(mine)))
