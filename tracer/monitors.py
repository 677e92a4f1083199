"""Memory monitors: how many bytes a device holds now, and at most since the last reset.

Three ways of measuring behind one interface:

- :class:`CudaAllocatorMonitor` reads the CUDA caching allocator's own statistics;
- :class:`TensorAccountingMonitor` sums the live tensor storages on a device that it sees
  through a dispatch mode, and so works on any device, the CPU included;
- :class:`NvmlMonitor` samples the whole device's used memory through NVML (all processes,
  the CUDA context, the allocator's cache), for reports.
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from tracer.storage_ledger import StorageLedger, storages_of

logger = logging.getLogger(__name__)

__all__ = [
    "CudaAllocatorMonitor",
    "MemoryMonitor",
    "MonitorState",
    "NvmlMonitor",
    "TensorAccountingMonitor",
    "make_monitor",
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
        here; :class:`TensorAccountingMonitor` overrides it.
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


def _as_device(device: Any, *, name: str = "device") -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__} {device!r}")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name}={device!r} is not a device: {e}") from None


class CudaAllocatorMonitor(MemoryMonitor):
    """The CUDA caching allocator's allocated bytes (``memory_allocated``) and their peak.

    Resetting the peak calls ``torch.cuda.reset_peak_memory_stats``, which resets the
    device's peak for every reader in the process, not just this monitor.
    """

    def __init__(self, device: str | torch.device = "cuda") -> None:
        super().__init__()
        dev = _as_device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaAllocatorMonitor needs a cuda device, got device={device!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("CudaAllocatorMonitor: CUDA is not available in this process")
        self.device = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)

    def __repr__(self) -> str:
        return f"CudaAllocatorMonitor(device={self.device})"

    def _start(self) -> None:
        pass

    def _stop(self) -> None:
        pass

    # The allocator's counters are updated on the host when a tensor is created or freed,
    # in launch order, so no synchronisation is needed to read them.
    def _current_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def _peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def _reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class _AccountingMode(TorchDispatchMode):
    """Hands every tensor an operator produces (and, optionally, consumes) to the monitor."""

    def __init__(self, monitor: TensorAccountingMonitor) -> None:
        super().__init__()
        self._monitor = monitor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self._monitor._see(out)
        if self._monitor.count_inputs:
            self._monitor._see(args)
            if kwargs:
                self._monitor._see(kwargs)
        return out

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile skips every frame while a dispatch mode that does not say this is
        # active, so with the monitor running (the CPU stand-in with a budget, or placement
        # auto) nothing was compiled. Saying it keeps the mode off while dynamo traces and
        # compiles, and on while the compiled code runs: with the "eager" and "aot_eager"
        # backends every operator of the graphs reaches the mode, as in eager mode; inductor's
        # generated code allocates some buffers below the dispatcher, which the mode then
        # misses (a lower bound; on CUDA the allocator monitor sees every byte).
        return True


class TensorAccountingMonitor(MemoryMonitor):
    """Exact sum of the bytes of live tensor storages on one device; works on any device.

    While running, a dispatch mode sees every operator on the thread that started the
    monitor, and on the autograd threads of a ``backward()`` called from it; each new
    storage on ``device`` among the operator's outputs (and inputs, with ``count_inputs``)
    is counted once and dropped when it is freed. Storages that existed before, and were
    never an operator's input, are invisible: pass them to :meth:`track`, or give their
    total as ``baseline_bytes``. Storages the caller knows are not device data (host-tier
    buffers when the CPU stands in for the device) can be left out with :meth:`exclude`.

    See [Note: what the accounting monitor sees] for what it cannot see.
    """

    # [Note: what the accounting monitor sees]
    # - Threads: the dispatch-mode stack is thread-local. PyTorch copies it into the
    #   autograd engine's graph task when backward() is called, so backward ops are seen on
    #   the CPU (which runs them on the calling thread) and on CUDA's per-device threads.
    #   Operators run on any other thread (a copy thread, a data-loader thread) are not
    #   seen; give their results to track() if they stay on the device.
    # - Inside a kernel: scratch buffers an operator allocates and frees internally (the
    #   CPU flash-attention kernel's per-thread buffers, for instance) never surface as
    #   tensors, so a peak inside such an op is missed; the allocator-based monitor sees it.
    # - Allocator rounding and fragmentation: storage bytes are what tensors need, not what
    #   a caching allocator reserves (CUDA rounds blocks to 512 bytes and caches freed ones).
    # - In-place resizes: UntypedStorage.resize_ bypasses the dispatcher; call refresh().
    # - Cost: a Python call per operator plus, per new storage, a weakref; only meant for
    #   warm-up iterations and tests.

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        baseline_bytes: int = 0,
        count_inputs: bool = True,
    ) -> None:
        super().__init__()
        dev = _as_device(device)
        if not isinstance(baseline_bytes, int) or isinstance(baseline_bytes, bool):
            raise TypeError(f"baseline_bytes must be an int, got {type(baseline_bytes).__name__} {baseline_bytes!r}")
        if baseline_bytes < 0:
            raise ValueError(f"baseline_bytes must be >= 0, got {baseline_bytes}")
        self.device = dev
        self.baseline_bytes = baseline_bytes
        self.count_inputs = bool(count_inputs)
        self._ledger = StorageLedger()
        self._mode: _AccountingMode | None = None
        self._owner_thread: int | None = None

    def __repr__(self) -> str:
        return f"TensorAccountingMonitor(device={self.device}, baseline_bytes={self.baseline_bytes})"

    @property
    def tracked_storages(self) -> int:
        """Number of live storages counted right now."""
        return len(self._ledger)

    def track(self, tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Count these tensors' storages (those on the watched device) from now on."""
        for t in _tensor_list(tensors, "tensors"):
            self._see_tensor(t)

    def exclude(self, tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages while they live, even when operators use them."""
        for t in _tensor_list(tensors, "tensors"):
            for storage in storages_of(t):
                self._ledger.exclude(storage)

    def refresh(self) -> None:
        """Re-read the sizes of the counted storages (after ``UntypedStorage.resize_``)."""
        self._ledger.refresh()

    def _start(self) -> None:
        self._mode = _AccountingMode(self)
        self._mode.__enter__()
        self._owner_thread = threading.get_ident()

    def _stop(self) -> None:
        assert self._mode is not None, "stop() without a mode"
        if threading.get_ident() != self._owner_thread:
            raise RuntimeError(
                f"{self!r} must be stopped on the thread that started it: dispatch modes are thread-local"
            )
        if _get_current_dispatch_mode() is not self._mode:
            # Exiting would pop whichever mode is on top, not ours.
            raise RuntimeError(
                f"{self!r} must be stopped after the dispatch modes entered since it started "
                f"have exited; the innermost mode is {_get_current_dispatch_mode()!r}"
            )
        self._mode.__exit__(None, None, None)
        self._mode = None

    def _current_bytes(self) -> int:
        return self.baseline_bytes + self._ledger.current_bytes

    def _peak_bytes(self) -> int:
        return self.baseline_bytes + self._ledger.peak_bytes

    def _reset_peak(self) -> None:
        self._ledger.reset_peak()

    def _see(self, tree: Any) -> None:
        # Operator arguments and results are tensors, scalars and (nested) lists or tuples
        # of them; a direct walk costs a fraction of a general pytree flatten per operator.
        if isinstance(tree, torch.Tensor):
            self._see_tensor(tree)
        elif isinstance(tree, (tuple, list)):
            for item in tree:
                self._see(item)
        elif isinstance(tree, dict):
            for item in tree.values():
                self._see(item)

    def _see_tensor(self, t: torch.Tensor) -> None:
        if not self._watches(t.device):
            return
        if t.layout is torch.strided and type(t) in (torch.Tensor, nn.Parameter):
            self._ledger.add(t.untyped_storage())  # the common case, without a generator
            return
        for storage in storages_of(t):
            self._ledger.add(storage)

    def _watches(self, device: torch.device) -> bool:
        # A watched device without an index ("cuda") watches every index of its type.
        if device.type != self.device.type:
            return False
        return self.device.index is None or device.index == self.device.index


def _tensor_list(tensors: torch.Tensor | Iterable[torch.Tensor], name: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    try:
        items = list(tensors)
    except TypeError:
        raise TypeError(f"{name} must be a tensor or an iterable of tensors, got {type(tensors).__name__}") from None
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__} {t!r}")
    return items


class _PeakSampler:
    """Polls a reading on a daemon thread and keeps its maximum.

    NVML has no peak counter, so a peak is only as good as the sampling: a spike shorter
    than ``interval_s`` can be missed. Every explicit reading also feeds the peak.
    """

    def __init__(self, read_bytes: Callable[[], int], interval_s: float) -> None:
        self._read_bytes = read_bytes
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._peak_bytes = 0
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        assert self._thread is None, "sampler started twice"
        self._stop_event.clear()
        self.reset_peak()
        self._thread = threading.Thread(target=self._run, name="gemini-nvml-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        assert self._thread is not None, "sampler stopped before start"
        self._stop_event.set()
        self._thread.join()
        self._thread = None

    def sample(self) -> int:
        value = self._read_bytes()
        with self._lock:
            self._peak_bytes = max(self._peak_bytes, value)
        return value

    def peak_bytes(self) -> int:
        self.sample()
        with self._lock:
            return self._peak_bytes

    def reset_peak(self) -> None:
        value = self._read_bytes()
        with self._lock:
            self._peak_bytes = value

    def _run(self) -> None:
        while not self._stop_event.wait(self._interval_s):
            self.sample()


class NvmlMonitor(MemoryMonitor):
    """Used memory of a whole GPU as NVML reports it, sampled for a peak.

    This counts every process on the device, the CUDA context and the allocator's cached
    blocks: the number a user sees in nvidia-smi. It is for reports, not for planning.
    ``device_index`` is NVML's index, which follows PCI order and ignores
    ``CUDA_VISIBLE_DEVICES``. Raises RuntimeError where NVML or the device is missing;
    :meth:`is_available` asks without raising.
    """

    def __init__(self, device_index: int = 0, *, sample_interval_s: float = 0.005) -> None:
        super().__init__()
        if not isinstance(device_index, int) or isinstance(device_index, bool):
            raise TypeError(f"device_index must be an int, got {type(device_index).__name__} {device_index!r}")
        if not sample_interval_s > 0:
            raise ValueError(f"sample_interval_s must be > 0, got {sample_interval_s!r}")
        nvml = _load_nvml()
        count = nvml.nvmlDeviceGetCount()
        if not 0 <= device_index < count:
            nvml.nvmlShutdown()
            raise ValueError(f"device_index={device_index} is out of range: NVML sees {count} device(s)")
        self.device_index = device_index
        handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
        self._sampler = _PeakSampler(lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).used), sample_interval_s)
        # NVML's init is reference-counted; give ours back when this monitor goes away.
        weakref.finalize(self, nvml.nvmlShutdown)

    @staticmethod
    def is_available(device_index: int = 0) -> bool:
        """Whether NVML works here and sees a device with this index."""
        try:
            nvml = _load_nvml()
        except RuntimeError:
            return False
        try:
            return 0 <= device_index < nvml.nvmlDeviceGetCount()
        except nvml.NVMLError:
            return False
        finally:
            nvml.nvmlShutdown()

    def __repr__(self) -> str:
        return f"NvmlMonitor(device_index={self.device_index})"

    def _start(self) -> None:
        self._sampler.start()

    def _stop(self) -> None:
        self._sampler.stop()

    def _current_bytes(self) -> int:
        return self._sampler.sample()

    def _peak_bytes(self) -> int:
        return self._sampler.peak_bytes()

    def _reset_peak(self) -> None:
        self._sampler.reset_peak()


def _load_nvml() -> Any:
    try:
        import pynvml
    except ImportError as e:
        raise RuntimeError(f"NVML is unavailable: the nvidia-ml-py package is not installed ({e})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise RuntimeError(f"NVML is unavailable: nvmlInit failed ({e}); is there an NVIDIA driver and GPU?") from None
    return pynvml


def make_monitor(device: str | torch.device) -> MemoryMonitor:
    """The monitor that measures ``device`` best: allocator stats on CUDA, accounting elsewhere."""
    dev = _as_device(device)
    if dev.type == "cuda":
        return CudaAllocatorMonitor(dev)
    return TensorAccountingMonitor(dev)
