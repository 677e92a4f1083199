"""Whether an evaluation forward runs beside the margin's optimizer states (auto).

[Note: an evaluation beside the margin]
Under auto, ``gpu_margin_mem_ratio`` of the room the warm-up's peak left keeps whole chunk groups on the device
(parameters, gradients, fp32 masters, Adam's m and v), sized by the traced training iteration. Only the step reads
those states, so an evaluation forward between steps on inputs the traced ones do not cover (a larger validation
batch) borrows the margin's room: its groups go to the host before the forward and come back at the next training
forward (or step). A forward on covered inputs runs beside the margin (without gradients it holds no more than the
traced iteration). A borrowing forward's peak is kept: the next evaluation on the same inputs runs beside the
margin if that peak plus the margin's bytes fit the budget; one that overran the budget beside it borrows next
time. Cost: the margin's groups cross to the host and back once per borrowing evaluation phase (``generate()``'s
per-token forwards borrow once). Nothing is lent with an NVMe tier (host memory may lack room for the margin's
states) or under ZeRO (groups are gathered, a group's place decides collectives, ranks evaluate their own inputs).
"""

from __future__ import annotations

from tracer import InputSignature
from tracer.signature import KEPT_PLANS

__all__ = ["EvaluationRoom"]


class EvaluationRoom:
    """The last :data:`KEPT_PLANS` evaluation inputs measured, each with its peak while the margin was lent
    (``None``: it overran the budget beside the margin)."""

    def __init__(self, capacity: int = KEPT_PLANS) -> None:
        self._peaks: list[tuple[InputSignature, int | None]] = []
        self._capacity = capacity

    def borrows(self, signature: InputSignature, *, traced: InputSignature | None, margin_bytes: int,
                budget_bytes: int) -> bool:
        """Whether an evaluation forward on ``signature`` needs the margin's room (``traced``: the inputs of the
        plan in force)."""
        known = [peak for s, peak in self._peaks if s == signature]
        if known:
            return known[0] is None or known[0] + margin_bytes > budget_bytes
        return traced is None or not traced.covers(signature)

    def measured(self, signature: InputSignature, peak_bytes: int | None) -> None:
        """Record an evaluation forward on ``signature``: its peak with the margin lent, or ``None`` where it
        overran the budget beside the margin."""
        self._peaks = [(s, p) for s, p in self._peaks if s != signature] + [(signature, peak_bytes)]
        del self._peaks[:-self._capacity]
