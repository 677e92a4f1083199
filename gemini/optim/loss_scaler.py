"""Dynamic loss scaling for fp16 training: the scaler, and what a step checks and updates."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gemini.config import GeminiConfig
    from gemini.engine.transaction import StepTransaction

__all__ = ["DynamicLossScaler", "ScaledBackwards", "loss_scaler_for", "update_scale"]


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


def loss_scaler_for(config: GeminiConfig) -> DynamicLossScaler | None:
    """The config's scaler under ``precision="fp16"``; None otherwise (nothing is scaled)."""
    if config.precision != "fp16":
        return None
    # Each of the scaler's settings is the config's field of the same name.
    return DynamicLossScaler(**{f.name: getattr(config, f.name) for f in fields(DynamicLossScaler)})

class ScaledBackwards:
    """Under fp16 the step divides the gradients by the loss scale, so a backward pass that did
    not go through ``optimizer.backward(loss)`` (an unscaled loss) would be silently wrong. This
    counts the scaled passes; each step compares them with every pass the hooks saw since the
    last step."""

    def __init__(self, scaler: DynamicLossScaler | None) -> None:
        self._scaler = scaler
        self._scaled = 0
        self._passes_at_step = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as ``backward`` should see it, counted."""
        if self._scaler is None:
            return loss
        self._scaled += 1
        return loss * self._scaler.scale

    def check(self, backward_passes: int, tx: StepTransaction) -> None:
        """Start a new count at this step (undone with ``tx``); raise if a pass since the last
        step was not scaled. ``backward_passes``: the hooks' count of every pass so far."""
        passes = backward_passes - self._passes_at_step
        saved = (self._passes_at_step, self._scaled)

        def restore() -> None:
            self._passes_at_step, self._scaled = saved

        tx.on_rollback(restore)
        self._passes_at_step = backward_passes
        scaled, self._scaled = self._scaled, 0
        if self._scaler is not None and passes != scaled:
            restore()
            raise RuntimeError(
                f"precision='fp16' needs optimizer.backward(loss) so the loss is scaled; "
                f"{passes} backward pass(es) ran since the last step, {scaled} through optimizer.backward"
            )


def update_scale(scaler: DynamicLossScaler | None, norm: torch.Tensor | None, tx: StepTransaction) -> bool:
    """Account for this step's gradients (``norm``: their unscaled norm, given under fp16) in the
    scaler, undone with ``tx``; returns whether they overflowed (the step is then skipped)."""
    if scaler is None:
        return False
    overflow = not math.isfinite(norm.item())
    saved = scaler.state_dict()
    tx.on_rollback(lambda: scaler.load_state_dict(saved))
    scaler.update(overflow)
    return overflow
