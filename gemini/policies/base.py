"""`PlacementPolicy`: the mechanics every placement policy shares around compute and the step.

A policy is chosen by type (one class per ``GeminiConfig.placement`` value: cuda, cpu and static
in gemini/policies/fixed.py, auto in gemini/policies/auto.py; ``make_placement`` picks one). The
hooks and the optimizer call the same few entry points on whichever policy is in force; the
policy moves chunks only through :class:`chunks.Chunk`'s state-checked methods.

Data parallelism is plugged in from outside: a policy knows ZeRO's gradient reduction and
parameter gather only as the two protocols below, so policies import nothing of
gemini/parallel/ and gemini/parallel/ nothing of the policies.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from chunks import ChunkGroup, ChunkKind, ChunkManager, ChunkState, Tier
from tracer import Boundary

logger = logging.getLogger(__name__)

__all__ = ["GradReduce", "NvmeStates", "ParamGather", "PlacementPolicy"]


class GradReduce(Protocol):
    """ZeRO's gradient reduce-scatter as a policy drives it (``gemini.parallel.zero.GradReducer``)."""

    def group_done(self, group: ChunkGroup) -> None: ...

    def end_backward(self) -> None: ...


class ParamGather(Protocol):
    """ZeRO-3's parameter all-gather as a policy drives it (``gemini.parallel.zero.ParamGatherer``)."""

    prefetched: set[int]

    def begin_iteration(self) -> None: ...

    def gathered(self, g: ChunkGroup) -> bool: ...

    def gather(self, groups: Sequence[ChunkGroup]) -> None: ...

    def release(self, g: ChunkGroup) -> None: ...

    def release_all(self, busy: set[int]) -> None: ...


class NvmeStates(Protocol):
    """The NVMe tier of the optimizer states as a policy uses it (``gemini.engine.nvme_tier.NvmeTier``)."""

    def rebalance(self, host_groups: Sequence[ChunkGroup]) -> None: ...

    def bring_back(self, group: ChunkGroup) -> None: ...


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
        self.nvme: NvmeStates | None = None
        # ZeRO (None without data parallelism), plugged in by initialize: the gradient
        # reduce-scatter, and with parameter sharding the parameter all-gather (see
        # gemini/parallel/zero.py; the policy sees them only through these protocols).
        self.reducer: GradReduce | None = None
        self.gatherer: ParamGather | None = None

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
        for g in groups:  # prefetched: compute waits for the copy now ([Note: a prefetch overlaps compute])
            g.param.ready_on_device()
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
