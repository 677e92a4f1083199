"""The margin tuner: try ``gpu_margin_mem_ratio`` values, recommend the fastest that keeps headroom.

[Note: what the ratio trades]
Under placement="auto" the margin (budget − reserve − the warm-up's planned peak) times ``gpu_margin_mem_ratio`` holds whole optimizer-state chunk groups on the
device, updated there and never copied. A larger ratio moves Adam work off the host, but
leaves less room for caching parameter chunks, so more of them are fetched again each
iteration; which side wins depends on the model, the batch and the machine. The tuner runs a
few steps at each ratio and measures, and recommends the fastest ratio whose device peak stays
``headroom_fraction`` below the budget (room for what the measured steps did not show: longer
sequences, fragmentation).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chunks import fits
from gemini.config import GeminiConfig
from gemini.initialize import initialize
from gemini.loop import train_steps
from gemini.memory import DeviceBudgetError
from gemini.report import MemoryReport
from gemini.summary import gib, readable_unit
from offload import format_size

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_RATIOS", "MarginTrial", "MarginTuning", "Measurement", "measure_reports", "recommend",
           "tune_margin"]

DEFAULT_RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(kw_only=True)
class Measurement:
    """What a trial's steps say about its ratio: its step time and the device's peak."""

    step_seconds: float
    device_peak_bytes: int

    def __post_init__(self) -> None:
        seconds, peak = self.step_seconds, self.device_peak_bytes
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
            raise ValueError(f"Measurement.step_seconds={seconds!r} is invalid: expected a finite number >= 0")
        if isinstance(peak, bool) or not isinstance(peak, int) or peak < 0:
            raise ValueError(f"Measurement.device_peak_bytes={peak!r} is invalid: expected an int >= 0")


@dataclass(kw_only=True)
class MarginTrial:
    """One ratio tried: its measurement, or the error that stopped it."""

    ratio: float
    os_chunks_on_device: int | None  # optimizer-state chunk groups the margin took
    os_chunks_total: int | None
    step_seconds: float | None
    device_peak_bytes: int | None
    error: str | None = None  # e.g. a DeviceBudgetError: the ratio does not fit at all

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass(kw_only=True)
class MarginTuning:
    """Every trial, and the recommended ratio (None when no ratio kept the headroom)."""

    trials: list[MarginTrial]
    budget_bytes: int
    headroom_fraction: float
    recommended_ratio: float | None

    @property
    def limit_bytes(self) -> int:
        """The highest device peak that keeps the headroom."""
        return limit_bytes(self.budget_bytes, self.headroom_fraction)

    def table(self) -> str:
        """ratio, optimizer-state chunks on the device, step time, device peak; ``*`` marks the pick."""
        unit = readable_unit(self.budget_bytes)[0]
        header = f"  {'ratio':>5}  {'OS chunks on device':>19}  {'step time':>9}  {'device peak':>20}  within headroom"
        rows = [header]
        for t in self.trials:
            mark = "*" if t.ratio == self.recommended_ratio else " "
            if t.failed:
                rows.append(f"{mark} {t.ratio:5.2f}  {'-':>19}  {'-':>9}  {'-':>20}  failed: {t.error.splitlines()[0]}")
                continue
            chunks = f"{t.os_chunks_on_device}/{t.os_chunks_total}"
            peak = f"{gib(t.device_peak_bytes, unit)} {unit} ({100 * t.device_peak_bytes / self.budget_bytes:.0f}%)"
            ok = "yes" if fits(self.limit_bytes, t.device_peak_bytes) else "no"
            rows.append(f"{mark} {t.ratio:5.2f}  {chunks:>19}  {t.step_seconds:8.3f}s  {peak:>20}  {ok}")
        return "\n".join(rows)

    def recommendation(self) -> str:
        limit = (f"peak <= {format_size(self.limit_bytes)}: the {format_size(self.budget_bytes)} budget less "
                 f"{100 * self.headroom_fraction:.0f}% headroom")
        if self.recommended_ratio is None:
            return (f"no ratio kept {limit}; raise device_memory, lower the batch or use activation "
                    f"checkpointing, or accept less headroom")
        return f"recommended: gpu_margin_mem_ratio={self.recommended_ratio:g} (the fastest with {limit})"


def limit_bytes(budget_bytes: int, headroom_fraction: float) -> int:
    return int(budget_bytes * (1.0 - headroom_fraction))


def recommend(trials: Sequence[MarginTrial], *, limit_bytes: int) -> float | None:
    """The ratio of the fastest trial whose device peak is at most ``limit_bytes``; among equally
    fast ones the smallest ratio (it leaves more of the device free)."""
    fitting = [t for t in trials if not t.failed and fits(limit_bytes, t.device_peak_bytes)]
    if not fitting:
        return None
    return min(fitting, key=lambda t: (t.step_seconds, t.ratio)).ratio


def measure_reports(ratio: float, reports: Sequence[MemoryReport]) -> Measurement:
    """The default measurement: the median step time after the first step (a warm-up, traced
    and conservative, unlike the steps that follow) and the highest device peak of all."""
    timed = reports[1:] or reports
    return Measurement(step_seconds=statistics.median(r.step_seconds for r in timed),
                       device_peak_bytes=max(r.device_peak_bytes for r in reports))


def tune_margin(
    model_fn: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module], torch.Tensor],
    config: GeminiConfig,
    *,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    steps: int = 4,
    headroom_fraction: float = 0.1,
    measure: Callable[[float, Sequence[MemoryReport]], Measurement] = measure_reports,
    on_trial: Callable[[MarginTrial], None] | None = None,
    **initialize_kwargs: Any,
) -> MarginTuning:
    """Train ``steps`` steps at each ratio and recommend the fastest that keeps the headroom.

    ``model_fn()`` builds a fresh model for each trial (the same one each time: seed it);
    ``loss_fn(model)`` runs forward and returns the loss. ``config`` needs placement="auto" and
    a ``device_memory`` budget; its ``gpu_margin_mem_ratio`` and ``report_path`` are replaced.
    ``measure(ratio, reports)`` turns a trial's reports into a :class:`Measurement` (inject
    one to control timing); ``on_trial`` sees each trial as it ends. ``initialize_kwargs``
    (``lr``, ``weight_decay``, ...) go to :func:`gemini.initialize`. See [Note: what the ratio
    trades].
    """
    if config.placement != "auto":
        raise ValueError(f"GeminiConfig.placement={config.placement!r} is invalid for tune_margin: expected 'auto' "
                         f"(only auto placement has a margin)")
    if config.device_memory is None:
        raise ValueError("GeminiConfig.device_memory=None is invalid for tune_margin: expected a budget (bytes or "
                         "'8GiB') whose headroom the recommendation keeps")
    ratios = list(ratios)
    if not ratios or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in ratios):
        raise ValueError(f"ratios={ratios!r} is invalid: expected a non-empty list of numbers in [0, 1]")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r} is invalid: expected an int >= 2 (the first step is a warm-up)")
    if not (isinstance(headroom_fraction, (int, float)) and 0 <= headroom_fraction < 1):
        raise ValueError(f"headroom_fraction={headroom_fraction!r} is invalid: expected a number in [0, 1)")
    trials = []
    for ratio in ratios:
        trial = _run_trial(model_fn, loss_fn, dataclasses.replace(config, gpu_margin_mem_ratio=float(ratio),
                                                                  report_path=None),
                           steps=steps, measure=measure, initialize_kwargs=initialize_kwargs)
        logger.info("margin ratio %s: %s", ratio, trial)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
    limit = limit_bytes(config.device_memory, headroom_fraction)
    return MarginTuning(trials=trials, budget_bytes=config.device_memory, headroom_fraction=headroom_fraction,
                        recommended_ratio=recommend(trials, limit_bytes=limit))


def _run_trial(model_fn, loss_fn, config: GeminiConfig, *, steps: int, measure, initialize_kwargs) -> MarginTrial:
    ratio = config.gpu_margin_mem_ratio
    model, optimizer = initialize(model_fn(), config, **initialize_kwargs)
    try:
        results = train_steps(model, optimizer, loss_fn, steps=steps)
    except DeviceBudgetError as e:
        return MarginTrial(ratio=ratio, os_chunks_on_device=None, os_chunks_total=None, step_seconds=None,
                           device_peak_bytes=None, error=str(e))
    finally:
        optimizer.close()
        # The next trial builds a whole new model: free this one's chunks first.
        del model, optimizer
        gc.collect()
    reports = [r.report for r in results]
    m = measure(ratio, reports)
    return MarginTrial(ratio=ratio, os_chunks_on_device=reports[-1].os_chunks_on_device,
                       os_chunks_total=reports[-1].os_chunks_total, step_seconds=m.step_seconds,
                       device_peak_bytes=m.device_peak_bytes)
