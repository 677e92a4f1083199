"""`GeminiRuntime`: the state shared by the wrapped module and the optimizer (its measurement window and
budget checks: gemini/engine/measurement.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from chunks import ChunkGroup, ChunkManager, ChunkStorage
from gemini.engine.activations import ActivationOffload
from gemini.engine.evaluation_room import EvaluationRoom
from gemini.parallel.collectives import Collectives
from gemini.config import GeminiConfig
from gemini.engine.grad_views import GradViews, why_no_grad_views
from gemini.engine.hooks import ModuleHooks
from gemini.engine.measurement import IterationMeasurement
from gemini.engine.memory import DeviceBudgetError, DeviceMemory
from gemini.engine.nvme_tier import NvmeTier
from gemini.engine.residency import Residency
from gemini.policies import PlacementPolicy
from gemini.policies.plan import MemoryPlan
from gemini.engine.step_report import StepOutcome, step_report
from gemini.report import MemoryReport, ReportWriter
from gemini.engine.system_memory import SystemMemory
from gemini.engine.warmup import Warmup, peak_error
from gemini.parallel.zero import agree_on_budget, agree_on_trace, gather_params
from gemini.engine.iteration_state import IterationState
from tracer import Boundary, InputSignature, TracedInputs, input_signature

logger = logging.getLogger(__name__)

__all__ = ["GeminiRuntime", "IterationState"]

class LossScale(Protocol):  # what the engine reads of fp16's loss scaling (gemini/optim/loss_scaler.py)
    scale: float
    def refuse_unscaled(self, cleared_at_pass: int) -> None: ...


@dataclass(eq=False)
class GeminiRuntime(IterationMeasurement):
    config: GeminiConfig
    device: torch.device
    storage: ChunkStorage
    manager: ChunkManager
    placement: PlacementPolicy  # decides
    residency: Residency  # moves, as the placement decides
    memory: DeviceMemory
    module: torch.nn.Module
    module_params: tuple[torch.nn.Parameter, ...]  # the module's parameters, in its order
    fixed_bytes: int  # buffers on the device
    nvme: NvmeTier | None = None
    zero: Collectives | None = None  # the data-parallel group ZeRO shards across (None: one rank)
    hooks: ModuleHooks | None = None
    activations: ActivationOffload | None = None  # GeminiConfig.offload_activations
    grad_views: GradViews | None = None  # p.grad between backward and the next pass; made in __post_init__
    scaler: LossScale | None = None  # fp16: the optimizer's ScaledBackwards (gemini.optim.loss_scaler)
    report_writer: ReportWriter | None = None
    warmup: Warmup | None = None
    plan: MemoryPlan | None = None
    system: SystemMemory = field(default=None)  # host and whole-GPU readings; made in __post_init__ if not given
    unreported_plan: MemoryPlan | None = field(default=None, repr=False)  # made during this step
    _first_step_checked: bool = False
    # The tracer resets the monitor's peak at each cut: the warm-up step's peak is the trace's largest period peak,
    # carried here into that step's report.
    warmup_peak_bytes: int = 0
    traced_inputs: TracedInputs = field(default_factory=TracedInputs)  # the plan's, and which it covers
    _backward_passes_at_trace: int = 0
    grads_cleared_at_pass: int = 0  # the hooks' backward-pass count at the last zero_grad
    forwards_raised: int = 0  # training forwards that raised: see [Note: ranks out of step] in gemini/parallel/zero.py
    _evaluation_window: bool = False  # this forward opened the window without grad (see on_root_forward_end)
    evaluation_only: bool = False  # the last window opened was an evaluation's (see step_peak_bytes)
    evaluation_peak_bytes: int = 0  # the window's peak where an evaluation forward inside it raised it
    _peak_before_forward: int = 0
    _root_grad: bool = True  # the running root forward's grad mode (True outside one)
    evaluation_room: EvaluationRoom = field(default_factory=EvaluationRoom)  # what evaluations borrow of auto's margin
    _evaluation_inputs: InputSignature | None = None  # this evaluation forward's, while the margin may be lent
    state: IterationState = IterationState.FIXED  # UNTRACED under auto (set in __post_init__)

    def __post_init__(self) -> None:
        if self.placement.plans_from_measurement:  # its first iteration is traced to plan
            self.state = IterationState.UNTRACED
        if self.system is None:
            self.system = SystemMemory(self.device)
        # Position of each parameter in the module (norms visit them in this order).
        self.param_order = {id(p): i for i, p in enumerate(self.module_params)}
        if self.grad_views is None:
            self.grad_views = GradViews(self.manager, unavailable_reason=why_no_grad_views(
                zero_world=self.zero.world if self.zero is not None else None, precision=self.config.precision))

    # ------------------------------------------------------------------------ gradients
    def zero_grad(self, *, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients (``set_to_none=False``: keep them as zeros, as torch does)."""
        self._end_aborted_backward()
        self.grads_cleared_at_pass = self.hooks.backward_passes
        self.grad_views.clear(self.module_params, set_to_none=set_to_none)

    def settle_grad_views(self) -> None:
        """Before a step: what torch code did to ``p.grad`` counts ([Note: a step that moves no chunk])."""
        self._end_aborted_backward()
        if self.placement.follows_modules or self.zero is not None:
            self.grad_views.hide()
        else:
            self.grad_views.settle()
        self.grad_views.adopt_assigned(self.residency.grad_buffer)

    # -------------------------------------------------------------------- iteration events
    def on_root_forward(self, args: tuple, kwargs: dict) -> None:  # the root's forward begins (its first pre-hook)
        self._end_aborted_backward()
        self.manager.adopt_assigned()  # see [Note: parameters whose .data was assigned] in chunks/manager.py
        self.grad_views.hide()
        self._root_grad = torch.is_grad_enabled()
        self._evaluation_window = not self._root_grad and not self.window_open
        self._lend_margin(args, kwargs)  # before the window opens: the lent bytes are no part of its peak
        if not self.window_open:
            self.evaluation_only = self._evaluation_window
        self.begin_window()
        if not self._root_grad and not self._evaluation_window:  # an evaluation inside an iteration (check_step_peak)
            self._peak_before_forward = self.memory.peak_bytes() or 0
        if self.state is IterationState.ADOPTING:
            self._apply_plan()
        state = self.state
        if state is IterationState.UNTRACED and torch.is_grad_enabled():  # training, not an evaluation before it
            self._begin_warmup(args, kwargs)
        elif (state is IterationState.TRACING and self._root_grad
              and self.hooks.backward_passes > self._backward_passes_at_trace):
            # Gradient accumulation: the first forward + backward is the traced iteration (an evaluation, no more).
            self.finish_warmup(step_follows=False)
            self._choose_plan(args, kwargs)
        elif state in (IterationState.PLANNED, IterationState.UNPLANNED) and torch.is_grad_enabled():
            self._choose_plan(args, kwargs)
        self.residency.begin_forward()
        if self.activations is not None:
            self.activations.begin_forward()

    def on_root_forward_end(self) -> DeviceBudgetError | None:
        """The root module's forward is over (also when it raised: always_call hooks run inside torch's ``except``,
        where ``sys.exc_info()`` is the forward's error). Returns an evaluation forward's budget error, for the
        hooks to raise once their state is consistent."""
        if torch.is_grad_enabled() and sys.exc_info()[1] is not None:
            self.forwards_raised += 1
        if self.activations is not None:
            self.activations.end_forward()
        # [Note: an evaluation forward's window] A forward without grad between steps (a validation pass, each
        # forward of generate()) is no part of the next training iteration: the window it opened closes with it
        # (left open, what the loop allocates after it would be charged to the next iteration), and its peak is
        # checked against the budget as a step's is (on CUDA the allocator's cap enforces it too; on the CPU
        # stand-in only this check does). A step with no forward after it has no peak of its own to check
        # (``step_peak_bytes``).
        error = None
        if self._evaluation_window and not self.tracing:
            if self.config.device_memory is not None and self.memory.measuring:
                error = peak_error(self.memory.peak_bytes() or 0, self.memory.budget_bytes, what="this evaluation "
                                   "forward (without gradients)", advice="use a smaller evaluation batch or sequence")
            if self._evaluation_inputs is not None:  # see [Note: an evaluation beside the margin]
                overran = error is not None or isinstance(sys.exc_info()[1], (DeviceBudgetError, torch.OutOfMemoryError))
                if self.placement.lent or overran:
                    self.evaluation_room.measured(self._evaluation_inputs, None if overran and not self.placement.lent
                                                  else self.memory.peak_bytes() or 0)
            self.end_window()
        elif not self._root_grad and self.window_open and not self.tracing:  # one inside an iteration
            if (peak := self.memory.peak_bytes() or 0) > self._peak_before_forward:
                self.evaluation_peak_bytes = peak  # see check_step_peak
        self._evaluation_inputs = None
        self._evaluation_window, self._root_grad = False, True
        return error

    def _lend_margin(self, args: tuple, kwargs: dict) -> None:
        """An evaluation forward between steps may borrow the room of auto's margin; the next training forward gives
        it back ([Note: an evaluation beside the margin] in gemini/engine/evaluation_room.py)."""
        placement = self.placement
        if not placement.has_margin or (self.config.device_memory is None and self.device.type != "cuda"):
            return
        if self._root_grad:
            self.return_margin()
        elif self._evaluation_window and self.state is IterationState.PLANNED and self.nvme is None and self.zero is None:
            self._evaluation_inputs = input_signature(args, kwargs)
            margin_bytes = sum(placement.group_device_bytes(self.manager.groups[i]) for i in placement.os_on_device)
            if margin_bytes and self.evaluation_room.borrows(self._evaluation_inputs, traced=self.traced_inputs.signature,
                                                             margin_bytes=margin_bytes,
                                                             budget_bytes=self.memory.budget_bytes):
                logger.info("auto placement: an evaluation forward on new inputs borrows the margin's %d bytes",
                            margin_bytes)
                self._move_margin(lend=True)

    def return_margin(self) -> None:
        """The margin's groups back on the device after an evaluation borrowed their room."""
        if self.placement.has_margin and self.placement.lent:
            self._move_margin(lend=False)

    def _move_margin(self, *, lend: bool) -> None:
        self.placement.lend_margin(lend)
        self.residency.apply_choice()
        self.hooks.follow_modules(self.placement.follows_modules)

    def on_backward_begin(self, *, keep_data: bool = False) -> None:
        """A backward pass begins: the views are withdrawn, or armed ([Note: autograd accumulates into the chunks]);
        ``keep_data``: it began at a parameter's gradient, inside a graph that read ``p.data`` as it is now."""
        if self.placement.follows_modules or torch.is_grad_enabled():
            self.grad_views.hide(keep_data=keep_data)
        else:
            self.grad_views.arm(self.residency.grad_buffer)

    def on_backward_end(self) -> None:  # a backward pass is over: gradients are in their chunks
        if self.activations is not None:
            self.activations.end_backward()
        self.grad_views.expose()

    def on_boundary(self, boundary: Boundary) -> None:
        """A period begins (the hooks announce boundaries while ``follow_periods(True)``): the warm-up's tracer
        measures it (not an evaluation's forward after the traced backward), or the policy counts it."""
        if self.tracing:
            if self._root_grad or self.hooks.backward_passes == self._backward_passes_at_trace:
                self.warmup.tracer.on_boundary(boundary)
        elif self.placement.track_periods:
            self.residency.on_boundary(boundary)

    def _end_aborted_backward(self) -> None:
        """A backward that raised ends here ([Note: a backward pass that raised]); in the warm-up its trace is given
        up (a budget error stopped its monitor): the next one traces anew."""
        if self.hooks.backward_aborted and self.tracing:
            self._abandon_trace()
        self.hooks.end_aborted_backward()

    def _abandon_trace(self) -> None:
        """The traced iteration is given up: the next training forward traces anew."""
        self.warmup.abandon()
        self.placement.end_trace()
        self.end_window()
        self._move(IterationState.UNTRACED, IterationState.TRACING)

    def _move(self, to: IterationState, *allowed: IterationState) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"the engine is {self.state}, expected one of {[s.name for s in allowed]} to move to {to}")
        self.state = to

    def _begin_warmup(self, args: tuple, kwargs: dict) -> None:
        self._move(IterationState.TRACING, IterationState.UNTRACED, IterationState.PLANNED, IterationState.UNPLANNED)
        self.traced_inputs.trace(args, kwargs)
        self._backward_passes_at_trace = self.hooks.backward_passes
        self.hooks.take_late_reads()  # those of this trace count (see finish_warmup)
        self.warmup = Warmup(self.module, self.storage, self.memory, self.fixed_bytes,
                             prefetch_bytes=self.placement.prefetch_reserve_bytes)
        self.placement.begin_trace(self.warmup.tracer)
        self.hooks.follow_periods(True)
        self.warmup.begin()

    def finish_warmup(self, *, step_follows: bool = True) -> None:
        """End the warm-up trace; the auto policy adopts the plan (may raise DeviceBudgetError)."""
        self._move(IterationState.UNPLANNED, IterationState.TRACING)  # PLANNED once the plan is adopted
        self.placement.end_trace()
        try:
            agree = functools.partial(agree_on_budget, self.zero, reducer=self.residency.reducer)
            plan = self.warmup.end(agree=agree)
        except Exception:
            self.end_window()
            self.hooks.follow_periods(False)  # UNPLANNED: no period to trace or count
            raise
        self.warmup_peak_bytes = plan.warmup_peak_bytes  # this step's report's peak, planned or not
        if self.hooks.take_late_reads():  # see DescendantReadHooks.take_late_reads
            logger.info("auto placement: the warm-up found parameters read outside their modules; tracing again")
            self.hooks.follow_periods(False)  # UNPLANNED: the next training forward traces again
            self.traced_inputs.retrace()
            return
        if self.activations is not None:
            plan = self.activations.with_trace(plan)
        plan = self.placement.with_trace(plan)
        self.unreported_plan = plan
        self.traced_inputs.keep(plan)
        self._adopt(plan, step_follows=step_follows)

    def _choose_plan(self, args: tuple, kwargs: dict) -> None:
        """A training forward's inputs keep the plan, bring back a kept one or are traced: see
        [Note: plans kept per input signature] in tracer/signature.py."""
        choice = self.traced_inputs.choose(args, kwargs, planned=self.state is IterationState.PLANNED)
        if agree_on_trace(self.zero, choice.trace):
            logger.info("auto placement: inputs no plan covers (here or on another rank); tracing again")
            self._retrace(args, kwargs)
        elif choice.plan is not None:
            logger.info("auto placement: inputs a plan kept from an earlier trace covers; it is in force again")
            self._adopt(choice.plan, step_follows=False)

    def _adopt(self, plan: MemoryPlan, *, step_follows: bool) -> None:
        self.plan = plan
        activation_bytes = (0 if self.activations is None
                            else self.activations.plan(plan, self.placement.activation_room_bytes(plan)))
        self.placement.adopt(plan, activation_bytes=activation_bytes)
        self._move(IterationState.ADOPTING, IterationState.UNPLANNED, IterationState.PLANNED)
        self._apply_plan(step_follows=step_follows)

    def _apply_plan(self, *, step_follows: bool = False) -> None:
        """ADOPTING -> PLANNED: move groups where the plan wants them; a failed move (an NVMe read error) stays
        ADOPTING, each group whole: the next step or forward tries again."""
        self.residency.apply_choice(step_follows=step_follows)
        self.residency.rebalance_nvme()
        self.hooks.follow_modules(self.placement.follows_modules)
        self.hooks.follow_periods(self.placement.track_periods)
        self._move(IterationState.PLANNED, IterationState.ADOPTING)

    def _retrace(self, args: tuple, kwargs: dict) -> None:
        """Inputs the plan does not cover: drop it, warm up again (conservatively), plan anew at the step."""
        self.placement.abandon_plan()
        self.residency.apply_choice(drop_unkept=True)
        self.residency.rebalance_nvme()
        self.hooks.follow_modules(self.placement.follows_modules)
        if self.activations is not None:
            self.activations.forget_plan()
        self.plan = None
        self._begin_warmup(args, kwargs)

    tracing = property(lambda self: self.state is IterationState.TRACING)

    # ------------------------------------------------------------------------------ NVMe
    def resident(self, group, *, modify: bool, chunks=None, overwrite: bool = False):
        """``group``'s NVMe states (or ``chunks``) in host memory: :meth:`NvmeTier.resident`."""
        if self.nvme is None:
            return contextlib.nullcontext()
        return self.nvme.resident(group, modify=modify, chunks=chunks, overwrite=overwrite)

    def closer(self) -> weakref.finalize:
        """Closes the engine (NVMe files, I/O threads, allocator cap) when called or when the runtime goes."""
        return weakref.finalize(self, _close, self.activations, self.nvme, self.system, self.memory)

    # ------------------------------------------------------------------ the optimizer's step
    def begin_step(self) -> None:
        """The optimizer's step begins, before it changes any value: under auto the first step ends the warm-up
        (may raise DeviceBudgetError), then the iteration's peak is checked."""
        self.residency.release_held()  # see [Note: parameters a create_graph pass saved]
        self.return_margin()  # a step after an evaluation, with no forward between
        if self.tracing:
            if self.hooks.backward_passes == self._backward_passes_at_trace:
                # A forward whose backward was skipped (a NaN guard): torch's step is a no-op, and the trace, with no
                # backward, plans nothing.
                logger.info("auto placement: step() with no backward pass since the traced forward; tracing again")
                self._abandon_trace()
            else:
                self.finish_warmup()
        elif self.state is IterationState.ADOPTING:  # the step that adopted the plan failed moving groups
            self._apply_plan(step_follows=True)
        self.check_step_peak()

    def after_commit(self, groups: Sequence[ChunkGroup], *, skipped: bool) -> None:
        """What follows a landed step over ``groups`` and changes no value: other ranks' updated ranges arrive,
        placements the step changed are restored."""
        if not skipped:
            self.gather_updated_params(groups)
            for g in groups:
                self.residency.after_commit(g)
            # Written in their chunks, not through them: a graph kept from before the step (backward with
            # retain_graph, then again after it) is refused as torch refuses it, not run on new weights.
            for g in groups:
                updated = [p for p, ready in zip(g.params, g.grad_ready) if ready]
                torch.autograd.graph.increment_version(updated)
                g.param.edits.bumped(len(updated))  # see [Note: writes through the parameters] in chunks/edits.py
        if self.residency.gatherer is not None:
            self.residency.gatherer.end_iteration()

    def gather_updated_params(self, groups: Sequence[ChunkGroup]) -> None:
        """ZeRO-1/2: every rank's updated range of ``groups``' parameters (ZeRO-3 gathers on use)."""
        if self.zero is not None and self.residency.gatherer is None:
            gather_params(self.zero, groups, self.storage)

    def step_report(self, outcome: StepOutcome, *, step: int, started: float) -> MemoryReport:
        """The report of a landed step begun at ``started`` (``time.perf_counter()``)."""
        return step_report(self, outcome, step=step, step_seconds=time.perf_counter() - started)

    def end_step(self, report: MemoryReport) -> None:
        """The step is over: its report is written and the per-step counters start again."""
        if self.report_writer is not None:
            try:
                self.report_writer.write(report)
            except OSError as e:  # the step has landed: raising would invite a retry that steps twice
                logger.error("step %d landed, but its report could not be written: %s", report.step, e)
        self.start_new_step()


def _close(*parts) -> None:
    for part in filter(None, parts):  # the activations and the NVMe tier may be None
        part.close()

