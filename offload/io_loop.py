"""An asyncio event loop on a background thread, with a bounded pool for blocking I/O calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from typing import Any, Coroutine, TypeVar

__all__ = ["IoLoopThread"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _record_ident(idents: set[int]) -> None:
    idents.add(threading.get_ident())


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


class IoLoopThread:
    """Owns one event loop thread, the executor its blocking I/O calls run on, and a CPU pool.

    The loop's default executor is the bounded pool, so aiofiles (which runs every file
    operation through ``loop.run_in_executor(None, ...)``) uses these ``max_workers``
    threads and no others. Holds no reference to whoever submits work, so an owner can be
    garbage-collected while the thread idles.
    """

    def __init__(self, *, name: str, max_workers: int, cpu_workers: int | None = None) -> None:
        self._worker_idents: set[int] = set()
        # Worker idents let stop() know when it runs on a worker (a finalizer can fire there),
        # where joining the pool would join the current thread.
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix=f"{name}-io",
            initializer=_record_ident, initargs=(self._worker_idents,))
        # CPU-bound helpers (checksums) get their own threads, so they never occupy an I/O one.
        self.cpu_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=cpu_workers or min(4, os.cpu_count() or 1), thread_name_prefix=f"{name}-cpu",
            initializer=_record_ident, initargs=(self._worker_idents,))
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(self.executor)
        self._thread = threading.Thread(target=_run_forever, args=(self.loop,), name=f"{name}-loop",
                                        daemon=True)
        self._thread.start()
        self._stopped = False

    def submit(self, coro: Coroutine[Any, Any, T]) -> "concurrent.futures.Future[T]":
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def on_own_thread(self) -> bool:
        return self.on_loop_thread() or threading.get_ident() in self._worker_idents

    def stop(self) -> None:
        """Stop the loop and the workers; waits for them unless called from one of them."""
        if self._stopped:
            return
        self._stopped = True
        own = self.on_own_thread()
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # closed between the check and the call
                pass
        if not own:
            self._thread.join()
        self.executor.shutdown(wait=not own)
        self.cpu_executor.shutdown(wait=not own)
