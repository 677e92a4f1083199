"""The memory-monitor interface, and the monitor that reads the CUDA caching allocator.

:class:`MemoryMonitor` is what the runtime tracer measures a period with: current and peak
bytes of one device, with a peak reset per period. :class:`CudaAllocatorMonitor` answers from
the allocator's own counters; the other implementations live in
:mod:`tracer.accounting_monitor` (any device, the CPU included) and :mod:`tracer.nvml_monitor`
(the whole GPU, for reports).
"""

from __future__ import annotations

import abc
import enum
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CudaAllocatorMonitor",
    "reset_cuda_peak",
    "MemoryMonitor",
    "MonitorState",
    "as_device",
]


class MonitorState(enum.Enum):
    NEW = "new"  # never started: there is nothing to read
    RUNNING = "running"
    STOPPED = "stopped"  # readings are frozen at the values they had at stop()


class MemoryMonitor(abc.ABC):
    """Current and peak bytes of one device, with a peak that can be reset per period.

    Use ``start()``/``stop()`` or ``with monitor: ...``. Readings are allowed while running
    and after stopping (then they are the values at ``stop()``); a stopped monitor can be
    started again, which resets its peak.
    """

    def __init__(self) -> None:
        self._state = MonitorState.NEW
        self._frozen_current_bytes = 0
        self._frozen_peak_bytes = 0

    @property
    def state(self) -> MonitorState:
        return self._state

    @property
    def running(self) -> bool:
        return self._state is MonitorState.RUNNING

    def start(self) -> None:
        if self._state is MonitorState.RUNNING:
            raise RuntimeError(f"{self!r} is already running")
        self._start()
        self._state = MonitorState.RUNNING
        self._reset_peak()
        logger.debug("%r started at %d bytes", self, self._current_bytes())

    def stop(self) -> None:
        self._require_running("stop")
        self._frozen_current_bytes = self._current_bytes()
        self._frozen_peak_bytes = self._peak_bytes()
        self._stop()
        self._state = MonitorState.STOPPED
        logger.debug("%r stopped: %d bytes, peak %d", self, self._frozen_current_bytes, self._frozen_peak_bytes)

    def current_bytes(self) -> int:
        """Bytes in use on the device now."""
        if self._state is MonitorState.RUNNING:
            return self._current_bytes()
        self._require_started("current_bytes")
        return self._frozen_current_bytes

    def peak_bytes(self) -> int:
        """Most bytes in use since start() or the last reset_peak()."""
        if self._state is MonitorState.RUNNING:
            return self._peak_bytes()
        self._require_started("peak_bytes")
        return self._frozen_peak_bytes

    def reset_peak(self) -> None:
        """Start a new period: the peak becomes the current value."""
        self._require_running("reset_peak")
        self._reset_peak()

    def track(self, tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Make tensors that exist already visible to the monitor.

        Monitors that read an allocator see every allocation anyway, so this does nothing
        here; :class:`~tracer.accounting_monitor.TensorAccountingMonitor` overrides it.
        """

    def __enter__(self) -> MemoryMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _require_running(self, what: str) -> None:
        if self._state is not MonitorState.RUNNING:
            raise RuntimeError(f"{what}() needs a running monitor; {self!r} is {self._state.value}")

    def _require_started(self, what: str) -> None:
        if self._state is MonitorState.NEW:
            raise RuntimeError(f"{what}() before start(): {self!r} has measured nothing yet")

    @abc.abstractmethod
    def _start(self) -> None: ...

    @abc.abstractmethod
    def _stop(self) -> None: ...

    @abc.abstractmethod
    def _current_bytes(self) -> int: ...

    @abc.abstractmethod
    def _peak_bytes(self) -> int: ...

    @abc.abstractmethod
    def _reset_peak(self) -> None: ...


def as_device(device: Any, *, name: str = "device") -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__} {device!r}")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name}={device!r} is not a device: {e}") from None


# [Note: one device peak, several monitors]
# torch keeps one peak per CUDA device for the whole process, and a reset clears it for every
# reader. Two engines in one process (a GAN's generator and discriminator) measure their own
# iterations, which interleave: the discriminator's step reset the device's peak in the middle of
# the generator's window, whose peak then missed everything before. So every reset goes through
# reset_cuda_peak, which first folds the peak so far into each running monitor of that device;
# a monitor's peak is the larger of what it folded and the device's peak since the last reset.
_RUNNING_CUDA: weakref.WeakSet[CudaAllocatorMonitor] = weakref.WeakSet()


def reset_cuda_peak(device: torch.device) -> None:
    """Reset ``device``'s peak memory statistics, keeping every running monitor's own peak."""
    for monitor in list(_RUNNING_CUDA):
        if monitor.device == device:
            monitor._fold()
    torch.cuda.reset_peak_memory_stats(device)


class CudaAllocatorMonitor(MemoryMonitor):
    """The CUDA caching allocator's allocated bytes (``memory_allocated``) and their peak.

    torch's peak is the device's, for the whole process; resets go through
    :func:`reset_cuda_peak`, so that each running monitor keeps its own (see [Note: one device
    peak, several monitors]).
    """

    def __init__(self, device: str | torch.device = "cuda") -> None:
        super().__init__()
        dev = as_device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaAllocatorMonitor needs a cuda device, got device={device!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("CudaAllocatorMonitor: CUDA is not available in this process")
        self.device = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        # torch resets the reserved peak with the allocated one: what it was before each reset
        self._reserved_peak_bytes = 0
        self._folded_peak_bytes = 0  # this monitor's peak before the device's last reset

    def __repr__(self) -> str:
        return f"CudaAllocatorMonitor(device={self.device})"

    # [Note: reading the allocator's counters]
    # torch.cuda.memory_allocated and its kin each flatten the allocator's whole statistics
    # (some 120 entries) into sorted dotted keys, about 100 us a call, and a step under auto
    # reads them at each move of model data onto or off the device (two cuts of the step's
    # peak a move, [Note: the step's non-model peak] in gemini/engine/memory.py): some 2,200
    # calls a step on a 355M GPT by a count on the stand-in, about a tenth of a second of host
    # time (an estimate, not yet timed on a GPU). One nested read
    # (torch.cuda.memory_stats_as_nested_dict, what they read before flattening) serves each
    # reading here.
    def _counters(self, stat: str, stats: dict | None = None) -> dict[str, int]:
        """``stat``'s (allocated_bytes, reserved_bytes) counters for all pools (current, peak),
        from ``stats`` read already or a read now."""
        if stats is None:
            stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        return stats.get(stat, {}).get("all", {})

    def reserved_peak_bytes(self) -> int:
        """The allocator's peak of reserved memory (blocks held, in use or cached) since
        :meth:`restart_reserved_peak`, across the peak resets in between."""
        return max(self._reserved_peak_bytes, self._counters("reserved_bytes").get("peak", 0))

    def restart_reserved_peak(self) -> None:
        """Count the reserved peak from now on. The device's peaks are reset here (running monitors
        keep theirs): left to the next reset, its fold took in the peak from before, a larger
        batch's evaluation before the warm-up (an H200 run: a 264 MB reserve beside a 148 MB warm-up)."""
        reset_cuda_peak(self.device)
        self._reserved_peak_bytes = 0

    def _start(self) -> None:
        _RUNNING_CUDA.add(self)

    def _stop(self) -> None:
        _RUNNING_CUDA.discard(self)

    # The allocator's counters are updated on the host when a tensor is created or freed,
    # in launch order, so no synchronisation is needed to read them.
    def _current_bytes(self) -> int:
        return self._counters("allocated_bytes").get("current", 0)

    def _peak_bytes(self) -> int:
        return max(self._folded_peak_bytes, self._counters("allocated_bytes").get("peak", 0))

    def _fold(self) -> None:
        """The device's peak is about to be reset: keep it (see [Note: one device peak, several monitors])."""
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)  # one read for both peaks
        allocated, reserved = (self._counters(s, stats).get("peak", 0) for s in ("allocated_bytes", "reserved_bytes"))
        self._folded_peak_bytes = max(self._folded_peak_bytes, allocated)
        self._reserved_peak_bytes = max(self._reserved_peak_bytes, reserved)

    def _reset_peak(self) -> None:
        reset_cuda_peak(self.device)
        self._folded_peak_bytes = 0
