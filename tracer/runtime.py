"""The runtime tracer: what one warm-up iteration teaches about memory and chunk order.

Between consecutive period boundaries (see :mod:`tracer.hooks`) the tracer measures the
device's peak with a :class:`~tracer.monitors.MemoryMonitor`, subtracts the model data the
engine reports as resident on the device, and keeps the rest as the period's non-model peak
(activations, temporaries, workspaces). It also records which chunks each period used, in
order: the access order that Belady eviction and prefetching plan with.

How the engine drives it::

    tracer = RuntimeTracer(model, make_monitor(device),
                           model_bytes_fn=device_chunk_bytes,   # () -> int, engine-side
                           chunks_of=chunk_ids_of_module)       # (module) -> [int], optional
    with tracer.trace():                      # warm-up iteration
        loss = loss_fn(model(x), y)
        loss.backward()
    tracer.max_non_model_peak_bytes           # plan the margin
    tracer.non_model_peak_for(p)              # room period p needs besides chunks
    AccessOrder(tracer.access_order)          # plan eviction and prefetch
    if tracer.needs_retrace((x,), {}):        # a new batch shape: trace again
        ...

Inside ``trace()`` the engine wraps every move of chunk data onto or off the device in
``with tracer.model_data_move(): ...`` and may call ``tracer.record_access(chunk_id)``
when it makes a chunk resident for a module.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tracer.hooks import Boundary, PeriodHooks, in_autograd_engine
from tracer.monitors import MemoryMonitor
from tracer.period import PeriodMeter, PeriodRecord
from tracer.signature import InputSignature, input_signature
from offload.profiling import trace_range

logger = logging.getLogger(__name__)

__all__ = ["PeriodRecord", "RuntimeTracer", "TracerState"]  # PeriodRecord: from tracer.period


class TracerState(enum.Enum):
    IDLE = "idle"  # no trace yet, or the last one failed
    TRACING = "tracing"
    TRACED = "traced"


class RuntimeTracer:
    """Measures per-period non-model peaks and the chunk access order of one iteration.

    Args:
        module: the model; every submodule gets period hooks while tracing.
        monitor: measures the device; started and stopped by ``trace()`` unless already
            running (then it is left running, but its peak is reset at every boundary).
        model_bytes_fn: bytes of model data (chunks) resident on the device right now.
        chunks_of: optional; the chunk ids a module uses, recorded at each of its periods.
        track_module_tensors: hand the module's parameters, buffers and existing gradients
            to ``monitor.track`` at the start, so that a monitor that cannot see
            allocations made before it started (the accounting monitor) counts them.
    """

    def __init__(
        self,
        module: nn.Module,
        monitor: MemoryMonitor,
        *,
        model_bytes_fn: Callable[[], int],
        chunks_of: Callable[[nn.Module], Iterable[int]] | None = None,
        track_module_tensors: bool = True,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(monitor, MemoryMonitor):
            raise TypeError(f"monitor must be a MemoryMonitor, got {type(monitor).__name__} {monitor!r}")
        if not callable(model_bytes_fn):
            raise TypeError(f"model_bytes_fn must be callable, got {type(model_bytes_fn).__name__} {model_bytes_fn!r}")
        if chunks_of is not None and not callable(chunks_of):
            raise TypeError(f"chunks_of must be callable or None, got {type(chunks_of).__name__} {chunks_of!r}")
        self._module = module
        self._monitor = monitor
        self._model_bytes_fn = model_bytes_fn
        self._chunks_of = chunks_of
        self._track_module_tensors = bool(track_module_tensors)
        # Backward hooks run on the autograd engine's thread (a device thread on CUDA).
        self._lock = threading.RLock()
        self._state = TracerState.IDLE
        self._records: list[PeriodRecord] = []
        self._meter: PeriodMeter | None = None
        self._move_depth = 0
        self._signature: InputSignature | None = None
        self._clamped_periods = 0

    # ---- results -------------------------------------------------------------------

    @property
    def state(self) -> TracerState:
        return self._state

    @property
    def is_tracing(self) -> bool:
        return self._state is TracerState.TRACING

    @property
    def monitor(self) -> MemoryMonitor:
        return self._monitor

    @property
    def periods(self) -> tuple[PeriodRecord, ...]:
        return tuple(self._records)

    @property
    def access_order(self) -> list[list[int]]:
        """Chunk ids used per period, in period order (and first-access order within one)."""
        return [list(p.chunk_ids) for p in self._records]

    @property
    def input_signature(self) -> InputSignature | None:
        """Signature of the module's first call in the last trace."""
        return self._signature

    @property
    def max_non_model_peak_bytes(self) -> int:
        """The largest non-model peak of any period of the last trace."""
        self._require_traced("max_non_model_peak_bytes")
        return max(p.non_model_peak_bytes for p in self._records)

    def non_model_peak_for(self, period: int) -> int:
        """The non-model peak of period ``period`` (an index into ``periods``)."""
        self._require_traced("non_model_peak_for")
        if not isinstance(period, int) or isinstance(period, bool):
            raise TypeError(f"period must be an int, got {type(period).__name__} {period!r}")
        if not 0 <= period < len(self._records):
            raise ValueError(f"period={period} is out of range: the trace has {len(self._records)} periods")
        return self._records[period].non_model_peak_bytes

    def needs_retrace(self, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> bool:
        """Whether a call with these arguments is not covered by the last trace."""
        if self._state is not TracerState.TRACED or self._signature is None:
            return True
        return input_signature(args, kwargs) != self._signature

    def reset(self) -> None:
        """Forget the last trace."""
        if self._state is TracerState.TRACING:
            raise RuntimeError("reset() inside trace()")
        self._clear()

    # ---- tracing -------------------------------------------------------------------

    @contextlib.contextmanager
    def trace(self, *, own_hooks: bool = True) -> Iterator[RuntimeTracer]:
        """Trace the forward and backward run inside this block; replaces any earlier trace.

        ``own_hooks=False``: install no period hooks; the caller's own (one set of module hooks
        on the model, as the engine's) delivers every boundary to :meth:`on_boundary`.
        """
        if self._state is TracerState.TRACING:
            raise RuntimeError("trace() is already running")
        self._clear()
        hooks = PeriodHooks(self._module, self.on_boundary) if own_hooks else None
        signature_handle = None
        started_monitor = False
        finished = False
        with trace_range("gemini::trace"):
            try:
                if self._track_module_tensors:
                    self._monitor.track(self._module_tensors())
                if not self._monitor.running:
                    self._monitor.start()
                    started_monitor = True
                self._meter = PeriodMeter(model_bytes_at_start=self._model_bytes())
                self._monitor.reset_peak()
                signature_handle = self._module.register_forward_pre_hook(
                    self._capture_signature, with_kwargs=True, prepend=True
                )
                if hooks is not None:
                    hooks.install()
                self._state = TracerState.TRACING
                yield self
                self._finish()
                finished = True
            finally:
                if hooks is not None:
                    hooks.remove()
                if signature_handle is not None:
                    signature_handle.remove()
                if started_monitor:
                    self._monitor.stop()
                if not finished:
                    self._clear()

    def record_access(self, chunk_id: int) -> None:
        """Note that the current period uses ``chunk_id``. Does nothing outside ``trace()``."""
        if self._state is not TracerState.TRACING:
            return
        if not isinstance(chunk_id, int) or isinstance(chunk_id, bool):
            raise TypeError(f"chunk_id must be an int, got {type(chunk_id).__name__} {chunk_id!r}")
        with self._lock:
            assert self._meter is not None, "tracing without a period meter"
            self._meter.add_chunk(chunk_id)

    @contextlib.contextmanager
    def model_data_move(self) -> Iterator[None]:
        """Wrap a move of model data onto or off the device; see [Note: subtracting model data].

        Does nothing outside ``trace()``; nested moves count as one.
        """
        if self._state is not TracerState.TRACING:
            yield
            return
        with self._lock:
            if self._move_depth == 0:
                self._cut_interval(moving=False)
            self._move_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._move_depth -= 1
                if self._move_depth == 0 and self._state is TracerState.TRACING:
                    self._cut_interval(moving=True)

    # [Note: segments of a period]
    # A period's non-model peak is what its chunks must coexist with when they are fetched at
    # its start. But inside a period the engine also releases chunks (a module's backward is
    # done) and allocates gradient chunks, and activations are freed and made in between: a
    # peak after a release need not coexist with the released chunks, and a gradient chunk
    # allocated late need not coexist with a peak before it. Charging every decision the whole
    # period's peak refused steady-state schedules that the warm-up itself had just run. So the
    # engine calls ``mark()`` at each such point, in the warm-up and later alike (the same
    # hooks fire in the same order), and each segment between marks records its own peak, the
    # live bytes at its mark included: a decision at mark k is charged segment k's peak, and
    # the next mark looks again.
    def mark(self) -> None:
        """A decision point inside the current period: a new segment begins here. Does nothing
        outside ``trace()``."""
        if self._state is not TracerState.TRACING:
            return
        with self._lock:
            assert self._meter is not None, "tracing without a period meter"
            assert self._move_depth == 0, "mark() inside a model data move"
            self._cut_interval(moving=False)
            self._meter.new_segment()

    # ---- internals -----------------------------------------------------------------

    def on_boundary(self, boundary: Boundary) -> None:
        """A new period begins (called by the tracer's own hooks, or by the caller's with
        ``trace(own_hooks=False)``)."""
        if self._state is not TracerState.TRACING:
            return  # a retained graph's hook firing after the trace ended
        with self._lock, trace_range("gemini::trace::period"):
            assert self._meter is not None, "tracing without a period meter"
            if self._meter.boundary is not None:
                self._close_period()
            assert self._meter.boundary is None, "a new period already has a boundary"
            self._meter.boundary = boundary
            if self._chunks_of is not None:
                for cid in self._chunks_of(boundary.module):
                    self._meter.add_chunk(cid)

    def _cut_interval(self, *, moving: bool) -> int:
        """Close the current interval of the current period; returns the model bytes now."""
        assert self._meter is not None, "tracing without a period meter"
        peak_bytes = self._monitor.peak_bytes()
        model_bytes = self._model_bytes()
        self._meter.close_interval(peak_bytes=peak_bytes, model_bytes_now=model_bytes, moving=moving)
        self._monitor.reset_peak()
        return model_bytes

    def _close_period(self) -> None:
        model_bytes = self._cut_interval(moving=False)
        self._records.append(self._record_of(self._meter))
        self._meter = PeriodMeter(model_bytes_at_start=model_bytes)

    def _record_of(self, meter: PeriodMeter) -> PeriodRecord:
        assert meter.boundary is not None and meter.non_model_peak_bytes is not None, "closing an empty period"
        non_model = meter.non_model_peak_bytes
        if non_model < 0:
            # The monitor saw less than the engine says is resident: model data it cannot
            # see (an accounting monitor not told about chunks that existed before).
            if self._clamped_periods == 0:
                logger.warning(
                    "period %d (%s %s): the monitor saw %d bytes but model_bytes_fn reports %d; "
                    "is all resident model data tracked by the monitor? Counting 0 non-model bytes.",
                    len(self._records), meter.boundary.phase.value, meter.boundary.module_name,
                    meter.peak_bytes, meter.model_bytes,
                )
            self._clamped_periods += 1
            non_model = 0
        record = meter.record(index=len(self._records), non_model_peak_bytes=non_model)
        logger.debug(
            "period %d %s %r: peak %d model %d non-model %d chunks %s",
            record.index, record.phase.value, record.module_name, record.peak_bytes,
            record.model_bytes, record.non_model_peak_bytes, record.chunk_ids,
        )
        return record

    def _finish(self) -> None:
        with self._lock:
            assert self._meter is not None, "tracing without a period meter"
            if self._meter.boundary is None:
                raise RuntimeError(
                    f"trace() saw no forward call of {type(self._module).__name__}: "
                    "run the iteration's forward and backward inside the trace() block"
                )
            self._close_period()
            self._meter = None
            self._state = TracerState.TRACED
        worst = max(self._records, key=lambda p: p.non_model_peak_bytes)
        logger.info(
            "traced %d periods of %s: max non-model peak %d bytes at period %d (%s %r)%s",
            len(self._records), type(self._module).__name__, worst.non_model_peak_bytes,
            worst.index, worst.phase.value, worst.module_name,
            f"; {self._clamped_periods} period(s) clamped to 0" if self._clamped_periods else "",
        )

    def _capture_signature(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        # A trace ended by a pre-hook ahead of this one (the engine's, at a forward's start) removed it while
        # torch was calling the module's pre-hooks: torch still calls it, without kwargs.
        if self._state is TracerState.TRACING and self._signature is None and not in_autograd_engine():
            self._signature = input_signature(args, kwargs)

    def _module_tensors(self) -> list[torch.Tensor]:
        params = list(self._module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return params + grads + list(self._module.buffers())

    def _model_bytes(self) -> int:
        value = self._model_bytes_fn()
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"model_bytes_fn must return an int, got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"model_bytes_fn returned {value}; bytes cannot be negative")
        return value

    def _require_traced(self, what: str) -> None:
        if self._state is not TracerState.TRACED:
            raise RuntimeError(f"{what} needs a finished trace; the tracer is {self._state.value}")

    def _clear(self) -> None:
        self._state = TracerState.IDLE
        self._records = []
        self._meter = None
        self._move_depth = 0
        self._signature = None
        self._clamped_periods = 0

