"""Dynamic loss scaling for fp16 training: the scaler, and what a step checks and updates."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gemini.config import GeminiConfig
    from gemini.engine.transaction import StepTransaction

__all__ = ["DynamicLossScaler", "ScaledBackwards", "loss_scaler_for", "update_scale"]


@dataclass(kw_only=True)
class DynamicLossScaler:
    """Multiplies the loss so fp16 gradients neither underflow nor overflow. Every overflow skips its step.

    [Note: hysteresis]
    The scale backs off only after ``hysteresis`` overflows since the last growth (Megatron-LM's and DeepSpeed's
    rule), so one stray spike does not halve the scale; a growth restores the full allowance. After
    ``growth_interval`` consecutive good steps the scale grows, capped at ``max_scale``; it never backs off below
    ``min_scale``.
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
    """Under fp16 the step divides the gradients by the loss scale, so a backward pass not through
    ``optimizer.backward(loss)`` (an unscaled loss) would be silently wrong. This records which of the hooks' backward
    passes ran scaled; each step checks that every pass since the last step and the last ``zero_grad`` (which forgets
    earlier passes' gradients, scaled or not) was one of them."""

    def __init__(self, scaler: DynamicLossScaler | None, passes: Callable[[], int]) -> None:
        self._scaler = scaler
        self._passes = passes  # the hooks' count of backward passes that ran to completion
        self._scaled: list[int] = []  # the numbers of the passes that ran scaled
        self._passes_at_step = 0

    def backward(self, loss: torch.Tensor, **backward_args: Any) -> None:
        """``loss.backward(**backward_args)``, with ``loss`` scaled under fp16; its passes are recorded as scaled."""
        if self._scaler is None:
            loss.backward(**backward_args)
            return
        before = self._passes()
        try:
            (loss * self._scaler.scale).backward(**backward_args)
        except BaseException:
            # A pass that raised is counted when the engine ends it, as the next number.
            self._scaled.append(before + 1)
            raise
        self._scaled.extend(range(before + 1, self._passes() + 1))

    @property
    def scale(self) -> float:
        return self._scaler.scale

    def refuse_unscaled(self, cleared_at_pass: int) -> None:
        """Raise if a pass whose gradients a step or ``model.clip_grad_norm_`` would use was not scaled (they would be
        divided by a scale they never had). ``cleared_at_pass``: the pass count at the last ``zero_grad``."""
        now = self._passes()
        since = max(self._passes_at_step, cleared_at_pass)
        unscaled = (now - since) - sum(n > since for n in self._scaled)
        if self._scaler is not None and unscaled:
            raise RuntimeError(
                f"precision='fp16' needs optimizer.backward(loss) so the loss is scaled; {now - since} backward "
                f"pass(es) ran since the last step or zero_grad, {unscaled} of them not through optimizer.backward. "
                f"Their gradients are kept: call optimizer.zero_grad() to drop them, then backward through "
                f"optimizer.backward(loss)"
            )

    def check(self, cleared_at_pass: int, tx: StepTransaction) -> None:
        """Raise as :meth:`refuse_unscaled` does, before any change; then start a new count at this step (undone with
        ``tx``)."""
        self.refuse_unscaled(cleared_at_pass)
        saved = (self._passes_at_step, self._scaled)

        def restore() -> None:
            self._passes_at_step, self._scaled = saved

        tx.on_rollback(restore)
        self._passes_at_step, self._scaled = self._passes(), []


def update_scale(scaler: DynamicLossScaler | None, norm: torch.Tensor | None, tx: StepTransaction) -> bool:
    """Account for this step's gradients (``norm``: their unscaled norm, given under fp16) in the scaler, undone with
    ``tx``; returns whether they overflowed (the step is then skipped)."""
    if scaler is None:
        return False
    overflow = not math.isfinite(norm.item())
    saved = scaler.state_dict()
    tx.on_rollback(lambda: scaler.load_state_dict(saved))
    scaler.update(overflow)
    return overflow
