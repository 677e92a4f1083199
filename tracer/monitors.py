"""Memory monitors: how many bytes a device holds now, and at most since the last reset.

Three ways of measuring behind one interface:

- :class:`CudaAllocatorMonitor` reads the CUDA caching allocator's own statistics;
- :class:`TensorAccountingMonitor` sums the live tensor storages on a device that it sees
  through a dispatch mode, and so works on any device, the CPU included;
- :class:`NvmlMonitor` samples the whole device's used memory through NVML (all processes,
  the CUDA context, the allocator's cache), for reports.
"""

from __future__ import annotations

import torch

from tracer.accounting_monitor import TensorAccountingMonitor
from tracer.memory_monitor import CudaAllocatorMonitor, MemoryMonitor, MonitorState, as_device, reset_cuda_peak
from tracer.nvml_monitor import NvmlMonitor

__all__ = [
    "CudaAllocatorMonitor",
    "MemoryMonitor",
    "MonitorState",
    "NvmlMonitor",
    "TensorAccountingMonitor",
    "make_monitor",
    "reset_cuda_peak",
]


def make_monitor(device: str | torch.device) -> MemoryMonitor:
    """The monitor that measures ``device`` best: allocator stats on CUDA, accounting elsewhere."""
    dev = as_device(device)
    if dev.type == "cuda":
        return CudaAllocatorMonitor(dev)
    return TensorAccountingMonitor(dev)
