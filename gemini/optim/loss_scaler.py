"""Dynamic loss scaling for fp16 training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DynamicLossScaler"]


@dataclass(kw_only=True)
class DynamicLossScaler:
    """Multiplies the loss so fp16 gradients neither underflow nor overflow.

    Every overflow skips its step. [Note: hysteresis] The scale backs off only after
    ``hysteresis`` overflows since the last growth (Megatron-LM's and DeepSpeed's rule), so one
    stray spike does not halve the scale; a growth restores the full allowance. After
    ``growth_interval`` consecutive good steps the scale grows, capped at ``max_scale``; it
    never backs off below ``min_scale``.
    """

    initial_scale: float = 2.0**16
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float = 2.0**32

    def __post_init__(self) -> None:
        self.scale = float(self.initial_scale)
        self._good_steps = 0  # consecutive steps without overflow
        self._hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Account for one step; ``overflow`` says whether its gradients held inf/nan."""
        if overflow:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._good_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = float(sd["scale"])
        self._good_steps = int(sd["good_steps"])
        self._hysteresis_left = int(sd["hysteresis_left"])
