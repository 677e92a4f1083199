"""`HeldInterrupt`: Ctrl-C held back while an optimizer step cannot be undone.

[Note: Ctrl-C during the in-memory update]
Phase 3 of a step ([Note: a step is all or nothing] in gemini/engine/transaction.py) updates the groups in memory
in place with several fused Adam calls. Nothing in it allocates or does I/O, so no error stops it part-way, but a
KeyboardInterrupt can arrive between any two bytecodes of the main thread, leaving some groups stepped and others
not (a retry would step the first ones twice); undoing the phase would need a copy of every parameter, m, v and
step count each step. Instead, from the first Adam call of phase 3 to the end of ``step()``, a handler of our own
(on the main thread, where Python runs signal handlers) only records a SIGINT; once the step has landed
(committed, gathered, reported) the previous handler is put back and called with it (the default one raises a
KeyboardInterrupt saying the step was completed). So Ctrl-C raises either in phases 1-2 with the step undone, or
as ``step()`` returns with the step complete: never half a step.

[Note: Ctrl-C during an undo]
Undoing a failed step or load (``StepTransaction.rollback``) writes the copies aside back, reads those kept in
files and puts the held files back. A second Ctrl-C in the middle of it would leave the groups not yet reached
with the failed step's values, silently, and a retry would train on them. So the undo holds SIGINT too, and
delivers it once everything is back.

Cost: reading and setting the SIGINT handler twice per step (about a microsecond each), only in steps with groups
updated in memory. Off the main thread nothing is installed: Python delivers signals to the main thread only.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["HeldInterrupt"]


class HeldInterrupt:
    """Holds SIGINT back from :meth:`hold` to :meth:`release` ([Note: Ctrl-C during the in-memory update])."""

    _COMPLETED = ("received during optimizer.step() once its update had begun: the step was completed first "
                  "(do not repeat it)")

    def __init__(self, *, said: str = _COMPLETED) -> None:
        self._said = said  # the KeyboardInterrupt's message, under the default handler
        self._previous = None  # the handler in force before hold(), while holding
        self._received: tuple[int, FrameType | None] | None = None

    def hold(self) -> None:
        """From now on a SIGINT waits for :meth:`release` (no-op off the main thread, when already holding, or
        when the handler in force is not a Python function: SIG_IGN ignores it anyway, SIG_DFL kills either way)."""
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):
            return
        self._previous = previous
        signal.signal(signal.SIGINT, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._received = (signum, frame)

    def release(self, *, deliver: bool = True) -> None:
        """Put the previous handler back and call it on a SIGINT that came meanwhile (the default handler raises
        KeyboardInterrupt here), unless not ``deliver`` (an error is on its way out already)."""
        previous, self._previous = self._previous, None
        if previous is None:
            return
        signal.signal(signal.SIGINT, previous)
        received, self._received = self._received, None
        if received is None or not deliver:
            return
        if previous is signal.default_int_handler:
            raise KeyboardInterrupt(self._said)
        previous(*received)
