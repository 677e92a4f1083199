"""One period of a traced iteration: the meter that accumulates it while it runs, and the
record the trace keeps of it (see :mod:`tracer.runtime`)."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.hooks import Boundary, Phase

__all__ = ["PeriodMeter", "PeriodRecord"]


@dataclass(frozen=True, kw_only=True)
class PeriodRecord:
    """One period of the traced iteration.

    ``non_model_peak_bytes`` is the most the device held besides model data at any time in
    the period; ``model_bytes`` is the model data subtracted at that time and
    ``peak_bytes`` the device's peak over the whole period (so, in a period without model
    data moves, ``non_model_peak_bytes == peak_bytes - model_bytes``).
    """

    index: int
    phase: Phase
    module_name: str
    peak_bytes: int
    model_bytes: int
    non_model_peak_bytes: int
    chunk_ids: tuple[int, ...]
    # The non-model peak of each segment of the period: segment 0 from its boundary to the
    # first ``mark()``, segment k from mark k on (see [Note: segments of a period] in tracer/runtime.py); their
    # maximum is ``non_model_peak_bytes``. Empty: one segment.
    segment_non_model_peak_bytes: tuple[int, ...] = ()
    # Per segment, the most model data held on the device during it: a later iteration that
    # holds no more chunks at that point needs no more than their sum.
    segment_model_bytes: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[Phase, str]:
        """What the engine's own boundary hooks see at this period's start."""
        return (self.phase, self.module_name)


# [Note: subtracting model data]
# The monitor sees all bytes; only the engine knows which are model data (chunks resident on
# the device), and it can only be asked now and then, not at the instant of each peak. So a
# period is cut into intervals at every model-data move the engine announces with
# RuntimeTracer.model_data_move(), and each interval subtracts a model figure that held during it:
# - between moves model data is constant, if every move is announced: subtract it. Should a
#   move go unannounced, the interval's two ends differ, and the smaller one is subtracted,
#   which can only overstate non-model data (the safe side: an estimate too low is what made
#   peers' auto placement run out of memory where it had promised not to);
# - during a move (allocate on one side, copy, free the other) the moving bytes are model
#   data as soon as they are allocated, so the larger end is subtracted. The move window
#   holds nothing but the move when moves are synchronous, as they are during warm-up.
# The period's non-model peak is the largest interval's; the peak itself is reset at each
# cut. The prologue (from trace() until the first boundary) is folded into the first period.


class PeriodMeter:
    """Accumulates one period: peaks of its intervals, model bytes, chunks used."""

    def __init__(self, *, model_bytes_at_start: int) -> None:
        self.boundary: Boundary | None = None
        self.peak_bytes = 0
        self.model_bytes = model_bytes_at_start
        self.non_model_peak_bytes: int | None = None
        self.segment_peaks: list[int | None] = [None]  # the current segment last
        self.segment_model: list[int] = [model_bytes_at_start]
        self._interval_model_bytes = model_bytes_at_start
        self._chunk_ids: dict[int, None] = {}  # an ordered set: first access first

    def add_chunk(self, chunk_id: int) -> None:
        self._chunk_ids.setdefault(chunk_id, None)

    def close_interval(self, *, peak_bytes: int, model_bytes_now: int, moving: bool) -> None:
        lo, hi = sorted((self._interval_model_bytes, model_bytes_now))
        subtracted = hi if moving else lo
        non_model = peak_bytes - subtracted
        self.peak_bytes = max(self.peak_bytes, peak_bytes)
        if self.non_model_peak_bytes is None or non_model > self.non_model_peak_bytes:
            self.non_model_peak_bytes = non_model
            self.model_bytes = subtracted
        current = self.segment_peaks[-1]
        self.segment_peaks[-1] = non_model if current is None else max(current, non_model)
        self.segment_model[-1] = max(self.segment_model[-1], hi)
        self._interval_model_bytes = model_bytes_now

    def new_segment(self) -> None:
        self.segment_peaks.append(None)
        self.segment_model.append(self._interval_model_bytes)

    @property
    def chunk_ids(self) -> tuple[int, ...]:
        return tuple(self._chunk_ids)

    def record(self, *, index: int, non_model_peak_bytes: int) -> PeriodRecord:
        """The closed period as the trace keeps it (``non_model_peak_bytes`` as clamped)."""
        assert self.boundary is not None, "closing a period that never began"
        return PeriodRecord(
            index=index,
            phase=self.boundary.phase,
            module_name=self.boundary.module_name,
            peak_bytes=self.peak_bytes,
            model_bytes=self.model_bytes,
            non_model_peak_bytes=non_model_peak_bytes,
            chunk_ids=self.chunk_ids,
            # A segment that closed no interval (two marks in a row) saw nothing new: its start
            # is the previous one's end, so it inherits that peak (the safe side).
            segment_non_model_peak_bytes=_segment_peaks(self.segment_peaks, non_model_peak_bytes),
            segment_model_bytes=tuple(self.segment_model),
        )


def _segment_peaks(peaks: list[int | None], period_peak: int) -> tuple[int, ...]:
    """Per segment, its peak (clamped like the period's to [0, the period's peak])."""
    out, last = [], period_peak
    for p in peaks:
        last = last if p is None else max(0, min(p, period_peak))
        out.append(last)
    return tuple(out)
