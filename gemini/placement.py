"""Placement policies: where each chunk lives, and what happens to it around compute.

A policy is chosen by type (one class per ``GeminiConfig.placement`` value). The hooks and the
optimizer call the same few entry points on whichever policy is in force; the policy moves
chunks only through :class:`chunks.Chunk`'s state-checked methods.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from chunks import ChunkGroup, ChunkKind, ChunkManager, ChunkState, Tier

logger = logging.getLogger(__name__)

__all__ = ["PlacementPolicy", "CudaPlacement", "CpuPlacement", "make_placement"]


class PlacementPolicy:
    """The common mechanics; subclasses decide tiers.

    [Note: parameter chunks around compute]
    Before a module runs (forward, or backward via the pre-backward hook), the param chunks
    holding its parameters get a device copy. A policy that keeps parameters on the host
    fetches with ``keep_host=True``: the device copy is read-only during compute, so dropping
    it afterwards costs no copy back. ``_compute_refs`` counts modules inside their forward
    that use a chunk (nested modules and tied weights share chunks), so a chunk is never
    dropped under a running module.
    """

    name = "base"

    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager
        self._compute_refs: dict[int, int] = {}
        self._fetched_for_backward: set[int] = set()
        # Modules that use each chunk group in one forward pass, and (inside a forward pass
        # of the root module) how many of them have yet to run. See [Note: one fetch per pass].
        self._uses_per_forward: dict[int, int] = {}
        self._uses_left: dict[int, int] | None = None

    def count_uses(self, groups: Iterable[ChunkGroup]) -> None:
        """Record that one module uses ``groups`` in each forward pass."""
        for g in groups:
            self._uses_per_forward[g.index] = self._uses_per_forward.get(g.index, 0) + 1

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

    # ------------------------------------------------------------------------ forward pass
    # [Note: one fetch per pass]
    # A chunk holds the parameters of several consecutive modules (and a tied weight is used
    # by two). Dropping its device copy after each module would fetch it again for the next
    # one; instead, inside a forward pass of the root module, a fetched chunk stays until the
    # last module using it has run, so each param chunk crosses to the device once per pass.
    def begin_forward(self) -> None:
        self._uses_left = dict(self._uses_per_forward)

    def end_forward(self) -> None:
        """The root module's forward is over: drop what modules that did not run left behind."""
        self._uses_left = None
        for g in self.manager.groups:
            if self._compute_refs.get(g.index, 0) == 0 and g.index not in self._fetched_for_backward:
                self._maybe_drop_params(g)

    def before_compute(self, groups: Iterable[ChunkGroup]) -> None:
        for g in groups:
            self._compute_refs[g.index] = self._compute_refs.get(g.index, 0) + 1
            self._make_resident(g)

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
    def before_backward(self, groups: Iterable[ChunkGroup]) -> None:
        for g in groups:
            self._fetched_for_backward.add(g.index)
            self._make_resident(g)

    def grad_buffer(self, group: ChunkGroup):
        """The gradient chunk, with a device copy to receive this backward's gradients."""
        grad = group.grad
        if grad.state is not ChunkState.RELEASED and not grad.is_on(Tier.DEVICE) and not group.any_grad_ready:
            # A stale host copy from before zero_grad: nothing in it to accumulate onto.
            grad.release()
        if grad.state is ChunkState.RELEASED:
            # Slots not marked ready are written with copy_ before they are ever read, so
            # the payload need not be zeroed.
            grad.allocate(Tier.DEVICE, zero=False)
        else:
            grad.move_to(Tier.DEVICE)
        return grad

    def after_backward(self, group: ChunkGroup) -> None:
        """``group``'s backward is over: every gradient it will get has arrived."""
        self._fetched_for_backward.discard(group.index)
        if self._compute_refs.get(group.index, 0) == 0:
            self._maybe_drop_params(group)
        if group.trainable and group.grad.state is not ChunkState.RELEASED and not self.keep_grads_on_device(group):
            group.grad.move_to(Tier.HOST)

    def groups_fetched_for_backward(self) -> list[ChunkGroup]:
        return [self.manager.groups[i] for i in sorted(self._fetched_for_backward)]

    # ----------------------------------------------------------------------------- step
    def before_step(self, group: ChunkGroup) -> Tier:
        """Put the gradient and optimizer states of ``group`` together; return that tier."""
        tier = self.optimizer_tier(group)
        for chunk in group.optimizer_chunks:
            chunk.move_to(tier)
        if group.grad.state is not ChunkState.RELEASED:
            group.grad.move_to(tier)
        return tier

    def after_step(self, group: ChunkGroup) -> None:
        """Bring the param chunk up to date with the masters (low precision only)."""
        if group.master is None:
            return  # fp32: the param chunk is the master and was updated in place
        param, master = group.param, group.master
        for tier in param.tiers:
            if master.is_on(tier):
                param.used(tier).copy_(master.used(tier))
            else:
                # Cast where the master lies, then move the half-size result.
                src = master.tiers[0]
                low = master.used(src).to(param.dtype)
                self.manager.storage.copy_(param.used(tier), low, src=src, dst=tier)

    # ---------------------------------------------------------------------------- helpers
    def _make_resident(self, g: ChunkGroup) -> None:
        if g.param.state is ChunkState.HOST:
            g.param.fetch(keep_host=not self.keep_params_on_device(g))

    def _maybe_drop_params(self, g: ChunkGroup) -> None:
        if g.param.state is ChunkState.HOST_AND_DEVICE and not self.keep_params_on_device(g):
            g.param.drop_device_copy()


class CudaPlacement(PlacementPolicy):
    """Everything on the device: parameters, gradients, masters and Adam states."""

    name = "cuda"

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


_POLICIES: dict[str, type[PlacementPolicy]] = {p.name: p for p in (CudaPlacement, CpuPlacement)}


def make_placement(name: str, manager: ChunkManager) -> PlacementPolicy:
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(
            f"GeminiConfig.placement={name!r} has no policy in this build; available: {sorted(_POLICIES)}"
        ) from None
    return cls(manager)
