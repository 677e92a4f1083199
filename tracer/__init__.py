"""What the warm-up iteration teaches: memory monitors, period hooks, the runtime tracer, Belady.

A leaf package: it imports nothing from gemini, chunks or offload; the engine passes in
callbacks (model bytes on the device, chunks of a module).
"""

from tracer.belady import NEVER, AccessOrder, EvictionError, EvictionRule, choose_victims, next_use
from tracer.hooks import Boundary, PeriodHooks, Phase
from tracer.monitors import (
    CudaAllocatorMonitor,
    MemoryMonitor,
    MonitorState,
    NvmlMonitor,
    TensorAccountingMonitor,
    make_monitor,
    reset_cuda_peak,
)
from tracer.period import PeriodMeter, PeriodRecord
from tracer.runtime import RuntimeTracer, TracerState
from tracer.signature import InputSignature, TracedInputs, input_signature

__all__ = [
    "NEVER",
    "AccessOrder",
    "Boundary",
    "CudaAllocatorMonitor",
    "EvictionError",
    "EvictionRule",
    "InputSignature",
    "TracedInputs",
    "MemoryMonitor",
    "MonitorState",
    "NvmlMonitor",
    "PeriodHooks",
    "PeriodMeter",
    "PeriodRecord",
    "Phase",
    "RuntimeTracer",
    "TensorAccountingMonitor",
    "TracerState",
    "choose_victims",
    "input_signature",
    "make_monitor",
    "next_use",
    "reset_cuda_peak",
]
