"""The warm-up iteration: runs the tracer around the first forward and backward pass."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from torch import nn

from chunks import ChunkStorage, Tier, missing_bytes
from gemini.engine.memory import DeviceBudgetError, DeviceMemory
from gemini.policies.auto import AutoPlacement
from gemini.policies.plan import MemoryPlan
from tracer import RuntimeTracer
from offload.profiling import trace_range

logger = logging.getLogger(__name__)

__all__ = ["Warmup"]


class Warmup:
    """Owns the tracer of the warm-up iteration and turns its records into a :class:`MemoryPlan`.

    The trace begins at :meth:`begin` (in the root module's first forward pre-hook, before the root's boundary)
    and ends at the first of: the root's next forward after a backward (gradient accumulation), or
    ``optimizer.step()``. The engine's hooks deliver each period boundary to the tracer (``runtime.on_boundary``),
    and the storage announces every chunk move to it (``ChunkStorage.swap_move_watcher``), so model data is
    subtracted exactly where it changed.
    """

    # [Note: the warm-up plans the prefetch]
    # Under ZeRO-3 every iteration after the warm-up gathers the next group of the recorded order ahead of its use
    # (gemini/parallel/zero.py's ParamGatherer); the warm-up records that order and gathers nothing ahead, so each
    # of its decisions holds one group less than the same decision will later. Whether a rank gathers ahead cannot
    # depend on its own memory (the gathers are collectives: [Note: the order of collectives]), so the plan charges
    # every later decision room for the largest group's parameters (``prefetch_bytes``, in
    # ``MemoryPlan.planned_peak_bytes``): a budget that cannot hold them fails here, at the first step, not at the
    # second step's backward, and the margin is what is left beside them.
    def __init__(self, module: nn.Module, storage: ChunkStorage, memory: DeviceMemory, fixed_bytes: int, *,
                 prefetch_bytes: int = 0) -> None:
        if memory.monitor is None:
            raise RuntimeError("warm-up tracing needs a device memory monitor")
        self.storage = storage
        self.memory = memory
        self.fixed_bytes = fixed_bytes
        self.prefetch_bytes = prefetch_bytes  # see [Note: the warm-up plans the prefetch]
        self.tracer = RuntimeTracer(
            module,
            memory.monitor,
            model_bytes_fn=lambda: storage.ledger.bytes_on(Tier.DEVICE) + fixed_bytes,
            track_module_tensors=False,
        )
        self._trace: contextlib.AbstractContextManager | None = None  # the tracer's trace() while tracing
        self._outer_watcher = None  # the storage's move watcher before the trace took it

    @property
    def tracing(self) -> bool:
        return self._trace is not None

    def begin(self) -> None:
        assert self._trace is None, "warm-up already tracing"
        self.memory.restart_slack()
        self._trace = self.tracer.trace(own_hooks=False)  # the engine's hooks announce boundaries
        self._trace.__enter__()
        self._outer_watcher = self.storage.swap_move_watcher(self.tracer.model_data_move)
        self.storage.ledger.reset_peaks(Tier.DEVICE)
        logger.info("warm-up: tracing the first iteration")

    def abandon(self) -> None:
        """Stop tracing without a plan: the traced iteration raised (its records are dropped)."""
        if self._trace is not None:
            trace, self._trace = self._trace, None
            self.storage.swap_move_watcher(self._outer_watcher)
            trace.__exit__(RuntimeError, RuntimeError("the traced iteration raised"), None)

    def end(self, *, agree: Callable[..., None] = lambda missing_bytes, *, what: None) -> MemoryPlan:
        """Stop tracing and build the plan; raises DeviceBudgetError if warm-up overran the budget (``agree``: on
        every rank of a ZeRO group when one did, see [Note: ranks agree on the budget] in gemini/parallel/zero.py)."""
        assert self._trace is not None, "warm-up is not tracing"
        trace, self._trace = self._trace, None
        self.storage.swap_move_watcher(self._outer_watcher)
        with trace_range("gemini::plan"):
            trace.__exit__(None, None, None)
            periods = self.tracer.periods
            warmup_peak = max(p.peak_bytes for p in periods)
            plan = MemoryPlan.from_trace(
                periods,
                warmup_peak_bytes=warmup_peak,
                warmup_model_peak_bytes=self.storage.ledger.peak_bytes(Tier.DEVICE),
                fixed_bytes=self.fixed_bytes,
                reserve_bytes=self.memory.reserve_bytes(max(p.non_model_peak_bytes for p in periods), warmup_peak),
                budget_bytes=self.memory.budget_bytes,
                prefetch_bytes=self.prefetch_bytes,
            )
        logger.info(
            "warm-up: %d periods, peak %d bytes (chunks %d, max non-model %d, reserve %d) of a %d-byte budget; margin %d",
            len(plan.keys), plan.warmup_peak_bytes, plan.warmup_model_peak_bytes, plan.max_non_model_bytes,
            plan.reserve_bytes, plan.budget_bytes, plan.margin_bytes,
        )
        # Later iterations keep the reserve free on top of what the warm-up's schedule needs at each of its decisions
        # (they can always fall back to that schedule: see MemoryPlan.planned_peak_bytes), so check both here.
        prefetch = (f" and room for the {plan.prefetch_bytes} bytes of parameters ZeRO-3 gathers ahead of their use "
                    f"from the next iteration on" if plan.prefetch_bytes else "")
        what = f"the warm-up iteration (with the {plan.reserve_bytes}-byte safety reserve{prefetch})"
        need = plan.planned_peak_bytes + plan.reserve_bytes
        agree(missing_bytes(self.memory.budget_bytes, need), what=what)
        check_peak(need, self.memory.budget_bytes,
                   advice=AutoPlacement.budget_advice, what=what, chunk_peak_bytes=plan.warmup_model_peak_bytes)
        return plan


def check_peak(peak_bytes: int, budget_bytes: int, *, what: str, advice: str,
               chunk_peak_bytes: int | None = None, later: bool = False) -> None:
    """Raise DeviceBudgetError when a measured peak went over the budget, with ``advice`` that fits the placement
    in force (``PlacementPolicy.budget_advice``: a user already on 'auto' is not told to use 'auto'); ``later``:
    an iteration after the first, where what the loop keeps from earlier ones may be the cause."""
    error = peak_error(peak_bytes, budget_bytes, what=what, advice=advice, chunk_peak_bytes=chunk_peak_bytes,
                       later=later)
    if error is not None:
        raise error


def peak_error(peak_bytes: int, budget_bytes: int, *, what: str, advice: str,
               chunk_peak_bytes: int | None = None, later: bool = False) -> DeviceBudgetError | None:
    """:func:`check_peak`'s error, returned (to be raised once the caller's state is consistent). Not raised and
    caught here: a caught error's traceback holds the callers' frames, whose locals (the error itself, a forward's
    inputs) would stay alive in a cycle until the garbage collector ran."""
    missing = missing_bytes(budget_bytes, peak_bytes)
    if not missing:
        return None
    split = ""
    if chunk_peak_bytes is not None:
        split = (f" (chunks at most {chunk_peak_bytes} bytes; the rest is activations, workspaces and "
                 f"buffers)")
    return DeviceBudgetError(
        f"{what} needed {peak_bytes} bytes of device memory at its peak{split} but GeminiConfig.device_memory is "
        f"{budget_bytes}: {missing} bytes are missing. Nothing was updated. Raise device_memory, or {advice}."
        + (" A tensor the loop keeps from earlier iterations counts too (outputs kept in a list, a loss kept "
           "before its backward: keep loss.item() or outputs.detach().cpu())." if later else ""),
        missing_bytes=missing,
    )
