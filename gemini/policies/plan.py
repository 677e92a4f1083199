"""`MemoryPlan`: what the warm-up iteration measured, in the form placement decisions need."""

from __future__ import annotations

from dataclasses import dataclass

from gemini.report import TimelinePeriod, WarmupTimeline
from tracer import AccessOrder, PeriodRecord, Phase

__all__ = ["MemoryPlan"]


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Per-period non-model peaks and chunk-group access order of one traced iteration.

    Period i of a later iteration begins at its i-th period boundary, the root module's forward the first.
    """

    keys: tuple[tuple[Phase, str], ...]  # (phase, module name) starting each period
    non_model_bytes: tuple[int, ...]  # per period: peak device bytes besides model data
    # per period: the peak of each segment between marks (see [Note: segments of a period] in tracer/runtime.py); a
    # decision at the period's k-th mark is charged the k-th
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
    # ZeRO-3: one chunk group's gathered parameters, which every iteration after the warm-up gathers ahead of their use
    # (the warm-up gathers nothing ahead): see [Note: the warm-up plans the prefetch] in gemini/engine/warmup.py.
    prefetch_bytes: int = 0
    # What else the warm-up found, kept for inputs that come back to the plan ([Note: plans kept per input signature]
    # in tracer/signature.py): the groups its forward read outside their modules (AutoPlacement), and under activation
    # offload the eligible saved tensors' bytes in packing order and the order backward unpacked them.
    read_outside: frozenset[int] = frozenset()
    saved_sizes: tuple[int, ...] | None = None
    saved_unpack_order: tuple[int, ...] = ()

    @classmethod
    def from_trace(cls, periods: tuple[PeriodRecord, ...], **kwargs) -> MemoryPlan:
        # Every boundary of the warm-up, the root's included, is one the engine's hooks announce in later iterations
        # too (see [Note: the root's boundary] in tracer/hooks.py): period i of the trace is period i of each later one.
        return cls(
            keys=tuple(r.key for r in periods),
            non_model_bytes=tuple(r.non_model_peak_bytes for r in periods),
            segment_non_model_bytes=tuple(tuple(r.segment_non_model_peak_bytes or (r.non_model_peak_bytes,))
                                          for r in periods),
            segment_model_bytes=tuple(tuple(r.segment_model_bytes or (r.model_bytes,)) for r in periods),
            access=tuple(tuple(r.chunk_ids) for r in periods),
            order=AccessOrder([list(r.chunk_ids) for r in periods]),
            **kwargs,
        )

    @property
    def max_non_model_bytes(self) -> int:
        return max(self.non_model_bytes, default=0)

    @property
    def planned_peak_bytes(self) -> int:
        """The most the device needs at any decision of a later iteration that, after evicting every chunk not in use,
        holds what the warm-up held there: per segment, the model data the warm-up held plus the segment's non-model
        peak (never below the measured peak). Each is charged at its own decision, so a budget that holds this trains
        every later iteration, not only the warm-up (see [Note: segments of a period]); under ZeRO-3 plus room for the
        group those iterations gather ahead (:attr:`prefetch_bytes`)."""
        planned = max((m + n for ms, ns in zip(self.segment_model_bytes, self.segment_non_model_bytes)
                       for m, n in zip(ms, ns)), default=0)
        return max(planned, self.warmup_peak_bytes) + self.prefetch_bytes

    @property
    def margin_bytes(self) -> int:
        """Budget left after the reserve and the warm-up's planned peak.

        The peak is of everything on the device at one moment (chunks, buffers, non-model memory), not a sum of peaks
        from different moments. It bounds each period of later iterations: a period needs its own chunks and non-model
        memory, which the warm-up held at that period too, so optimizer-state groups kept in this margin fit next to
        every period (eviction makes room for the rest).
        """
        return self.budget_bytes - self.reserve_bytes - self.planned_peak_bytes

    # [Note: an iteration that skips traced periods]
    # A later iteration is matched to the trace period by period, by the (phase, module) that begins each. An input
    # the traced one covers ([Note: plans kept per input signature] in tracer/signature.py) may run fewer periods: an
    # RNN unrolled 3 steps on a plan traced over 6 reaches its head where the trace had the 4th step, and its gradients
    # land in its 3rd cell's backward, which had no marks in the trace. Ending the matching there would charge every
    # later decision the trace's largest non-model peak next to the chunks in use, more than any traced decision held,
    # and fail a budget the larger input trained in (with the margin filled, gpu_margin_mem_ratio=1). So a mismatch
    # continues at the next traced period begun by the same module, and (once the iteration has skipped some) a period
    # with more marks than traced at the next one of the same module that had that many: the skipped periods'
    # activations were in the trace there too, so its peaks bound this iteration's. Only a module the rest of the
    # trace never begins with ends the matching.
    def continues_at(self, period: int, key: tuple[Phase, str], *, marks: int = 0) -> int | None:
        """The first traced period after ``period`` begun by ``key`` with more than ``marks`` marks, where an iteration
        that went off the trace at ``period`` continues (see [Note: an iteration that skips traced periods]); None if
        there is none."""
        return next((i for i in range(period + 1, len(self.keys))
                     if self.keys[i] == key and marks < len(self.segment_non_model_bytes[i])), None)

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
