"""`HeldInterrupt`: Ctrl-C held back while an optimizer step cannot be undone.

[Note: Ctrl-C during the in-memory update]
Phase 3 of a step ([Note: a step is all or nothing] in gemini/engine/transaction.py) updates the
groups in memory with several fused Adam calls, in place. Nothing in it allocates or does I/O,
so no error can stop it part-way, but a KeyboardInterrupt can: Python raises it between any two
bytecodes of the main thread, and after some calls have run and others have not, some groups
are stepped and others not; a retry would step the first ones twice.

Undoing the phase would need a copy of every parameter, m, v and step count it changes, each
step: host memory and a copy's time per step for an event that almost never comes. Instead,
from the first Adam call of phase 3 to the end of ``step()``, a SIGINT is only recorded (a
handler of our own replaces the one in force, on the main thread, where Python runs signal
handlers), and once the step has fully landed (committed, gathered, reported) the previous
handler is put back and called with the recorded signal (the default one: a KeyboardInterrupt
saying that the step was completed). So Ctrl-C during a step either finds it in phases 1-2 (raised at
once, the step undone: parameters and states as before it) or in phase 3 and after (raised
as ``step()`` returns, the step complete: as if it came just after). Never half a step.

[Note: Ctrl-C during an undo]
Undoing a failed step or load (``StepTransaction.rollback``) writes the copies aside back, reads
those kept in files and puts the held files back. A second Ctrl-C (the first one failed the
step) raised in the middle of it left the groups it had not reached yet with the failed step's
values, and said nothing: the retry then trained on them (50% off the uninterrupted run after a
step). So the undo holds SIGINT too, and delivers it once everything is back.

Cost: reading and setting the SIGINT handler twice per step (about a microsecond each), and
only in steps with groups updated in memory. Off the main thread nothing is installed: Python
delivers signals to the main thread only, so a step on another thread is never interrupted.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["HeldInterrupt"]


class HeldInterrupt:
    """Records SIGINT between :meth:`hold` and :meth:`release`, then delivers it (see [Note:
    Ctrl-C during the in-memory update])."""

    _COMPLETED = ("received during optimizer.step() once its update had begun: the step was completed first "
                  "(do not repeat it)")

    def __init__(self, *, said: str = _COMPLETED) -> None:
        self._said = said  # the KeyboardInterrupt's message, under the default handler
        self._previous = None  # the handler in force before hold(), while holding
        self._received: tuple[int, FrameType | None] | None = None

    def hold(self) -> None:
        """From now on a SIGINT waits for :meth:`release` (no-op off the main thread, when already
        holding, or when the handler in force is not a Python function: SIG_IGN ignores it
        anyway, SIG_DFL kills the process either way)."""
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
        """Put the previous handler back; if a SIGINT came meanwhile, call it now (the default
        handler raises KeyboardInterrupt here), unless not ``deliver`` (an error is on its way
        out already)."""
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
