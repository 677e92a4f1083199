"""Whether an evaluation forward runs beside the margin's optimizer states (auto).

[Note: an evaluation beside the margin]
Under auto, ``gpu_margin_mem_ratio`` of the room the warm-up's peak left holds whole chunk groups
on the device for good (parameters, gradients, fp32 masters, Adam's m and v), sized by the
training iteration the warm-up traced. An evaluation forward between steps on larger inputs (a
validation batch larger than training's: it saves no activations, and users size it so) needed
more than that room and was refused ("this evaluation forward (without gradients) needed ...
bytes"), though the same forward fitted under ratio 0: only the step reads those states. So such
a forward lends it the margin: the margin's groups go to the host before it begins, and come back
at the next training forward (or step). A forward on inputs the plan's traced inputs cover runs
beside them (without gradients it holds no more than the traced iteration did); on other inputs
it borrows the room, and its peak is kept: the next evaluation on the same inputs runs beside
the margin if that peak plus the margin's bytes fit the budget. One that overran the budget
beside the margin borrows next time. The price: the margin's groups cross to the host and back
once per evaluation phase that borrows (``generate()``'s forwards, one per token, borrow once).
Nothing is lent with an NVMe tier (host memory may lack room for the margin's states) or under
ZeRO (where groups are gathered, a group's place decides collectives, and ranks evaluate inputs
of their own).
"""

from __future__ import annotations

from tracer import InputSignature
from tracer.signature import KEPT_PLANS

__all__ = ["EvaluationRoom"]


class EvaluationRoom:
    """The evaluation inputs measured so far, each with its peak while the margin was lent
    (``None``: it overran the budget beside the margin), the last :data:`KEPT_PLANS` of them."""

    def __init__(self, capacity: int = KEPT_PLANS) -> None:
        self._peaks: list[tuple[InputSignature, int | None]] = []
        self._capacity = capacity

    def borrows(self, signature: InputSignature, *, traced: InputSignature | None, margin_bytes: int,
                budget_bytes: int) -> bool:
        """Whether an evaluation forward on ``signature`` needs the margin's room (``traced``: the
        inputs of the plan in force)."""
        known = [peak for s, peak in self._peaks if s == signature]
        if known:
            return known[0] is None or known[0] + margin_bytes > budget_bytes
        return traced is None or not traced.covers(signature)

    def measured(self, signature: InputSignature, peak_bytes: int | None) -> None:
        """An evaluation forward on ``signature`` ran: its peak with the margin lent, or ``None``
        where it overran the budget beside the margin."""
        self._peaks = [(s, p) for s, p in self._peaks if s != signature] + [(signature, peak_bytes)]
        del self._peaks[:-self._capacity]
