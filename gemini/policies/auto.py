"""`AutoPlacement`: the placement planned from the warm-up iteration, under a device budget."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from chunks import ChunkGroup, ChunkKind, ChunkManager, ChunkState, Tier, fits, missing_bytes
from gemini.config import GeminiConfig
from gemini.errors import DeviceBudgetError
from gemini.policies.plan import MemoryPlan
from gemini.policies.base import PlacementPolicy
from gemini.policies.fixed import CpuPlacement
from gemini.policies.footprint import margin_choice, margin_room_bytes
from tracer import Boundary, EvictionError, EvictionRule, choose_victims

logger = logging.getLogger(__name__)

__all__ = ["AccessTrace", "AutoPlacement"]


class AccessTrace(Protocol):
    """What the warm-up learns from the policy (``tracer.RuntimeTracer``): the chunk groups each period uses, and the
    decision points inside a period."""

    def record_access(self, group_index: int) -> None: ...
    def mark(self) -> None: ...


class AutoPlacement(PlacementPolicy):
    """Traced, budgeted placement.

    [Note: auto placement]
    - Warm-up (no plan yet): like "cpu" (chunks start on the host, are fetched for compute and dropped after use),
      while the tracer measures each period's non-model peak and records which chunk groups each period uses.
    - Steady state: at each period boundary the device must hold the period's non-model peak on top of the resident
      chunks, under ``budget - reserve``; when it cannot, the resident groups whose next use is furthest away are
      evicted (Belady, from the recorded order). Fetched chunks stay until pressure evicts them, and the next
      period's chunks are prefetched when they fit next to both periods' non-model peaks.
    - Margin: ``budget - reserve - the warm-up's planned peak`` (``MemoryPlan.margin_bytes``); ``gpu_margin_mem_ratio``
      of it holds whole chunk groups (params, grads, master, m, v) on the device for good, updated by the device Adam.
    """

    name = "auto"
    plans_from_measurement = True
    has_margin = True
    own_fields = ("gpu_margin_mem_ratio",)
    evicts = True
    budget_advice = CpuPlacement.budget_advice  # its warm-up moves chunks as "cpu" does

    def __init__(self, manager: ChunkManager, *, budget_bytes: int, margin_ratio: float, fixed_bytes: int) -> None:
        super().__init__(manager)
        self.budget_bytes = budget_bytes
        self.margin_ratio = margin_ratio
        self.fixed_bytes = fixed_bytes
        self.plan: MemoryPlan | None = None
        self.os_on_device: set[int] = set()
        self.period = -1
        self._diverged = False
        self._skipped = False  # this iteration skipped traced periods: [Note: an iteration that skips traced periods]
        self._iteration_open = False  # a forward with grad ran and its backward has not
        self._trace: AccessTrace | None = None  # the warm-up's tracer, between begin_trace and end_trace
        self._segment = 0  # marks passed in the current period
        self._used_in_period: set[int] = set()  # groups the current period has used so far
        # Belady over the plan's order; LRU only to measure what that order saves (bench_budget).
        self.eviction_rule = EvictionRule.BELADY
        self.track_periods = True  # decided by adopt()
        self._settled = False  # the plan keeps every chunk on the device for good (see adopt)
        self._resident: set[int] = set()  # resident_params(), decided by adopt
        self.activation_bytes = 0  # saved activations the plan keeps on the device (see adopt)
        # Groups read outside their modules in the warm-up's forward, and the uses of host copies' storage when that
        # forward began (see [Note: parameters read outside their modules]).
        self._read_outside: set[int] = set()
        self._host_uses: dict[int, int] | None = None
        self.lent: set[int] = set()  # the margin's groups, on the host while an evaluation borrows their room

    @classmethod
    def from_config(cls, config: GeminiConfig, manager: ChunkManager, *, budget_bytes: int,
                    fixed_bytes: int) -> AutoPlacement:
        return cls(manager, budget_bytes=budget_bytes, margin_ratio=config.gpu_margin_mem_ratio,
                   fixed_bytes=fixed_bytes)

    @property
    def follows_modules(self) -> bool:
        return not self._settled or bool(self.lent)  # see [Note: auto settled on the device]

    def initial_tier(self, kind: ChunkKind) -> Tier:
        return Tier.HOST

    def optimizer_tier(self, group: ChunkGroup) -> Tier:
        return Tier.DEVICE if group.index in self.os_on_device else Tier.HOST

    def keep_params_on_device(self, group: ChunkGroup) -> bool:
        # Where chunks can be evicted, a group read outside its modules leaves after its uses; in an iteration that
        # left its trace every group does ([Note: an iteration that leaves its trace]).
        return (self.plan is not None and not self._diverged
                and (group.index not in self._read_outside or not self.track_periods))

    def pinned_groups(self) -> set[int]:
        return self.os_on_device

    def resident_params(self) -> set[int]:
        return self._resident  # see [Note: parameters stay where nothing is evicted]

    resident_grads = resident_params  # the plan that evicts nothing has room for the gradients too

    # -------------------------------------------------------------------------- planning
    def activation_room_bytes(self, plan: MemoryPlan) -> int:
        """The part of ``plan``'s margin that optimizer states leave to saved activations kept on the device ([Note:
        activation offload] in gemini/engine/activations.py)."""
        margin = max(0, plan.margin_bytes)
        return margin - int(self.margin_ratio * margin)

    def with_trace(self, plan: MemoryPlan) -> MemoryPlan:  # what its warm-up found, kept with it
        return dataclasses.replace(plan, read_outside=frozenset(self._read_outside))

    def adopt(self, plan: MemoryPlan, *, activation_bytes: int = 0) -> None:
        """Take a warm-up's plan (or a kept one: [Note: plans kept per input signature] in tracer/signature.py):
        choose the optimizer-state groups on the device, next to ``activation_bytes`` of saved activations."""
        self.plan = plan
        self._read_outside = set(plan.read_outside)
        margin = max(0, plan.margin_bytes)
        # Those bytes are part of every period's non-model memory from now on.
        self.activation_bytes = activation_bytes
        trainable = self.manager.trainable_groups
        room = margin_room_bytes(margin, self.margin_ratio, param_dtype=self.manager.param_dtype,
                                 largest_capacity=max((g.param.capacity for g in trainable), default=0))
        self.lent, self.os_on_device = set(), set(margin_choice([(g.index, self.group_device_bytes(g))
                                                                for g in trainable], room))
        # If every chunk that can be on the device fits there at once next to the largest non-model peak, nothing will
        # ever be evicted: periods need not be followed, and the iteration runs without per-module boundary hooks.
        most = sum(self.group_device_bytes(g) if g.index in self.os_on_device
                   else g.param.nbytes + (g.grad.nbytes if g.grad is not None else 0) for g in self.manager.groups)
        self.track_periods = not fits(plan.budget_bytes, most, self.fixed_bytes, plan.max_non_model_bytes,
                                      self.activation_bytes, plan.reserve_bytes)
        # [Note: parameters stay where nothing is evicted]
        # Then (unless ZeRO-3 gathers them) a group updated on the host gets its parameters back right after its
        # update, inside the step (on CUDA beside the host's next runs, as torchao's offload does), not at the next
        # forward: the device holds no more than ``fits`` counted.
        # [Note: auto settled on the device]
        # When, besides, every group's optimizer states are on the device, no chunk will ever move: the iteration
        # runs as under "cuda", without module hooks and with autograd accumulating into the gradient chunks.
        evicts_nothing = not self.track_periods and not self.gathers_params
        self._resident = {g.index for g in self.manager.groups} if evicts_nothing else set()
        self._settled = evicts_nothing and len(self.os_on_device) == len(trainable)
        logger.info("auto placement: margin %d bytes x ratio %s -> %d of %d optimizer-state chunk groups on the "
                    "device", plan.margin_bytes, self.margin_ratio, len(self.os_on_device), len(trainable))

    def lend_margin(self, lend: bool) -> None:
        """The margin's groups to the host while an evaluation forward borrows their room, or back ([Note: an
        evaluation beside the margin] in gemini/engine/evaluation_room.py)."""
        if lend:
            self.lent, self.os_on_device = self.os_on_device, set()
        else:
            self.os_on_device, self.lent = self.os_on_device | self.lent, set()

    def abandon_plan(self) -> None:
        """Back to warm-up behaviour: optimizer states to the host, nothing kept resident."""
        self.plan = None
        self._settled = False
        self._resident = set()
        self.activation_bytes = 0
        self.os_on_device, self.lent = set(), set()

    def _non_model_now(self) -> int:
        plan = self.plan
        if plan is None:
            return 0  # warm-up: unknown, and the conservative schedule keeps little resident
        if self._diverged or not 0 <= self.period < len(plan.non_model_bytes):
            return plan.max_non_model_bytes
        segments = plan.segment_non_model_bytes[self.period]
        if self._segment < len(segments):
            return segments[self._segment]
        return plan.non_model_bytes[self.period]  # more marks than traced: the whole period's

    # ------------------------------------------------------------------------ hooks' side
    def begin_forward(self) -> None:
        # Periods count from the first forward of an iteration: a second forward before the backward (a loss over two
        # half batches) continues the traced sequence, as in the warm-up. A forward without grad ends no iteration.
        if not self._iteration_open:
            self.period = -1
            self._segment = 0
            self._diverged = self._skipped = False
        self._iteration_open = torch.is_grad_enabled()
        if self._trace is not None and torch.is_grad_enabled():
            self._host_uses = self._host_storage_uses()

    # [Note: parameters read outside their modules]
    # Code outside the calls of a group's modules may read a parameter too (a root reusing another module's weight
    # with F.linear), and autograd may save a view of whichever copy it reads for backward. The warm-up drops groups
    # after their last use, so there it reads the host copy, which stays put until the step; later iterations keep
    # fetched groups until evicted, so it reads the device copy, and an eviction before backward (an evaluation
    # forward in between, the backward's first boundary) frees that storage in place: backward fails ("setStorage:
    # ... storage of size 0"), as no module owning the group began its backward to fetch it back. So the warm-up's
    # forward finds such groups (their host copy's storage gained uses while it ran), and later iterations drop them
    # after each use as the warm-up did and the plan charged; where nothing is ever evicted they stay. Most such reads
    # are caught earlier, the reading ancestor's calls fetching the group ([Note: parameters of a descendant read by
    # its ancestor] in gemini/engine/descendant_reads.py); this covers what that search misses (a branch not taken, a
    # root called inside a compiled frame), which on CUDA fail as torch's device mismatch. Reads after the forward (a
    # penalty in the loss): [Note: read twice] in gemini/engine/backward_hooks.py.
    def end_forward(self) -> None:
        if self._host_uses is not None:
            before, self._host_uses = self._host_uses, None
            self._read_outside |= {i for i, n in self._host_storage_uses().items() if n > before.get(i, n)}

    def read_outside(self, group_index: int) -> None:
        if self._trace is not None:  # the warm-up finds them, as end_forward does
            self._read_outside.add(group_index)

    def _host_storage_uses(self) -> dict[int, int]:
        """Per group whose parameters are on the host only, the uses of its host copy's storage."""
        return {g.index: torch._C._storage_Use_Count(g.param.payload(Tier.HOST).untyped_storage()._cdata)
                for g in self.manager.groups if g.param.state is ChunkState.HOST and g.param_shard is None}

    def end_backward(self) -> None:
        self._iteration_open = False

    # [Note: an iteration that leaves its trace]
    # Control flow the inputs do not show (a depth or a route chosen in forward) may take an iteration past the traced
    # periods. Its non-model peaks are unknown from there on, and the trace's largest may be far below them: a deeper
    # path traced shallow went over the budget at every deep step, while traced first it trained there. So from the
    # period where it left, the iteration moves chunks as the warm-up did, whose peak the budget held: every fetch first
    # evicts each group not in use, and each group leaves after its use. The plan stays for the iterations that follow
    # it. The margin's groups stay (an overrun beside them retraces, as any overrun does).
    def on_boundary(self, boundary: Boundary) -> set[int] | None:
        plan = self.plan
        if plan is None:
            return None
        self.period += 1
        self._segment = 0
        self._used_in_period = set()
        key = (boundary.phase, boundary.module_name)
        if not self._diverged and (self.period >= len(plan.keys) or plan.keys[self.period] != key):
            later = plan.continues_at(self.period, key)  # [Note: an iteration that skips traced periods]
            self.period, self._diverged = (self.period, True) if later is None else (later, False)
            self._skipped = not self._diverged
            if self._diverged:
                logger.warning("auto placement: iteration diverged from the traced one at period %d (%s %r); moving "
                               "chunks as the warm-up does until the next forward", self.period,
                               boundary.phase.value, boundary.module_name)
        return set(plan.access[self.period]) if not self._diverged else set()

    def begin_trace(self, trace: AccessTrace) -> None:
        """The warm-up begins: tell ``trace`` which groups each period uses, and each mark."""
        self._trace = trace
        self._read_outside = set()  # found again by this trace

    def end_trace(self) -> None:
        self._trace = None

    def mark(self) -> None:
        if self._trace is not None:
            self._trace.mark()
        plan = self.plan
        if plan is not None:
            self._segment += 1
            if self._skipped and not self._diverged and self._segment >= len(plan.segment_non_model_bytes[self.period]):
                # More marks than traced: see [Note: an iteration that skips traced periods].
                later = plan.continues_at(self.period, plan.keys[self.period], marks=self._segment)
                self.period = self.period if later is None else later

    # [Note: every mark decides]
    # The plan charges each segment of a period the model data the warm-up held at its mark plus the segment's
    # non-model peak ([Note: segments of a period] in tracer/runtime.py), so every mark must be a decision that
    # evicts for the new segment's peak, not only marks where something lands or a module's backward releases
    # groups. At a mark that does neither (after a group whose gradients were all in before its module's backward
    # was done: dropped in the warm-up, cached after it) the warm-up may hold no chunk and meet its largest non-model
    # peak, while later steps hold the cached groups too, over budget - reserve once the margin fills what the plan
    # leaves. Cost: one budget check per mark (a sum of a few integers), in iterations whose periods are followed.
    def needed_now(self) -> set[int] | None:
        # The rest of the period may need the cached groups' room (the warm-up had dropped them).
        if self.plan is not None and not self._diverged and 0 <= self.period < len(self.plan.access):
            return set(self.plan.access[self.period])
        return None

    def accessed(self, groups: list[ChunkGroup]) -> None:
        if self._trace is not None:
            for g in groups:
                self._trace.record_access(g.index)
        if self.plan is not None:
            self._used_in_period.update(g.index for g in groups)

    def track_backward_uses(self, groups: list[ChunkGroup]) -> bool:
        # Released groups are dropped in the warm-up and evictable after it; with nothing ever evicted (periods not
        # followed) there is nothing to gain. Under ZeRO-3 a released group is gathered again at its next use, a
        # collective, so the choice must not follow this rank's own plan (ranks choosing differently would issue
        # collectives in different orders and hang); it stays the warm-up's choice, which the plan charged.
        return self.plan is None or self.track_periods or self.gathers_params

    # ------------------------------------------------------------------------- eviction
    # [Note: what a decision keeps]
    # The plan charges each decision of a period (its boundary, each mark) the model data the warm-up held there plus
    # the segment's non-model peak (planned_peak_bytes). The warm-up fetches a group at its first use and drops it
    # after its last, so at a decision it held the groups in use and little else: a group the period uses only later
    # (the next module's in a backward period, a recomputed block's under reentrant checkpointing) is charged in a
    # later segment. Keeping all the period's groups (plan.access[period]) at each decision would exceed that and fail
    # budgets the warm-up accepted (charging each decision the whole period instead would refuse budgets the warm-up
    # ran). So they are ``wanted``: evicted only when other groups are not enough, those the period is done with
    # first, then those it has yet to use, the last used first (``_soonest_first``); one evicted is fetched again at
    # its use, as in the warm-up.
    def _missing_bytes(self, nbytes: int, non_model: int) -> int:
        """What the budget lacks for ``nbytes`` more chunk bytes next to what is resident, the buffers, ``non_model``
        bytes of activations and workspaces, the plan's safety reserve and (ZeRO-3) a prefetched group's parameters."""
        reserve = self.plan.reserve_bytes if self.plan is not None else 0
        return missing_bytes(self.budget_bytes, self.manager.storage.ledger.bytes_on(Tier.DEVICE),
                             self.fixed_bytes, nbytes, non_model, reserve, self.activation_bytes,
                             self._prefetch_room_bytes())

    def _prefetch_room_bytes(self) -> int:
        """ZeRO-3: the room the next gather ahead needs beyond what the device holds now (a group gathered ahead and
        not used yet is in the ledger already, and must not be counted twice)."""
        if not self.prefetch_reserve_bytes:
            return 0
        ahead = sum(self.manager.groups[i].param.nbytes for i in self.prefetched)
        return max(0, self.prefetch_reserve_bytes - ahead)

    def victims(self, nbytes: int, *, keep: set[int], in_use: Callable[[], set[int]],
                wanted: set[int] = frozenset()) -> list[int]:
        over = self._missing_bytes(nbytes, self._non_model_now())
        if not over and not self._diverged:
            return []
        # Groups in use were kept by the warm-up too, so the plan has room for them; the margin's groups live on the
        # device for good. ``wanted`` ones may go, last (see [Note: what a decision keeps]).
        busy = keep | in_use() | self.os_on_device
        candidates = {g.index: self._evictable_bytes(g) for g in self.manager.groups if g.index not in busy}
        candidates = {i: b for i, b in candidates.items() if b > 0}
        if self._diverged:  # all of them: see [Note: an iteration that leaves its trace]
            over = max(over, sum(candidates.values()))
            if not over:
                return []
        try:
            if self.plan is not None and not self._diverged:
                victims = choose_victims(
                    set(candidates), keep, self.plan.order, max(self.period, 0), over, candidates,
                    rule=self.eviction_rule, last=self._soonest_first(wanted & set(candidates)),
                )
            else:  # no order to follow: the largest first, ``wanted`` ones last
                victims = choose_victims(set(candidates), keep, (), max(self.period, 0), over, candidates,
                                         last=sorted(wanted & set(candidates)))
        except EvictionError as e:
            short = over - sum(candidates.values())
            held = self.manager.storage.ledger.bytes_on(Tier.DEVICE)
            # Raised in forward or backward, before the step: parameters, optimizer states and step counts are
            # untouched; only this iteration's gradients are partial. The message says what the device holds in all:
            # the candidates exclude what is in use, so their bytes alone could read as an empty device.
            at_least = "at least " if self.plan is None else ""  # the warm-up's non-model bytes: unknown yet
            raise DeviceBudgetError(
                f"the device budget cannot hold this period: {at_least}{short} bytes are missing even after "
                f"evicting every chunk not in use (the device holds {held} bytes of chunks, "
                f"{held - sum(candidates.values())} of them in use now: parameters of running or pending "
                f"computations, gathered or prefetched parameters, gradient buckets, the margin's groups; {e}). "
                f"Nothing was updated: parameters and optimizer states are as before this iteration (call "
                f"optimizer.zero_grad() before retrying: its gradients are partial). Raise GeminiConfig.device_memory, "
                f"lower gpu_margin_mem_ratio, or use a smaller chunk_size or batch.",
                missing_bytes=short,
            ) from None
        return victims

    def _soonest_first(self, wanted: set[int]) -> list[int]:
        """``wanted`` by next use: those the current period has yet to use, in the order it first used them in the
        warm-up, then those it is done with, by their next use after it."""
        period = max(self.period, 0)
        access = self.plan.access[period] if period < len(self.plan.access) else ()
        upcoming = [i for i in access if i in wanted and i not in self._used_in_period]
        done = sorted(wanted.difference(upcoming), key=lambda i: (self.plan.order.next_use(i, period), i))
        return upcoming + done

    @staticmethod
    def _evictable_bytes(g: ChunkGroup) -> int:
        total = g.param.nbytes if g.param.state is ChunkState.HOST_AND_DEVICE else 0
        # A ZeRO gradient bucket waits for its reduce-scatter and is freed by it: never evicted.
        if g.grad is not None and g.grad.is_on(Tier.DEVICE) and g.grad_shard is None:
            total += g.grad.nbytes
        return total

    def prefetch(self) -> list[int]:
        """The next period's groups not on the device, if they fit beside both periods' non-model peaks."""
        plan = self.plan
        nxt = self.period + 1
        if plan is None or self._diverged or nxt >= len(plan.access):
            return []
        missing = [i for i in plan.access[nxt] if self.manager.groups[i].param.state is ChunkState.HOST]
        need = sum(self.manager.groups[i].param.nbytes for i in missing)
        non_model = max(plan.non_model_bytes[self.period], plan.non_model_bytes[nxt])
        return missing if missing and not self._missing_bytes(need, non_model) else []

