"""`StepMoves`: the moves of chunk groups around the optimizer's step, the part of `Residency`
(gemini/engine/residency.py, which derives from it) kept in a file of its own."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from chunks import ChunkGroup, ChunkManager, ChunkState, Tier
from gemini.errors import DeviceBudgetError
from gemini.policies.base import PlacementPolicy

logger = logging.getLogger(__name__)

__all__ = ["StepMoves"]


class StepMoves:
    """The step's side of :class:`gemini.engine.residency.Residency`: gradients where the backward writes them and
    the step reads them, gradients and optimizer states together before the update, parameters from the masters
    after it."""

    manager: ChunkManager
    policy: PlacementPolicy
    quiet: Callable[[], AbstractContextManager]
    make_room: Callable[..., None]  # Residency's: evict what the policy names
    grads_come_back = False  # a backward added onto gradients sent to the host (see grad_done)

    def grad_buffer(self, group: ChunkGroup):
        """The gradient chunk, with a device copy to receive this backward's gradients."""
        grad = group.grad
        if grad.state is not ChunkState.RELEASED and not grad.is_on(Tier.DEVICE) and not group.any_grad_ready:
            # A stale host copy from before zero_grad: nothing in it to accumulate onto.
            grad.release()
        if not grad.is_on(Tier.DEVICE):
            self.make_room(grad.nbytes, keep={group.index})
        if grad.state is ChunkState.RELEASED:
            # Slots not marked ready are written with copy_ before they are read; zeros where whole-chunk reductions
            # read what no slot writes: ZeRO's buckets (slots without a gradient this pass, the padding) and the gaps
            # between aligned slots.
            grad.allocate(Tier.DEVICE, zero=group.grad_shard is not None or grad.has_gaps)
        else:
            # see [Note: accumulated gradients stay on the device]
            self.grads_come_back |= grad.state is ChunkState.HOST
            grad.move_to(Tier.DEVICE)
        return grad

    # [Note: accumulated gradients stay on the device]
    # A group whose optimizer states update on the host sends its gradients there as soon as its backward is over
    # ([Note: host groups updated as their gradients land] in gemini/optim/adam_batches.py). Under gradient
    # accumulation the next backward of the step must bring them back to add onto, waiting for each copy, so every
    # micro-batch but the first would move every gradient both ways. Where the policy has room for every gradient
    # on the device (``resident_grads``: auto where its plan evicts nothing, having counted them), they stay there
    # once a backward has added onto gradients sent away (``grads_come_back``), and the step sends them as it does
    # for groups updated on the device: one copy to the host a step, none back. This is learnt from the first such
    # backward (micro-batches per step rarely change), so a loop with one backward a step keeps its copies
    # overlapping the backward and holds nothing on the device longer. ``p.grad`` views the device copy meanwhile,
    # and clipping scales it, as under placement "cuda".
    def grad_done(self, group: ChunkGroup) -> None:
        """``group``'s gradients of this backward are in (no ZeRO): send them to the host where its optimizer
        states update there, unless they stay ([Note: accumulated gradients stay on the device])."""
        if group.grad.state is ChunkState.RELEASED or self.policy.keep_grads_on_device(group):
            return
        if not (self.grads_come_back and group.index in self.policy.resident_grads()):
            group.grad.move_to(Tier.HOST)

    def before_step(self, group: ChunkGroup) -> Tier:
        """Put the gradient and optimizer states of ``group`` together; return that tier."""
        tier = self.policy.optimizer_tier(group)
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

        Under ZeRO the masters are this rank's range: with parameter sharding they refresh the param shard;
        without, this rank's range of the param chunk's primary copy (the other ranges arrive by
        ``gemini.parallel.zero.gather_params`` once every group is updated).
        """
        if group.shard is not None and group.param_shard is None:
            param = group.param
            primary = param.primary_tier
            if group.master is not None:
                start, end = group.shard.start, group.shard.end
                param.host_copy_pending(self._cast_master(group.master, group.shard.numel,
                                                       param.payload(primary)[start:end], primary))
            return
        if group.master is None:
            return  # fp32: the param chunk (or shard) is the master and was updated in place
        param = group.param_shard if group.param_shard is not None else group.param
        n = group.os_numel if group.shard is not None else param.used_numel
        for tier in param.tiers:
            param.host_copy_pending(self._cast_master(group.master, n, param.payload(tier)[:n], tier))

    def after_commit(self, group: ChunkGroup) -> None:
        """``group``'s update has landed: bring back to the device parameters the policy keeps there that the step
        left on the host (fp32 groups updated there drop their stale device copy). Called once every update of the
        step has landed, or for a group updated on the host right after its run
        ([Note: host groups updated as their gradients land] in gemini/optim/adam_batches.py). Must not raise
        ([Note: a step is all or nothing] in gemini/engine/transaction.py)."""
        if group.index in self.policy.resident_params() and group.param.state is ChunkState.HOST:
            try:
                group.param.fetch(keep_host=True)
            except (torch.OutOfMemoryError, DeviceBudgetError) as e:
                # The step has landed: raising would invite a retry that steps twice. The next forward fetches the
                # parameters (or says what is missing).
                logger.warning("parameters of chunk group %d stay in host memory after the step: %s", group.index, e)

    # [Note: edits of low-precision parameters]
    # Under bf16/fp16 the parameters are the fp32 masters' cast, cast again after each step, so an edit torch code
    # makes to a parameter (``p.mul_(0.5)``, ``nn.init.*``, an assigned ``p.data``) would be overwritten by the next
    # step. So a group whose parameters were written through ([Note: writes through the parameters] in
    # chunks/edits.py) has its masters take the edit before the update: where a parameter differs from its master's
    # cast the master becomes the parameter's value; elsewhere the master keeps its low bits. Only an edited group
    # pays (a compare over its range, and a copy across tiers when parameters and masters lie apart); the others
    # cost a sum of version counters per step. A master on NVMe takes the edit when a step streams it.
    def merge_param_edits(self, groups) -> list[ChunkGroup]:
        """Bring edits of ``groups``' low-precision parameters into their masters in memory; return the groups that
        took one ([Note: edits of low-precision parameters])."""
        if self.manager.param_dtype == torch.float32:
            return []
        return [g for g in groups if self._merge_edits(g)]

    def _merge_edits(self, group: ChunkGroup) -> bool:
        master, edits = group.master, group.param.edits
        edits.new()
        if not edits.edited or master.state not in (ChunkState.HOST, ChunkState.DEVICE):
            return False
        with torch.no_grad():
            self._merge_into(group)
        edits.edited = False
        return True

    def _merge_into(self, group: ChunkGroup) -> None:
        master = group.master
        values, start = group.param, group.shard.start if group.shard is not None else 0
        if group.param_shard is not None:  # ZeRO-3: the edits were kept in the shard
            values, start = group.param_shard, 0
        n, tier, src = group.os_numel, master.primary_tier, values.primary_tier
        low = values.payload(src)[start : start + n]
        with self.quiet() if tier is Tier.HOST else nullcontext():
            if src is not tier:  # counted like any transfer
                moved = torch.empty(n, dtype=low.dtype, device=master.payload(tier).device)
                values.host_copy_pending(self.manager.storage.copy_(moved, low, src=src, dst=tier))
                low = moved
            m = master.payload(tier)[:n]
            m.copy_(torch.where(m.to(low.dtype) == low, m, low.float()))

    def _cast_master(self, master, numel: int, out: torch.Tensor, tier: Tier) -> torch.cuda.Event | None:
        """``out`` (on ``tier``) = the first ``numel`` master elements, cast; an async copy's event."""
        if master.is_on(tier):
            out.copy_(master.payload(tier)[:numel])
            return None
        src = master.tiers[0]  # cast where the master lies, then move the half-size result
        with self.quiet() if src is Tier.HOST else nullcontext():
            low = master.payload(src)[:numel].to(out.dtype)
        return self.manager.storage.copy_(out, low, src=src, dst=tier)
