"""`GeminiRuntime`: the state shared by the wrapped module and the optimizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunks import ChunkManager, ChunkStorage, Tier
from gemini.config import GeminiConfig
from gemini.hooks import ModuleHooks
from gemini.placement import PlacementPolicy
from gemini.report import ReportWriter

__all__ = ["GeminiRuntime"]


@dataclass(eq=False)
class GeminiRuntime:
    config: GeminiConfig
    device: torch.device
    storage: ChunkStorage
    manager: ChunkManager
    placement: PlacementPolicy
    hooks: ModuleHooks
    module_params: tuple[torch.nn.Parameter, ...]  # the module's parameters, in its order
    report_writer: ReportWriter | None = None

    def device_peak_bytes(self) -> int:
        """The compute device's measured peak over the current step."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        # The CPU stand-in: the chunk ledger's device peak (non-model data is measured by the
        # tracer's accounting monitor when it runs).
        return self.storage.stats[Tier.DEVICE].peak_bytes

    def device_non_model_peak_bytes(self) -> int | None:
        return None

    def start_new_step(self) -> None:
        """Reset the per-step peaks and transfer counters."""
        self.storage.reset_peaks()
        self.storage.transfers.reset()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
