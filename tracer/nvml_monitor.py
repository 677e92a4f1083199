"""A memory monitor over NVML: the whole GPU's used memory, sampled on a thread for a peak.

Unlike the allocator and accounting monitors it counts every process, the CUDA context and
the allocator's cache, so it is for reports (``gemini.engine.system_memory``), not planning.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from tracer.memory_monitor import MemoryMonitor

__all__ = ["NvmlMonitor"]


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

