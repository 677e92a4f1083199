"""`MemoryPlan`: what the warm-up iteration measured, in the form placement decisions need."""

from __future__ import annotations

from dataclasses import dataclass

from gemini.report import TimelinePeriod, WarmupTimeline
from tracer import AccessOrder, PeriodRecord, Phase

__all__ = ["MemoryPlan"]


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Per-period non-model peaks and chunk-group access order of one traced iteration.

    Period i of a later iteration is the i-th period boundary after the root module's own
    forward pre-hook (the root's boundary itself is folded into the first period, see
    :meth:`from_trace`).
    """

    keys: tuple[tuple[Phase, str], ...]  # (phase, module name) starting each period
    non_model_bytes: tuple[int, ...]  # per period: peak device bytes besides model data
    # per period: the peak of each segment between marks (see [Note: segments of a period] in
    # tracer/runtime.py); a decision at the period's k-th mark is charged the k-th
    segment_non_model_bytes: tuple[tuple[int, ...], ...]
    # per period and segment: the most model data the warm-up held on the device then
    segment_model_bytes: tuple[tuple[int, ...], ...]
    access: tuple[tuple[int, ...], ...]  # per period: chunk-group indices used
    order: AccessOrder
    warmup_peak_bytes: int  # the device's measured peak over the warm-up iteration
    warmup_model_peak_bytes: int  # the most chunk bytes the conservative warm-up held at once
    fixed_bytes: int  # device model data outside chunks (buffers)
    reserve_bytes: int
    budget_bytes: int

    @classmethod
    def from_trace(cls, periods: tuple[PeriodRecord, ...], **kwargs) -> MemoryPlan:
        records = list(periods)
        # [Note: the root's period] The root module's forward pre-hook runs before the
        # engine can count boundaries in later iterations (a trace begun inside it misses
        # it), so a root FORWARD period is merged into the next one: the later period then
        # covers both, with the larger non-model peak and both chunk sets. Every one of them:
        # an iteration may run several forwards before its backward.
        keys, non_model, segments, seg_model, access = [], [], [], [], []
        carry: tuple[int, tuple] | None = None  # a root FORWARD period waiting for the next one
        for r in records:
            nm, acc = r.non_model_peak_bytes, tuple(r.chunk_ids)
            segs = list(r.segment_non_model_peak_bytes or (nm,))
            models = list(r.segment_model_bytes or (r.model_bytes,))
            if carry is not None:
                nm, acc = max(carry[0], nm), tuple(dict.fromkeys(carry[1] + acc))
                # The carried period comes before the first mark.
                segs[0], models[0] = max(segs[0], carry[0]), max(models[0], carry[2])
                carry = None
            if r.phase is Phase.FORWARD and r.module_name == "" and r is not records[-1]:
                carry = (nm, acc, max(models))
                continue
            keys.append(r.key)
            non_model.append(nm)
            segments.append(tuple(segs))
            seg_model.append(tuple(models))
            access.append(acc)
        return cls(
            keys=tuple(keys),
            non_model_bytes=tuple(non_model),
            segment_non_model_bytes=tuple(segments),
            segment_model_bytes=tuple(seg_model),
            access=tuple(access),
            order=AccessOrder([list(a) for a in access]),
            **kwargs,
        )

    @property
    def max_non_model_bytes(self) -> int:
        return max(self.non_model_bytes, default=0)

    @property
    def planned_peak_bytes(self) -> int:
        """The most the device needs at any decision of a later iteration that, after evicting
        every chunk not in use, holds what the warm-up held there: per segment, the model data
        the warm-up held plus the segment's non-model peak (never below the measured peak).
        Each is charged at its own decision, so a budget that holds this trains every later
        iteration, not only the warm-up (see [Note: segments of a period])."""
        planned = max((m + n for ms, ns in zip(self.segment_model_bytes, self.segment_non_model_bytes)
                       for m, n in zip(ms, ns)), default=0)
        return max(planned, self.warmup_peak_bytes)

    @property
    def margin_bytes(self) -> int:
        """Budget left after the reserve and the warm-up's planned peak.

        The peak is of everything on the device at one moment (chunks, buffers, non-model
        memory), not a sum of peaks from different moments. It bounds each period of later
        iterations: a period needs its own chunks and non-model memory, which the warm-up held
        at that period too, so optimizer-state groups kept on the device in this margin fit
        next to every period (the eviction policy makes room for the rest).
        """
        return self.budget_bytes - self.reserve_bytes - self.planned_peak_bytes

    def timeline(self) -> WarmupTimeline:
        """The plan as a report shows it: per period, its non-model peak and chunk groups."""
        periods = [
            TimelinePeriod(phase=phase.value, module=module, non_model_bytes=nbytes, chunk_groups=list(groups))
            for (phase, module), nbytes, groups in zip(self.keys, self.non_model_bytes, self.access)
        ]
        return WarmupTimeline(
            periods=periods,
            budget_bytes=self.budget_bytes,
            reserve_bytes=self.reserve_bytes,
            fixed_bytes=self.fixed_bytes,
            warmup_peak_bytes=self.warmup_peak_bytes,
            warmup_model_peak_bytes=self.warmup_model_peak_bytes,
            margin_bytes=self.margin_bytes,
        )
