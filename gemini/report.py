"""`MemoryReport`: where every byte went in one step, and where the time went."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MemoryReport", "ReportWriter"]


@dataclass(kw_only=True)
class MemoryReport:
    """One training step (forward, backward and optimizer step) as measured.

    Byte counts of chunks are sums of payloads allocated by the chunk storage; transfer counts
    are summed at each copy. ``device_peak_bytes`` is measured: by the CUDA allocator on CUDA,
    by the tensor-accounting monitor on the CPU stand-in when one runs (else the chunk ledger's
    peak, with ``device_non_model_peak_bytes`` = None meaning "not measured").
    """

    step: int
    device_peak_bytes: int
    device_model_bytes: int  # chunk payloads on the device at the end of the step
    device_non_model_peak_bytes: int | None
    host_model_bytes: int  # chunk payloads in host memory at the end of the step
    nvme_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    nvme_read_bytes: int
    nvme_write_bytes: int
    chunks_on_device: int  # chunk payloads (any kind) with a device copy
    os_chunks_on_device: int  # chunk groups whose optimizer states are on the device
    step_seconds: float  # end of the previous step() to the end of this one
    transfer_seconds: float
    optimizer_cpu_seconds: float
    optimizer_device_seconds: float
    skipped: bool  # fp16 overflow: the step was skipped
    loss_scale: float
    # Beyond the contract:
    device_model_peak_bytes: int = 0  # the chunk ledger's device peak over the step
    device_budget_bytes: int | None = None
    grad_norm: float | None = None  # global norm before clipping (unscaled), when computed
    host_rss_bytes: int | None = None  # the process's resident memory (psutil)
    nvme_wait_seconds: float = 0.0  # time the step waited for NVMe reads and writes
    host_pool_bytes: int = 0  # host buffers held by the pinned pool (in use or idle)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ReportWriter:
    """Appends one JSON object per step to a JSON Lines file."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        # Truncate: one run, one file.
        with open(self.path, "w"):
            pass

    def write(self, report: MemoryReport) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(report.to_dict()) + "\n")
