"""The margin tuner's verdict: trials, their per-ratio results, and the recommended ratio.

Pure bookkeeping over measured trials (nothing here runs a model): :func:`summarize` groups trials by ratio,
:func:`recommend` picks one, :class:`MarginTuning` prints the table. How trials run and what they measure:
:mod:`gemini.tools.tune`.

[Note: timing within noise]
Each ratio is run ``rounds`` times, the rounds interleaved (round r tries the ratios in an order rotated by r, so a
drift of the machine is spread over all of them). A trial's time is the median of its steps after the warm-up; a
ratio's time is the median of its trials, its spread their min–max range. Two ratios are tied when their ranges
overlap or their medians differ by less than the larger spread: the data cannot tell them apart. Among the ratios
that keep the headroom, of those tied with the fastest, the recommendation is the one needing the least device
memory (then the smaller ratio): the same timings give the same answer.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from chunks import fits
from gemini.tools.summary import gib, readable_unit
from offload import format_size

__all__ = ["MarginTrial", "MarginTuning", "Measurement", "RatioResult", "fits_headroom", "limit_bytes", "recommend",
           "summarize", "tied_fastest"]


@dataclass(kw_only=True)
class Measurement:
    """What a trial's steps say about its ratio: its step time (s), the device's measured peak and (when known) the
    device memory the step needs (see [Note: needed memory, not the measured peak] in gemini/tools/tune.py)."""

    step_seconds: float
    device_peak_bytes: int
    needed_bytes: int | None = None

    def __post_init__(self) -> None:
        seconds, peak = self.step_seconds, self.device_peak_bytes
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
            raise ValueError(f"Measurement.step_seconds={seconds!r} is invalid: expected a finite number >= 0")
        for name, value in (("device_peak_bytes", peak), ("needed_bytes", self.needed_bytes)):
            if value is None and name == "needed_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Measurement.{name}={value!r} is invalid: expected an int >= 0")


@dataclass(kw_only=True)
class MarginTrial:
    """One run of one ratio: its measurement, or the error that stopped it."""

    ratio: float
    os_chunks_on_device: int | None  # optimizer-state chunk groups the margin took
    os_chunks_total: int | None
    step_seconds: float | None
    device_peak_bytes: int | None  # measured (under auto: the budget filled with cached chunks)
    needed_bytes: int | None = None  # planned peak + pinned groups + reserve; None when not known
    round: int = 0
    host_peak_bytes: int | None = None  # the trial process's peak RSS, when it ran in its own
    error: str | None = None  # e.g. a DeviceBudgetError: the ratio does not fit at all

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass(kw_only=True)
class RatioResult:
    """A ratio over its rounds: median step time and its spread, and its memory."""

    ratio: float
    seconds: list[float]  # one per successful trial
    needed_bytes: int | None  # the most any trial needed
    device_peak_bytes: int | None  # the highest measured peak
    os_chunks_on_device: int | None = None
    os_chunks_total: int | None = None
    error: str | None = None  # the first error, when no trial succeeded

    @property
    def failed(self) -> bool:
        return not self.seconds

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def low(self) -> float:
        return min(self.seconds)

    @property
    def high(self) -> float:
        return max(self.seconds)

    @property
    def spread(self) -> float:
        return self.high - self.low

    @property
    def memory_bytes(self) -> int:
        """The memory the headroom is judged on: needed when known, else the measured peak."""
        return self.needed_bytes if self.needed_bytes is not None else self.device_peak_bytes

    def tied_with(self, other: RatioResult) -> bool:
        """Within noise of ``other``: overlapping ranges, or medians closer than the larger spread."""
        overlap = self.low <= other.high and other.low <= self.high
        return overlap or abs(self.median - other.median) < max(self.spread, other.spread)


def summarize(trials: Sequence[MarginTrial]) -> list[RatioResult]:
    """Per ratio (in order of first appearance): its trials' times, the most memory any needed."""
    by_ratio: dict[float, list[MarginTrial]] = {}
    for t in trials:
        by_ratio.setdefault(t.ratio, []).append(t)
    out = []
    for ratio, ts in by_ratio.items():
        ok = [t for t in ts if not t.failed]
        needed = [t.needed_bytes for t in ok if t.needed_bytes is not None]
        out.append(RatioResult(
            ratio=ratio, seconds=[t.step_seconds for t in ok],
            needed_bytes=max(needed) if needed else None,
            device_peak_bytes=max((t.device_peak_bytes for t in ok), default=None),
            os_chunks_on_device=ok[-1].os_chunks_on_device if ok else None,
            os_chunks_total=ok[-1].os_chunks_total if ok else None,
            error=None if ok else next((t.error for t in ts if t.failed), None)))
    return out


def fits_headroom(result: RatioResult, limit_bytes: int) -> bool:
    return not result.failed and fits(limit_bytes, result.memory_bytes)


