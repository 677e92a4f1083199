"""`StepMoves`: the moves of chunk groups around the optimizer's step, a part of `Residency`
(gemini/engine/residency.py) in a file of its own; ``Residency`` derives from it."""

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
    """The step's side of :class:`gemini.engine.residency.Residency`: gradients and optimizer
    states together before the update, parameters from the masters after it."""

    manager: ChunkManager
    policy: PlacementPolicy
    quiet: Callable[[], AbstractContextManager]

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

        Under ZeRO the masters are this rank's range: with parameter sharding they refresh the
        param shard; without, this rank's range of the param chunk's primary copy (the others
        arrive by ``gemini.parallel.zero.gather_params`` once every group is updated).
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
        """The step has landed (every group updated): parameters the policy keeps on the device
        that the step left on the host (fp32 groups updated there drop their stale device copy)
        come back. Must not raise (see [Note: a step is all or nothing] in
        gemini/engine/transaction.py)."""
        if group.index in self.policy.resident_params() and group.param.state is ChunkState.HOST:
            try:
                group.param.fetch(keep_host=True)
            except (torch.OutOfMemoryError, DeviceBudgetError) as e:
                # The step has landed: raising would invite a retry that steps twice. The
                # next forward fetches the parameters (or says what is missing).
                logger.warning("parameters of chunk group %d stay in host memory after the step: %s", group.index, e)

    def _cast_master(self, master, numel: int, out: torch.Tensor, tier: Tier) -> torch.cuda.Event | None:
        """``out`` (on ``tier``) = the first ``numel`` master elements, cast; an async copy's event."""
        if master.is_on(tier):
            out.copy_(master.payload(tier)[:numel])
            return None
        src = master.tiers[0]  # cast where the master lies, then move the half-size result
        with self.quiet() if src is Tier.HOST else nullcontext():
            low = master.payload(src)[:numel].to(out.dtype)
        return self.manager.storage.copy_(out, low, src=src, dst=tier)
