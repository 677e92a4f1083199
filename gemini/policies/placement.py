"""Placement policies: where each chunk lives, and what happens to it around compute.

A policy is chosen by type (one class per ``GeminiConfig.placement`` value). The hooks and the
optimizer call the same few entry points on whichever policy is in force; the policy moves
chunks only through :class:`chunks.Chunk`'s state-checked methods.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch

from chunks import ChunkGroup, ChunkKind, ChunkManager, ChunkState, Tier, fits, missing_bytes
from gemini.engine.activations import ActivationOffload
from gemini.policies.footprint import DeviceGroups, chunk_bytes, margin_choice, margin_room_bytes, static_choice
from gemini.engine.memory import DeviceBudgetError, DeviceMemory
from gemini.engine.nvme_tier import NvmeTier
from gemini.engine.plan import MemoryPlan
from gemini.parallel.zero import GradReducer, ParamGatherer
from tracer import Boundary, EvictionError, EvictionRule, Phase, choose_victims

logger = logging.getLogger(__name__)

__all__ = ["PlacementPolicy", "CudaPlacement", "CpuPlacement", "AutoPlacement", "StaticPlacement", "make_placement"]


class PlacementPolicy:
    """The common mechanics; subclasses decide tiers.

    [Note: parameter chunks around compute]
    Before a module runs (forward, or backward via the pre-backward hook), the param chunks
    holding its parameters get a device copy. A group whose optimizer states live on the host
    keeps its host copy (``keep_host=True``): the device copy is read-only during compute, so
    dropping it later costs no copy back. ``_compute_refs`` counts modules inside their
    forward that use a chunk (nested modules and tied weights share chunks), so a chunk is
    never dropped under a running module.
    """

    name = "base"

    def __init__(self, manager: ChunkManager, *, quiet: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> None:
        self.manager = manager
        # Host-side temporaries made inside it are not device memory (see DeviceMemory.quiet).
        self.quiet = quiet
        self._compute_refs: dict[int, int] = {}
        self._fetched_for_backward: set[int] = set()
        # Modules that use each chunk group in one forward pass, and (inside a forward pass
        # of the root module) how many of them have yet to run. See [Note: one fetch per pass].
        self._uses_per_forward: dict[int, int] = {}
        self._uses_left: dict[int, int] | None = None
        # Per chunk group: module calls whose backward has begun and not finished in this
        # backward pass (see [Note: a group between its uses in backward]).
        self._backward_uses_open: dict[int, int] = {}
        # Released in backward, dropped when the next module's compute begins without them.
        self._release_pending: set[int] = set()
        self._latest_backward_groups: list[ChunkGroup] = []  # of the call whose backward began last
        # Optimizer states in NVMe files, for groups on the host tier (None: no NVMe tier).
        self.nvme: NvmeTier | None = None
        # ZeRO (None without data parallelism): the gradient reduce-scatter, and with
        # parameter sharding the parameter all-gather (see gemini/parallel/zero.py).
        self.reducer: GradReducer | None = None
        self.gatherer: ParamGatherer | None = None

    def rebalance_nvme(self) -> None:
        """After the device's share of optimizer states changed: let the NVMe tier choose again
        among the groups whose states are on the host tier."""
        if self.nvme is not None:
            self.nvme.rebalance([g for g in self.manager.trainable_groups if self.optimizer_tier(g) is Tier.HOST])

    def count_uses(self, groups: Iterable[ChunkGroup]) -> None:
        """Record that one module uses ``groups`` in each forward pass."""
        for g in groups:
            self._uses_per_forward[g.index] = self._uses_per_forward.get(g.index, 0) + 1

    def setup(self) -> None:
        """Called once after registration: move chunks to where the policy keeps them."""

    @property
    def follows_modules(self) -> bool:
        """Whether chunks move around module calls, so that each module owning parameters needs
        the forward and backward hooks that drive them (see gemini/engine/hooks.py). A policy that
        keeps every chunk on the device for good needs none: the hooks would cost a few
        microseconds a module call for nothing."""
        return True

    # ------------------------------------------------------------------ decided per policy
    def initial_tier(self, kind: ChunkKind) -> Tier:
        raise NotImplementedError

    def optimizer_tier(self, group: ChunkGroup) -> Tier:
        """Where the optimizer-state chunks of ``group`` live, and so where Adam updates them."""
        raise NotImplementedError

    def keep_params_on_device(self, group: ChunkGroup) -> bool:
        """Whether a param chunk stays on the device after compute."""
        raise NotImplementedError

    def keep_grads_on_device(self, group: ChunkGroup) -> bool:
        return self.optimizer_tier(group) is Tier.DEVICE

    def _make_room(self, nbytes: int, keep: set[int]) -> None:
        """Before ``nbytes`` more land on the device: evict what the policy may evict."""

    def mark(self) -> None:
        """A decision point inside a period: a group's first gradient arrives, or a module's
        backward is done (see [Note: segments of a period] in tracer/runtime.py)."""

    def _after_release(self) -> None:
        """Groups were released inside a period: make room for the rest of it."""

    def on_boundary(self, boundary: Boundary) -> None:
        """A period boundary of a steady-state iteration (policies that plan by period)."""

    # ------------------------------------------------------------------------ forward pass
    # [Note: one fetch per pass]
    # A chunk holds the parameters of several consecutive modules (and a tied weight is used
    # by two). Dropping its device copy after each module would fetch it again for the next
    # one; instead, inside a forward pass of the root module, a fetched chunk stays until the
    # last module using it has run, so each param chunk crosses to the device once per pass.
    def begin_forward(self) -> None:
        self._uses_left = dict(self._uses_per_forward)
        if self.gatherer is not None:
            self.gatherer.begin_iteration()

    def end_forward(self) -> None:
        """The root module's forward is over: drop what modules that did not run left behind."""
        self._uses_left = None
        for g in self.manager.groups:
            if self._compute_refs.get(g.index, 0) == 0 and g.index not in self._fetched_for_backward:
                self._maybe_drop_params(g)

    def before_compute(self, groups: list[ChunkGroup]) -> None:
        self._drop_released(groups)
        for g in groups:
            self._compute_refs[g.index] = self._compute_refs.get(g.index, 0) + 1
        self._make_resident(groups)

    def after_compute(self, groups: Iterable[ChunkGroup]) -> None:
        for g in groups:
            refs = self._compute_refs[g.index] - 1
            assert refs >= 0, f"chunk group {g.index} released more often than accessed"
            self._compute_refs[g.index] = refs
            if self._uses_left is not None:
                self._uses_left[g.index] = self._uses_left.get(g.index, 0) - 1
                if self._uses_left[g.index] > 0:
                    continue
            if refs == 0 and g.index not in self._fetched_for_backward:
                self._maybe_drop_params(g)

    # ----------------------------------------------------------------------- backward pass
    def before_backward(self, groups: list[ChunkGroup]) -> None:
        """A module call using ``groups`` begins its backward."""
        self._drop_released(groups)
        self._latest_backward_groups = groups
        for g in groups:
            self._fetched_for_backward.add(g.index)
            self._backward_uses_open[g.index] = self._backward_uses_open.get(g.index, 0) + 1
        self._make_resident(groups)

    def grad_buffer(self, group: ChunkGroup):
        """The gradient chunk, with a device copy to receive this backward's gradients."""
        grad = group.grad
        if grad.state is not ChunkState.RELEASED and not grad.is_on(Tier.DEVICE) and not group.any_grad_ready:
            # A stale host copy from before zero_grad: nothing in it to accumulate onto.
            grad.release()
        if not grad.is_on(Tier.DEVICE):
            self._make_room(grad.nbytes, keep={group.index})
        if grad.state is ChunkState.RELEASED:
            # Slots not marked ready are written with copy_ before they are ever read, so
            # the payload need not be zeroed; under ZeRO the whole bucket is reduced, so
            # slots without a gradient in this pass (and the padding) must be zeros.
            grad.allocate(Tier.DEVICE, zero=group.grad_shard is not None)
        else:
            grad.move_to(Tier.DEVICE)
        return grad

    def after_backward(self, group: ChunkGroup) -> None:
        """``group``'s backward is over: every gradient it will get has arrived."""
        self._fetched_for_backward.discard(group.index)
        self._backward_uses_open.pop(group.index, None)
        if self._compute_refs.get(group.index, 0) == 0:
            self._maybe_drop_params(group)
        if group.trainable and self.reducer is not None:
            self.reducer.group_done(group)  # reduce-scattered into its shard (ZeRO)
        elif group.trainable and group.grad.state is not ChunkState.RELEASED and not self.keep_grads_on_device(group):
            group.grad.move_to(Tier.HOST)

    def end_backward(self) -> None:
        """The backward pass is over (after ``after_backward`` of every group it touched)."""
        self._backward_uses_open.clear()
        self._drop_released([])
        self._latest_backward_groups = []
        if self.reducer is not None:
            self.reducer.end_backward()
        if self.gatherer is not None:
            busy = {i for i, refs in self._compute_refs.items() if refs > 0} | self._fetched_for_backward
            self.gatherer.release_all(busy)

    # [Note: a group between its uses in backward]
    # A group fetched for backward is held until all its gradients are in (``after_backward``),
    # because autograd reads its parameters through saved views. Gradients arrive once per
    # backward pass, after every use: with two forwards before one backward, autograd runs the
    # second forward's whole backward before the first's; a tied weight (embedding and head)
    # is read at the start of backward and gets its gradient at the very end; a group that
    # straddles two blocks waits for the second. Held until then, each of these kept chunks on
    # the device through stretches of backward that never read them. So each module call is
    # followed through backward (as FSDP2 does): it *begins* when its outputs' gradients
    # arrive (the pre-backward hook, which fetches its groups) and is *done* when its inputs'
    # gradients are computed. A group whose begun calls are all done is released — dropped
    # (when the next module's compute begins without it) in the warm-up, evictable after it —
    # until a later call's backward begins and fetches it again; a call that has not begun cannot read it (its backward has not started). A call
    # whose inputs need no gradient (the embedding) is done once every autograd node between
    # its outputs and its parameters has run (see ``ModuleHooks._hook_nodes_of``); one that
    # cannot report done holds its groups until their gradients are in. This assumes, like FSDP2, that a
    # module's parameters are read by backward only on the way from its outputs to its inputs;
    # a parameter saved by an op off that path (``x + w * w``) could be read after the
    # release: a loud error (its storage is gone), never a wrong value.
    def track_backward_uses(self, groups: list[ChunkGroup]) -> bool:
        """Whether releasing ``groups`` between uses in backward can free anything."""
        return any(not self.keep_params_on_device(g) for g in groups)

    def backward_use_done(self, groups: list[ChunkGroup]) -> None:
        """A module call using ``groups`` whose backward began has finished it."""
        self.mark()
        released = False
        for g in groups:
            left = self._backward_uses_open.get(g.index, 0) - 1
            if left < 0:
                continue  # released already: every gradient of the group is in
            self._backward_uses_open[g.index] = left
            if left == 0 and g.index in self._fetched_for_backward:
                self._fetched_for_backward.discard(g.index)
                self._release_pending.add(g.index)
                released = True
        if released:
            # Normally the call that began last is this one, which keeps what it released for
            # the next call; but when the next call began first (hooks on one tensor: the head's
            # inputs are the final norm's outputs), what it does not use is dropped now.
            self._drop_released(self._latest_backward_groups)
            self._after_release()

    def _drop_released(self, needed: list[ChunkGroup]) -> None:
        """Drop the groups released in backward that the compute beginning now does not use.

        A released group is not dropped at once: a group that straddles two modules is often
        released by one and used by the very next (block i+1's first module, then block i's
        last), and dropping it in between bought no memory for a second copy."""
        if not self._release_pending:
            return
        keep = {g.index for g in needed}
        for i in self._release_pending - keep:
            if self._compute_refs.get(i, 0) == 0 and i not in self._fetched_for_backward:
                self._maybe_drop_params(self.manager.groups[i])
        self._release_pending &= keep

    def groups_fetched_for_backward(self) -> list[ChunkGroup]:
        return [self.manager.groups[i] for i in sorted(self._fetched_for_backward)]

    # ----------------------------------------------------------------------------- step
    def before_step(self, group: ChunkGroup) -> Tier:
        """Put the gradient and optimizer states of ``group`` together; return that tier."""
        tier = self.optimizer_tier(group)
        for chunk in group.optimizer_chunks:
            if chunk.in_file or chunk.io_pending:
                # On NVMe: the NVMe tier streams it into host memory (see gemini/engine/nvme_tier.py).
                assert tier is Tier.HOST, f"{chunk} is on NVMe but its group updates on {tier}"
                continue
            chunk.move_to(tier)
        if group.step_grad.state is not ChunkState.RELEASED:
            group.step_grad.move_to(tier)
        return tier

    def after_step(self, group: ChunkGroup) -> None:
        """Bring the parameters up to date with the masters (low precision only).

        Under ZeRO the masters are this rank's range: with parameter sharding they refresh the
        param shard; without, this rank's range of the param chunk's primary copy (the others
        arrive by ``gemini.parallel.zero.gather_params`` once every group is updated).
        """
        if group.shard is not None and group.param_shard is None:
            param = group.param
            primary = param.primary_tier
            if group.master is not None:
                start, end = group.shard.start, group.shard.end
                self._cast_master(group.master, group.shard.numel, param.payload(primary)[start:end], primary)
            return
        if group.master is None:
            return  # fp32: the param chunk (or shard) is the master and was updated in place
        param = group.param_shard if group.param_shard is not None else group.param
        n = group.os_numel if group.shard is not None else param.used_numel
        for tier in param.tiers:
            self._cast_master(group.master, n, param.payload(tier)[:n], tier)

    def after_commit(self, group: ChunkGroup) -> None:
        """The step has landed (every group updated): restore placements the step changed.
        Must not raise (see [Note: a step is all or nothing] in gemini/engine/transaction.py)."""

    def _cast_master(self, master, numel: int, out: torch.Tensor, tier: Tier) -> None:
        """``out`` (on ``tier``) = the first ``numel`` master elements in ``out``'s dtype."""
        if master.is_on(tier):
            out.copy_(master.payload(tier)[:numel])
            return
        # Cast where the master lies, then move the half-size result.
        src = master.tiers[0]
        with self.quiet() if src is Tier.HOST else contextlib.nullcontext():
            low = master.payload(src)[:numel].to(out.dtype)
        self.manager.storage.copy_(out, low, src=src, dst=tier)

    # ---------------------------------------------------------------------------- helpers
    def _make_resident(self, groups: list[ChunkGroup]) -> None:
        if self.gatherer is not None:  # ZeRO-3: gathered from the ranks' shards
            missing = [g for g in groups if not self.gatherer.gathered(g)]
            if missing:
                self._make_room(sum(g.param.nbytes for g in missing), keep={g.index for g in groups})
            self.gatherer.gather(groups)
            return
        missing = [g for g in groups if g.param.state is ChunkState.HOST]
        if not missing:
            return
        self._make_room(sum(g.param.nbytes for g in missing), keep={g.index for g in groups})
        for g in missing:
            g.param.fetch(keep_host=self.optimizer_tier(g) is Tier.HOST if g.trainable else True)

    def _maybe_drop_params(self, g: ChunkGroup) -> None:
        if self.gatherer is not None:
            # ZeRO-3: released after use whatever the policy (prefetched ones wait for their use).
            if g.index not in self.gatherer.prefetched:
                self.gatherer.release(g)
            return
        if g.param.state is ChunkState.HOST_AND_DEVICE and not self.keep_params_on_device(g):
            g.param.drop_device_copy()

    def _pin_on_device(self, g: ChunkGroup) -> None:
        """Keep every flavour of ``g`` on the device only (its optimizer states update there)."""
        if self.nvme is not None:
            self.nvme.bring_back(g)
        for chunk in g.chunks:
            if chunk.state is not ChunkState.RELEASED:
                chunk.move_to(Tier.DEVICE)

    @staticmethod
    def group_device_bytes(g: ChunkGroup) -> int:
        """Bytes of every flavour of ``g`` (the cost of keeping the whole group on the device)."""
        return sum(c.nbytes for c in g.chunks)