def tied_fastest(results: Sequence[RatioResult], *, limit_bytes: int) -> list[RatioResult]:
    """The ratios within headroom that are tied with the fastest of them (see [Note: timing within noise])."""
    fitting = [r for r in results if fits_headroom(r, limit_bytes)]
    if not fitting:
        return []
    fastest = min(fitting, key=lambda r: (r.median, r.ratio))
    return [r for r in fitting if r is fastest or r.tied_with(fastest)]


def recommend(results: Sequence[RatioResult], *, limit_bytes: int) -> float | None:
    """Of the ratios within headroom tied with the fastest, the one needing the least device memory (then the smaller
    ratio); None when no ratio keeps the headroom. Pure: the same results give the same answer."""
    tied = tied_fastest(results, limit_bytes=limit_bytes)
    if not tied:
        return None
    return min(tied, key=lambda r: (r.memory_bytes, r.ratio)).ratio


@dataclass(kw_only=True)
class MarginTuning:
    """Every trial, per-ratio results, and the recommended ratio (None when no ratio kept the headroom)."""

    trials: list[MarginTrial]
    budget_bytes: int
    headroom_fraction: float
    recommended_ratio: float | None
    results: list[RatioResult] = dataclasses.field(default_factory=list)
    host_peak_bytes: int | None = None  # this process's peak RSS over the tuning
    trial_host_peak_bytes: int | None = None  # the largest trial process's peak RSS (isolated trials)

    def __post_init__(self) -> None:
        if not self.results:
            self.results = summarize(self.trials)

    @property
    def limit_bytes(self) -> int:
        """The most device memory a ratio may need and keep the headroom."""
        return limit_bytes(self.budget_bytes, self.headroom_fraction)

    def table(self) -> str:
        """Per ratio: optimizer-state chunks on the device, median step time and its min–max over the rounds, needed
        memory and measured peak; ``*`` marks the pick, ``~`` the ratios within noise of the fastest."""
        unit = readable_unit(self.budget_bytes)[0]
        tied = {r.ratio for r in tied_fastest(self.results, limit_bytes=self.limit_bytes)}

        def size(n: int | None) -> str:
            return "-" if n is None else f"{gib(n, unit)} {unit} ({100 * n / self.budget_bytes:.0f}%)"

        header = (f"  {'ratio':>5}  {'OS chunks':>9}  {'median':>8}  {'min-max (s/step)':>16}  {'needed':>21}  "
                  f"{'measured peak':>21}  within headroom")
        rows = [header]
        for r in self.results:
            mark = "*" if r.ratio == self.recommended_ratio else ("~" if r.ratio in tied else " ")
            if r.failed:
                rows.append(f"{mark} {r.ratio:5.2f}  {'-':>9}  {'-':>8}  {'-':>16}  {'-':>21}  {'-':>21}  "
                            f"failed: {(r.error or '').splitlines()[0] if r.error else ''}")
                continue
            chunks = f"{r.os_chunks_on_device}/{r.os_chunks_total}"
            spread = f"{r.low:.3f}-{r.high:.3f}"
            ok = "yes" if fits_headroom(r, self.limit_bytes) else "no"
            rows.append(f"{mark} {r.ratio:5.2f}  {chunks:>9}  {r.median:7.3f}s  {spread:>16}  "
                        f"{size(r.needed_bytes):>21}  {size(r.device_peak_bytes):>21}  {ok}")
        return "\n".join(rows)

    def recommendation(self) -> str:
        limit = (f"needing <= {format_size(self.limit_bytes)}: the {format_size(self.budget_bytes)} budget less "
                 f"{100 * self.headroom_fraction:.0f}% headroom")
        if self.recommended_ratio is None:
            return (f"no ratio kept {limit}; raise device_memory, lower the batch or use activation "
                    f"checkpointing, or accept less headroom")
        tied = tied_fastest(self.results, limit_bytes=self.limit_bytes)
        why = ("the fastest" if len(tied) == 1 else
               f"the least device memory of {len(tied)} ratios tied within noise with the fastest")
        return f"recommended: gpu_margin_mem_ratio={self.recommended_ratio:g} ({why}, {limit})"

    def host_memory(self) -> str:
        """One line: the host memory the tuning took."""
        parts = []
        if self.host_peak_bytes is not None:
            parts.append(f"this process {format_size(self.host_peak_bytes)}")
        if self.trial_host_peak_bytes is not None:
            parts.append(f"largest trial process {format_size(self.trial_host_peak_bytes)}")
        return "host memory peak: " + (", ".join(parts) if parts else "not measured")


def limit_bytes(budget_bytes: int, headroom_fraction: float) -> int:
    return int(budget_bytes * (1.0 - headroom_fraction))
