"""The plain training loop the CLI, the margin tuner and the examples share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gemini.optim.hybrid_adam import HybridAdam
from gemini.report import MemoryReport

__all__ = ["StepResult", "train_steps"]


@dataclass(kw_only=True)
class StepResult:
    loss: float
    report: MemoryReport


def train_steps(
    model: nn.Module,
    optimizer: HybridAdam,
    loss_fn: Callable[[nn.Module], torch.Tensor],
    *,
    steps: int,
    on_step: Callable[[StepResult], None] | None = None,
) -> list[StepResult]:
    """``steps`` iterations of forward (``loss_fn(model)``), backward, step and zero_grad;
    ``on_step`` sees each step's loss and MemoryReport as soon as the step is done."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is invalid: expected an int >= 1")
    results = []
    for _ in range(steps):
        loss = loss_fn(model)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        result = StepResult(loss=loss.item(), report=optimizer.report)
        results.append(result)
        if on_step is not None:
            on_step(result)
    return results
