"""The device measured over each iteration and the budget checked on it: a base class of
:class:`gemini.engine.runtime.GeminiRuntime`, over its memory, ledger, placement and iteration state."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from chunks import MemoryLedger, Tier, missing_bytes
from gemini.engine.iteration_state import IterationState
from gemini.engine.memory import DeviceBudgetError, model_tensors_on
from gemini.engine.warmup import check_peak
from gemini.parallel.zero import agree_on_budget
from gemini.report import WarmupTimeline
from tracer import reset_cuda_peak

__all__ = ["IterationMeasurement"]


class IterationMeasurement:
    """The measurement window and budget checks of :class:`GeminiRuntime` (its base class)."""

    @property
    def window_open(self) -> bool:
        """Whether the device is being measured now (an iteration's window is open)."""
        return self.memory.monitor is not None and self.memory.monitor.running

    def begin_window(self) -> None:
        """Start measuring the device (if not already) for the iteration beginning now."""
        if self.memory.monitor is not None and not self.window_open:
            # Not a closure over the runtime: the memory outlives it in the closer's finalizer.
            model_bytes = functools.partial(_device_model_bytes, self.storage.ledger, self.fixed_bytes)
            tensors = model_tensors_on(self.device, self.module, self.manager) if self.memory.counts_tensors else []
            self.memory.start(tensors, model_bytes)

    def end_window(self) -> None:
        if self.window_open:
            self.memory.monitor.stop()

    def on_budget_error(self) -> None:  # a hook's DeviceBudgetError (also under loss.backward(), past budget_errors)
        if not self._evaluation_window:  # an evaluation's peak says nothing of training's plans
            self.traced_inputs.overran(planned=self.state is IterationState.PLANNED)  # traced again next time
        self._give_up_trace()
        self.end_window()

    def _give_up_trace(self) -> None:
        """The warm-up's forward or backward ran out of the budget: give its trace up, so the next training
        forward traces anew. Left tracing, a retry's forward would be appended to the failed one's periods (a
        plan with more periods than the iteration has), and the post-hooks still running after a hook's error
        would cut their moves on a stopped monitor and raise."""
        if self.tracing:
            self._abandon_trace()

    def take_timeline(self) -> WarmupTimeline | None:  # of a warm-up ended since the last call (the step's report)
        plan, self.unreported_plan = self.unreported_plan, None
        return plan.timeline() if plan is not None else None

    @contextlib.contextmanager
    def budget_errors(self, what: str, *, evaluation: bool = False) -> Iterator[None]:
        """Raise an out-of-memory error inside (``what``: "the forward pass", ...) as the budget's
        ``DeviceBudgetError`` (``DeviceMemory.budget_error``); the plans in force are traced again, unless it was
        an ``evaluation`` (a forward without grad)."""
        try:
            yield
        except (DeviceBudgetError, torch.OutOfMemoryError) as e:
            if not evaluation:  # a larger evaluation batch says nothing of training's plans
                self.traced_inputs.overran(planned=self.state is IterationState.PLANNED)  # traced again next time
            budget = None if isinstance(e, DeviceBudgetError) else self.memory.budget_error(
                e, what=what, chunk_bytes=self.storage.ledger.bytes_on(Tier.DEVICE),
                advice=self.placement.budget_advice)
            self._give_up_trace()
            if budget is None:  # a period the plan cannot hold, or no budget
                raise
            raise budget from e

    def check_step_peak(self) -> None:
        """The budget promise on every step: the measured peak of this iteration's forward and backward stays
        under ``device_memory``, checked before the step changes anything (a tensor the caller keeps alive counts
        too). The warm-up's trace is checked with its safety reserve where it ends (``Warmup.end``); this checks
        what ran after that too (e.g. an R1 penalty's second forward and backward)."""
        peak_bytes = self.step_peak_bytes()
        first = peak_bytes is not None and not self._first_step_checked  # None: no forward ran, nothing to check
        self._first_step_checked |= peak_bytes is not None
        checked = peak_bytes is not None and self.config.device_memory is not None and self.memory.measuring
        try:
            agree_on_budget(self.zero, missing_bytes(self.memory.budget_bytes, peak_bytes) if checked else 0,
                            what="the first iteration" if first else "this iteration", reducer=self.residency.reducer)
            if not checked:
                return
            what = "the first iteration" if first else "this iteration"
            if self.evaluation_peak_bytes >= peak_bytes:  # the peak was an evaluation's, before this step
                what += (" (its peak in a forward without gradients run before its step(): evaluate after step(), "
                         "where under auto such a forward may borrow the margin's room)")
            check_peak(peak_bytes, self.memory.budget_bytes, what=what, advice=self.placement.budget_advice,
                       chunk_peak_bytes=self.storage.ledger.peak_bytes(Tier.DEVICE), later=not first)
        except Exception:  # a rank's budget refused
            self.on_budget_error()
            raise

    def step_peak_bytes(self) -> int | None:
        """The measured peak of the iteration this step ends; None where only evaluation forwards ran since the
        last step (each checked when it ended, [Note: an evaluation forward's window]): no peak to check."""
        return None if self.evaluation_only else self.memory.peak_bytes()

    def start_new_step(self) -> None:
        """Reset the per-step peaks and transfer counters."""
        self.end_window()
        self.storage.ledger.start_step()
        self.traced_inputs.start_step()
        self.memory.reset_peak()
        self.warmup_peak_bytes = self.evaluation_peak_bytes = 0
        self.system.reset_peak()
        if self.device.type == "cuda":
            reset_cuda_peak(self.device)  # see [Note: one device peak, several monitors]


def _device_model_bytes(ledger: MemoryLedger, fixed_bytes: int) -> int:
    return ledger.bytes_on(Tier.DEVICE) + fixed_bytes