class CudaPlacement(PlacementPolicy):
    """Everything on the device: parameters, gradients, masters and Adam states."""

    name = "cuda"

    @property
    def follows_modules(self) -> bool:
        return self.gatherer is not None  # ZeRO-3 gathers each module's parameters around its call

    def initial_tier(self, kind: ChunkKind) -> Tier:
        return Tier.DEVICE

    def optimizer_tier(self, group: ChunkGroup) -> Tier:
        return Tier.DEVICE

    def keep_params_on_device(self, group: ChunkGroup) -> bool:
        return True


class CpuPlacement(PlacementPolicy):
    """Everything on the host; parameters visit the device for compute, CPU Adam steps.

    The device holds only the param chunks of the modules running now and the gradient chunks
    being filled by the backward pass.
    """

    name = "cpu"

    def initial_tier(self, kind: ChunkKind) -> Tier:
        return Tier.HOST

    def optimizer_tier(self, group: ChunkGroup) -> Tier:
        return Tier.HOST

    def keep_params_on_device(self, group: ChunkGroup) -> bool:
        return False


class StaticPlacement(PlacementPolicy):
    """Fixed fractions, no warm-up heuristics.

    The first ``param_device_fraction`` of the chunk groups keep their parameters on the
    device for good; the last ``optimizer_offload_fraction`` of the trainable groups keep their
    optimizer states on the host (CPU Adam) and the others keep theirs — and so the whole group
    — on the device.
    """

    name = "static"

    def __init__(self, manager: ChunkManager, *, param_device_fraction: float, optimizer_offload_fraction: float,
                 **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self.param_device_fraction = param_device_fraction
        self.optimizer_offload_fraction = optimizer_offload_fraction
        self.params_on_device: set[int] = set()
        self.os_on_device: set[int] = set()

    def initial_tier(self, kind: ChunkKind) -> Tier:
        return Tier.HOST

    def _choose(self) -> None:
        self.params_on_device, self.os_on_device = static_choice(
            [g.index for g in self.manager.groups], [g.index for g in self.manager.trainable_groups],
            param_device_fraction=self.param_device_fraction,
            optimizer_offload_fraction=self.optimizer_offload_fraction,
        )

    def setup(self) -> None:
        self._choose()
        for g in self.manager.groups:
            if g.index in self.os_on_device:
                self._pin_on_device(g)
            elif g.index in self.params_on_device and g.param_shard is None:
                g.param.fetch(keep_host=True)

    def pinned_bytes(self) -> int:
        """Chunk bytes this policy keeps on the device for good (at the end of every step)."""
        self._choose()
        m = self.manager
        layout = [(range(len(g.slots)), g.param_group, g.param.capacity) for g in m.groups]
        choice = DeviceGroups(whole=frozenset(self.os_on_device), params=frozenset(self.params_on_device))
        return sum(chunk_bytes(layout, choice, param_dtype=m.param_dtype, world=m.world,
                               shard_params=m.shard_params)[Tier.DEVICE].values())

    def optimizer_tier(self, group: ChunkGroup) -> Tier:
        return Tier.DEVICE if group.index in self.os_on_device else Tier.HOST

    def keep_params_on_device(self, group: ChunkGroup) -> bool:
        return group.index in self.params_on_device or group.index in self.os_on_device

    def after_commit(self, group: ChunkGroup) -> None:
        # fp32 groups updated on the host dropped their (now stale) device copy: fetch the
        # fresh parameters back if this group's parameters live on the device.
        if group.index in self.params_on_device and group.param.state is ChunkState.HOST:
            try:
                group.param.fetch(keep_host=True)
            except (torch.OutOfMemoryError, DeviceBudgetError) as e:
                # The step has landed: raising would invite a retry that steps twice. The
                # next forward fetches the parameters (or says what is missing).
                logger.warning("parameters of chunk group %d stay in host memory after the step: %s", group.index, e)


class AutoPlacement(PlacementPolicy):
    """Traced, budgeted placement; see the module notes and [Note: auto placement].

    [Note: auto placement]
    - Warm-up (no plan yet): like "cpu" — chunks start on the host, are fetched for compute
      and dropped after use — while the tracer measures each period's non-model peak and
      records which chunk groups each period uses.
    - Steady state: at each period boundary the device must hold the period's non-model peak
      on top of the resident chunks, under ``budget - reserve``; when it cannot, the resident
      chunk groups whose next use is furthest away are evicted (Belady, from the recorded
      order). Fetched chunks stay until pressure evicts them, and the next period's chunks
      are prefetched when they fit next to both periods' non-model peaks.
    - Margin: ``budget - reserve - the warm-up's planned peak`` (see ``MemoryPlan.margin_bytes``);
      ``gpu_margin_mem_ratio`` of it holds whole chunk groups (params, grads, master, m, v)
      on the device for good, updated there by the device Adam.
    """

    name = "auto"

    def __init__(self, manager: ChunkManager, *, memory: DeviceMemory, margin_ratio: float, fixed_bytes: int) -> None:
        super().__init__(manager, quiet=memory.quiet)
        self.memory = memory
        self.margin_ratio = margin_ratio
        self.fixed_bytes = fixed_bytes
        self.plan: MemoryPlan | None = None
        self.os_on_device: set[int] = set()
        self.period = -1
        self._diverged = False
        self._iteration_open = False  # a forward with grad ran and its backward has not
        self.record_access = lambda group_index: None  # set by the runtime during warm-up
        self.record_mark = lambda: None  # likewise
        self._segment = 0  # marks passed in the current period
        self.evictions = 0
        # Belady over the plan's order; LRU only to measure what that order saves (bench_budget).
        self.eviction_rule = EvictionRule.BELADY
        self.track_periods = True  # decided by adopt()
        self._settled = False  # the plan keeps every chunk on the device for good (see adopt)
        # ZeRO-3: the parameter gather prefetches one group ahead outside this policy's control.
        self.prefetch_reserve_bytes = 0
        self.activation_bytes = 0  # saved activations the plan keeps on the device (see adopt)

    @property
    def follows_modules(self) -> bool:
        return not self._settled  # see [Note: auto settled on the device]

    def initial_tier(self, kind: ChunkKind) -> Tier:
        return Tier.HOST

    def optimizer_tier(self, group: ChunkGroup) -> Tier:
        return Tier.DEVICE if group.index in self.os_on_device else Tier.HOST

    def keep_params_on_device(self, group: ChunkGroup) -> bool:
        return self.plan is not None

    # -------------------------------------------------------------------------- planning
    def adopt(self, plan: MemoryPlan, *, activations: ActivationOffload | None = None) -> None:
        """Take the warm-up's plan: choose the optimizer-state groups that live on the device,
        and (with activation offload) the saved activations that stay there."""
        self.plan = plan
        margin = max(0, plan.margin_bytes)
        # The rest of the margin keeps the last saved activations on the device; those bytes
        # are then part of every period's non-model memory (see [Note: activation offload]).
        self.activation_bytes = (activations.plan(margin - int(self.margin_ratio * margin))
                                 if activations is not None else 0)
        trainable = self.manager.trainable_groups
        room = margin_room_bytes(margin, self.margin_ratio, param_dtype=self.manager.param_dtype,
                                 largest_capacity=max((g.param.capacity for g in trainable), default=0))
        self.os_on_device = set(margin_choice([(g.index, self.group_device_bytes(g)) for g in trainable], room))
        chosen = [g for g in trainable if g.index in self.os_on_device]
        for g in chosen:
            self._pin_on_device(g)
        # If every chunk that can be on the device fits there at once next to the largest
        # non-model peak, nothing will ever be evicted: periods need not be followed, and
        # the iteration runs without per-module boundary hooks (as fast as "cuda").
        most = sum(
            self.group_device_bytes(g) if g.index in self.os_on_device
            else g.param.nbytes + (g.grad.nbytes if g.grad is not None else 0)
            for g in self.manager.groups
        )
        self.track_periods = not fits(plan.budget_bytes, most, self.fixed_bytes, plan.max_non_model_bytes,
                                      self.activation_bytes, plan.reserve_bytes)
        # [Note: auto settled on the device] When, besides, every group's optimizer states are
        # on the device (and no rank gathers parameters), no chunk will ever move: the frozen
        # groups' parameters are fetched now, and the iteration runs as under "cuda", without
        # module hooks and with autograd accumulating into the gradient chunks.
        self._settled = (not self.track_periods and self.gatherer is None
                         and len(self.os_on_device) == len(trainable))
        if self._settled:
            for g in self.manager.groups:
                if g.param.state is ChunkState.HOST:
                    g.param.fetch(keep_host=True)
        logger.info(
            "auto placement: margin %d bytes x ratio %s -> %d of %d optimizer-state chunk groups on the device",
            plan.margin_bytes, self.margin_ratio, len(chosen), len(self.manager.trainable_groups),
        )

    def abandon_plan(self) -> None:
        """Back to warm-up behaviour: optimizer states to the host, nothing kept resident."""
        self.plan = None
        self._settled = False
        self.activation_bytes = 0
        for i in sorted(self.os_on_device):
            for chunk in self.manager.groups[i].chunks:
                if chunk.state is not ChunkState.RELEASED:
                    chunk.move_to(Tier.HOST)
        self.os_on_device = set()
        for g in self.manager.groups:
            if self._compute_refs.get(g.index, 0) == 0 and g.index not in self._fetched_for_backward:
                self._maybe_drop_params(g)

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
        super().begin_forward()
        # Periods count from the first forward of an iteration: a second forward before the
        # backward (a loss over two half batches) continues the traced sequence, as in the
        # warm-up. A forward without grad (evaluation) ends no iteration of its own.
        if not self._iteration_open:
            self.period = -1
            self._segment = 0
            self._diverged = False
        self._iteration_open = torch.is_grad_enabled()

    def end_backward(self) -> None:
        super().end_backward()
        self._iteration_open = False

    def on_boundary(self, boundary: Boundary) -> None:
        plan = self.plan
        if plan is None or (boundary.module_name == "" and boundary.phase is Phase.FORWARD):
            return
        self.period += 1
        self._segment = 0
        if not self._diverged and (self.period >= len(plan.keys) or plan.keys[self.period] != (boundary.phase, boundary.module_name)):
            self._diverged = True
            logger.warning(
                "auto placement: iteration diverged from the traced one at period %d (%s %r); "
                "planning with the largest non-model peak until the next forward",
                self.period, boundary.phase.value, boundary.module_name,
            )
        needed = set(plan.access[self.period]) if not self._diverged else set()
        self._make_room(0, keep=needed)
        self._prefetch()

    def mark(self) -> None:
        self.record_mark()
        if self.plan is not None:
            self._segment += 1

    def _after_release(self) -> None:
        # The rest of the period may need what the released groups hold (an activation peak
        # the warm-up reached after dropping them): evict for the new segment now.
        if self.plan is not None and not self._diverged and 0 <= self.period < len(self.plan.access):
            self._make_room(0, keep=set(self.plan.access[self.period]))

    def before_compute(self, groups: list[ChunkGroup]) -> None:
        for g in groups:
            self.record_access(g.index)
        super().before_compute(groups)

    def before_backward(self, groups: list[ChunkGroup]) -> None:
        for g in groups:
            self.record_access(g.index)
        super().before_backward(groups)

    def track_backward_uses(self, groups: list[ChunkGroup]) -> bool:
        # Released groups are dropped in the warm-up and evictable after it; with nothing ever
        # evicted (periods not followed) there is nothing to gain.
        return self.plan is None or self.track_periods

    # ------------------------------------------------------------------------- eviction
    def _missing_bytes(self, nbytes: int, non_model: int) -> int:
        """What the budget lacks for ``nbytes`` more chunk bytes next to what is resident, the
        buffers, ``non_model`` bytes of activations and workspaces, the plan's safety reserve
        and (ZeRO-3) a prefetched group's parameters."""
        reserve = self.plan.reserve_bytes if self.plan is not None else 0
        return missing_bytes(self.memory.budget_bytes, self.manager.storage.ledger.bytes_on(Tier.DEVICE),
                             self.fixed_bytes, nbytes, non_model, reserve, self.activation_bytes,
                             self.prefetch_reserve_bytes)

    def _make_room(self, nbytes: int, keep: set[int]) -> None:
        over = self._missing_bytes(nbytes, self._non_model_now())
        if not over:
            return
        # In use, so never evicted: groups under a running forward, and groups fetched for a
        # backward whose gradients are not all in (their module's backward may not have run:
        # autograd reads the parameters through saved views). The warm-up kept them too, so
        # the plan has room for them.
        busy = keep | self.os_on_device | self._fetched_for_backward
        candidates = {
            g.index: self._evictable_bytes(g)
            for g in self.manager.groups
            if g.index not in busy and self._compute_refs.get(g.index, 0) == 0
        }
        candidates = {i: b for i, b in candidates.items() if b > 0}
        try:
            if self.plan is not None and not self._diverged:
                victims = choose_victims(
                    set(candidates), keep, self.plan.order, max(self.period, 0), over, candidates,
                    rule=self.eviction_rule,
                )
            else:
                victims = self._any_victims(candidates, over)
        except EvictionError as e:
            short = over - sum(candidates.values())
            # Raised in forward or backward, before the step: parameters, optimizer states and
            # step counts are untouched; only this iteration's gradients are partial.
            raise DeviceBudgetError(
                f"the device budget cannot hold this period: {short} bytes are missing even after evicting every "
                f"chunk not in use ({e}). Nothing was updated: parameters and optimizer states are as before this "
                f"iteration (call optimizer.zero_grad() before retrying: its gradients are partial). Raise "
                f"GeminiConfig.device_memory, lower gpu_margin_mem_ratio, or use a smaller chunk_size or batch.",
                missing_bytes=short,
            ) from None
        for i in victims:
            self._evict(self.manager.groups[i])

    @staticmethod
    def _any_victims(candidates: dict[int, int], over: int) -> list[int]:
        victims, freed = [], 0
        for i, b in sorted(candidates.items(), key=lambda kv: -kv[1]):
            if freed >= over:
                break
            victims.append(i)
            freed += b
        if freed < over:
            raise EvictionError(f"only {freed} of {over} bytes can be freed")
        return victims

    @staticmethod
    def _evictable_bytes(g: ChunkGroup) -> int:
        total = g.param.nbytes if g.param.state is ChunkState.HOST_AND_DEVICE else 0
        # A ZeRO gradient bucket waits for its reduce-scatter and is freed by it: never evicted.
        if g.grad is not None and g.grad.is_on(Tier.DEVICE) and g.grad_shard is None:
            total += g.grad.nbytes
        return total

    def _evict(self, g: ChunkGroup) -> None:
        self.evictions += 1
        if g.param.state is ChunkState.HOST_AND_DEVICE:
            g.param.drop_device_copy()
        if g.grad is not None and g.grad.is_on(Tier.DEVICE) and g.grad_shard is None:
            g.grad.move_to(Tier.HOST)

    def _prefetch(self) -> None:
        plan = self.plan
        nxt = self.period + 1
        if self._diverged or nxt >= len(plan.access):
            return
        groups = [self.manager.groups[i] for i in plan.access[nxt]]
        missing = [g for g in groups if g.param.state is ChunkState.HOST]
        need = sum(g.param.nbytes for g in missing)
        non_model = max(plan.non_model_bytes[self.period], plan.non_model_bytes[nxt])
        if missing and not self._missing_bytes(need, non_model):
            for g in missing:
                g.param.fetch(keep_host=self.optimizer_tier(g) is Tier.HOST if g.trainable else True)


def make_placement(config, manager: ChunkManager, *, memory: DeviceMemory, fixed_bytes: int) -> PlacementPolicy:
    name = config.placement
    if name == "cuda":
        return CudaPlacement(manager, quiet=memory.quiet)
    if name == "cpu":
        return CpuPlacement(manager, quiet=memory.quiet)
    if name == "static":
        return StaticPlacement(
            manager,
            param_device_fraction=config.static_param_device_fraction,
            optimizer_offload_fraction=config.static_optimizer_offload_fraction,
            quiet=memory.quiet,
        )
    if name == "auto":
        return AutoPlacement(manager, memory=memory, margin_ratio=config.gpu_margin_mem_ratio, fixed_bytes=fixed_bytes)
    raise ValueError(f"GeminiConfig.placement={name!r} has no policy; expected cuda, cpu, static or auto")
