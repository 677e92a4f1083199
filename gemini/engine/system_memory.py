"""Figures beyond the engine's own ledger: the host (psutil) and the whole GPU (NVML).

The chunk ledger and the device monitor say what *this engine* holds; a report also gives what the machine sees:
the process's resident memory, what the host can still give, and the GPU's used memory as nvidia-smi shows it
(every process, the CUDA context, the caching allocator's blocks).
"""

from __future__ import annotations

import logging
import os
import weakref

import psutil
import torch

from tracer import NvmlMonitor

logger = logging.getLogger(__name__)

# [Note: host readings every step] Every step report reads the process's resident memory and what the host can
# still give. psutil parses all of /proc/meminfo and wraps each call, a visible share of a small model's CPU step,
# so on Linux the two figures are read straight from /proc/self/statm (resident pages) and /proc/meminfo's
# MemAvailable (psutil's ``available`` there); psutil elsewhere. The files stay open, since open and close are most
# of the cost, and are read with pread at offset 0, which makes the kernel write them afresh. /proc/self is
# resolved at open, so a forked child opens its own.
_PROC = os.path.exists("/proc/self/statm") and os.path.exists("/proc/meminfo")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if _PROC else 0


__all__ = ["SystemMemory"]


class _ProcFile:
    """One /proc file kept open, read whole at each call (see [Note: host readings every step])."""

    def __init__(self, path: str, size: int) -> None:
        self._path, self._size = path, size
        self._fd: int | None = None
        self._pid = 0

    def read(self) -> bytes:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC), os.getpid()
        return os.pread(self._fd, self._size, 0)

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None


class SystemMemory:
    """Host readings from psutil; on CUDA, the whole GPU's used-memory peak from NVML."""

    def __init__(self, device: torch.device) -> None:
        self._process = psutil.Process()
        self._statm = _ProcFile("/proc/self/statm", 128)
        self._meminfo = _ProcFile("/proc/meminfo", 4096)
        # Engines are not always closed: the files must not outlive the object.
        self._finalizer = weakref.finalize(self, _close_all, self._statm, self._meminfo)
        self._nvml: NvmlMonitor | None = None
        if device.type == "cuda":
            index = _nvml_index(device)
            if index is not None:
                self._nvml = NvmlMonitor(index)
                # Sampled all along (a thread reads NVML every few ms): a step's peak is the largest reading since
                # the last reset.
                self._nvml.start()

    def host_rss_bytes(self) -> int:
        if _PROC:
            return int(self._statm.read().split()[1]) * _PAGE_BYTES
        return self._process.memory_info().rss

    def host_available_bytes(self) -> int:
        if _PROC:
            data = self._meminfo.read()
            start = data.find(b"MemAvailable:")
            if start >= 0:
                return int(data[start + 13 : data.index(b"\n", start)].split()[0]) * 1024  # the file says kB
        return psutil.virtual_memory().available

    def device_used_peak_bytes(self) -> int | None:
        """The GPU's used memory (NVML), peak since the last :meth:`reset_peak`; None without NVML."""
        return self._nvml.peak_bytes() if self._nvml is not None else None

    def reset_peak(self) -> None:
        if self._nvml is not None:
            self._nvml.reset_peak()

    def close(self) -> None:
        self._finalizer()
        if self._nvml is not None and self._nvml.running:
            self._nvml.stop()


def _close_all(*files: _ProcFile) -> None:
    for f in files:
        f.close()


def _nvml_index(device: torch.device) -> int | None:
    """NVML's index of ``device``, matched by UUID: NVML counts in PCI order and ignores CUDA_VISIBLE_DEVICES,
    torch does neither. None when NVML cannot be used."""
    if not NvmlMonitor.is_available():
        logger.info("NVML is unavailable: reports carry no whole-device figures")
        return None
    import pynvml  # present: is_available() initialised it

    index = device.index if device.index is not None else torch.cuda.current_device()
    want = str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")
    pynvml.nvmlInit()
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            if uuid.removeprefix("GPU-") == want:
                return i
    except pynvml.NVMLError as e:
        logger.info("NVML could not list devices (%s): reports carry no whole-device figures", e)
    finally:
        pynvml.nvmlShutdown()
    logger.info("NVML sees no device with the UUID of %s: reports carry no whole-device figures", device)
    return None
