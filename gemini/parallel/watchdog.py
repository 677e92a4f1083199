"""`Watchdog`: a warning when this rank has waited long in one of gemini's collectives.

[Note: a collective some ranks never call]
Under ZeRO, ``state_dict()``, ``load_state_dict()``, ``step()``, the checkpoints and (with ``shard_params=True``)
every forward are collectives that every rank must call. Code written for DDP may call one on one rank only (``if rank
== 0: torch.save(optimizer.state_dict(), f)``); that rank then waits silently inside the backend until its timeout (30
minutes on gloo), and the others at their next collective. gemini cannot end that wait (it is in C++, GIL released),
but it can name it: a daemon thread per process group looks every few seconds and, once a wait has lasted
``GEMINI_COLLECTIVE_WARN_SECONDS`` (default 60), logs one warning naming the user's line. A wait costs a few
attribute writes. On NCCL the host does not wait in the collective (the stream does), so the warning comes only where
gemini blocks on a result; NCCL's own watchdog ends the rest.
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import os
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Iterator

import torch

import chunks
import offload
import tracer

logger = logging.getLogger(__name__)

__all__ = ["Watchdog"]

WARN_ENV = "GEMINI_COLLECTIVE_WARN_SECONDS"

# Frames inside these are not the user's line (gemini, its packages, torch, the standard library).
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (
    os.path.dirname(__file__), chunks.__file__, offload.__file__, tracer.__file__, torch.__file__,
)) + (os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,)


def warn_after_seconds() -> float:
    """``GEMINI_COLLECTIVE_WARN_SECONDS``, or 60."""
    value = os.environ.get(WARN_ENV, "60")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{WARN_ENV}={value!r} is invalid: expected a number of seconds > 0 (unset means 60)")
    return seconds


class Watchdog:
    """Watches one rank's waits in its process group's collectives (see [Note: a collective some ranks never call]);
    ``waiting(what)`` brackets each wait."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.warn_after = warn_after_seconds()
        self._since: float | None = None  # when the wait in progress began (None: none is)
        self._what = ""
        self._thread_id = 0
        self._warned_for: float | None = None
        self._thread: threading.Thread | None = None  # started at the first wait

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        if self._thread is None:
            self._start()
        outer = self._since is not None  # a wait inside another: the outer one's start counts
        if not outer:
            self._what, self._thread_id, self._since = what, threading.get_ident(), time.monotonic()
        try:
            yield
        finally:
            if not outer:
                self._since = None

    def _start(self) -> None:
        stop = threading.Event()
        self._thread = threading.Thread(target=_watch, args=(weakref.ref(self), stop, min(5.0, self.warn_after / 4)),
                                        name=f"gemini-collective-watchdog-rank{self.rank}", daemon=True)
        weakref.finalize(self, stop.set)  # the thread ends with the process group's engine
        self._thread.start()

    def check(self) -> None:
        """Warn once about the wait in progress if it has lasted ``warn_after`` seconds."""
        since = self._since
        if since is None or since == self._warned_for or time.monotonic() - since < self.warn_after:
            return
        self._warned_for = since
        logger.warning(
            "rank %d of %d has waited %.0f s in gemini's %s, called from %s. Under ZeRO this is a collective: every "
            "rank of the process group must call it (state_dict(), load_state_dict(), step(), checkpoints and, with "
            "shard_params=True, every forward); called on some ranks only (`if rank == 0:` around it), it waits until "
            "the backend's timeout. Still waiting.",
            self.rank, self.world, time.monotonic() - since, self._what, _user_line(self._thread_id))


def _watch(ref: weakref.ref, stop: threading.Event, period: float) -> None:
    while not stop.wait(period):
        dog = ref()
        if dog is None:
            return
        dog.check()
        del dog  # not kept alive between looks


def _user_line(thread_id: int) -> str:
    """The innermost frame of ``thread_id`` outside the libraries: ``file:line in function: code``."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame = frame.f_back
    if frame is None:
        return "a frame inside the libraries"
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}" + (f": {line}" if line else "")
