"""gemini-offload: train models whose parameters, gradients and Adam states exceed the device."""

from gemini.config import GeminiConfig
from gemini.initialize import initialize
from gemini.loss_scaler import DynamicLossScaler
from gemini.module import GeminiModel
from gemini.optimizer import HybridAdam
from gemini.report import MemoryReport

__all__ = [
    "DynamicLossScaler",
    "GeminiConfig",
    "GeminiModel",
    "HybridAdam",
    "MemoryReport",
    "initialize",
]
