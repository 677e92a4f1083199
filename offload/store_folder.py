"""A store's private folder over its life: ``nvme_dir`` checked, the folder made and locked,
and the folder removed when the store is done with it (close, garbage collection, interpreter
exit, SIGTERM, SIGHUP). Folders of other runs are offload/stale.py's business."""

from __future__ import annotations

import errno as errno_codes
import itertools
import logging
import os
import shutil
import signal
import stat
import sys
import threading
import weakref

from offload.errors import DISK_FULL, NvmeStoreError, disk_full_error
from offload.io_loop import IoLoopThread
from offload.stale import make_private_folder

__all__ = ["check_nvme_dir", "default_rank", "make_store_folder", "register_cleanup", "shutdown"]

# The store's messages keep the logger they had when it was one module.
logger = logging.getLogger("offload.nvme_store")


def check_nvme_dir(nvme_dir: str) -> None:
    try:
        st = os.stat(nvme_dir)
    except FileNotFoundError as exc:
        raise NvmeStoreError(
            f"nvme_dir {nvme_dir!r} does not exist; create it (or mount the drive) first",
            path=nvme_dir, operation="open nvme_dir", errno=exc.errno) from exc
    except NotADirectoryError as exc:
        raise NvmeStoreError(
            f"nvme_dir {nvme_dir!r} is not a directory: a component of the path is a file",
            path=nvme_dir, operation="open nvme_dir", errno=exc.errno) from exc
    except OSError as exc:
        raise NvmeStoreError(f"nvme_dir {nvme_dir!r} cannot be examined: {exc.strerror}",
                             path=nvme_dir, operation="open nvme_dir", errno=exc.errno) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise NvmeStoreError(f"nvme_dir {nvme_dir!r} is not a directory", path=nvme_dir,
                             operation="open nvme_dir", errno=errno_codes.ENOTDIR)
    if not os.access(nvme_dir, os.W_OK | os.X_OK):
        raise NvmeStoreError(f"nvme_dir {nvme_dir!r} is not writable by this process", path=nvme_dir,
                             operation="open nvme_dir", errno=errno_codes.EACCES)


def default_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def make_store_folder(nvme_dir: str, *, rank: int) -> tuple[str, int | None]:
    """The store's private folder under ``nvme_dir`` and the descriptor holding its lock
    (see offload/stale.py); failures are NvmeStoreErrors."""
    try:
        return make_private_folder(nvme_dir, rank=rank)
    except OSError as exc:
        if exc.errno in DISK_FULL:
            raise disk_full_error(exc, folder=nvme_dir, doing="creating the store's folder",
                                  operation="create folder") from exc
        raise NvmeStoreError(
            f"cannot create the store's folder in nvme_dir {nvme_dir!r}:"
            f" [Errno {exc.errno}] {exc.strerror}",
            path=nvme_dir, operation="create folder", errno=exc.errno) from exc


def register_cleanup(owner: object, io: IoLoopThread, folder: str, lock_fd: int | None) -> weakref.finalize:
    """The finalizer that stops ``owner``'s I/O threads and removes its folder: run by close(),
    at garbage collection, at exit and on SIGTERM or SIGHUP (see [Note: SIGTERM])."""
    key = next(_finalizer_keys)
    finalizer = weakref.finalize(owner, shutdown, io, folder, os.getpid(), lock_fd, key)
    _live_finalizers[key] = finalizer
    _install_signal_handlers()
    return finalizer


def shutdown(io: IoLoopThread | None, folder: str, owner_pid: int, lock_fd: int | None, key: int) -> None:
    """Stop the I/O threads, delete the folder and release its lock; the finalizer, so it
    must not touch the store."""
    _live_finalizers.pop(key, None)
    if os.getpid() != owner_pid:
        # A forked child (a DataLoader worker) dropping its copy of the store: the files and
        # the loop belong to the parent, which is still using them. Closing the child's copy
        # of the descriptor leaves the parent's lock held (flock(LOCK_UN) would not).
        if lock_fd is not None:
            os.close(lock_fd)
        return
    if io is not None:
        io.stop()
    _remove_folder(folder)
    if lock_fd is not None:
        os.close(lock_fd)  # only now may a sweep take the folder: it is gone


# [Note: SIGTERM]
# weakref.finalize runs the finalizers at a normal exit, after an uncaught exception and
# after sys.exit, but SIGTERM's default action ends the process without running them, and
# SIGTERM is how schedulers, `docker stop` and `kill` end a job; SIGHUP's likewise, sent when
# the terminal or ssh session a run was started from closes. So the first store made on the
# main thread (only there can Python set a handler) installs ``_on_ending_signal`` for both,
# which chains to the handler it replaced:
# - SIG_DFL (Python's own default for both): remove every live store's folder, restore
#   SIG_DFL and send the signal again, so the process still dies of it (exit status -15 or -1,
#   as its parent expects).
# - a Python handler: call it and nothing else. It may end the process (sys.exit: the
#   finalizers then run at exit) or note the signal and let training finish and save a
#   checkpoint, which needs the stores' files, so they must not be deleted under it.
# - SIG_IGN (``nohup`` sets it for SIGHUP), or a handler set from C (getsignal() gives None,
#   nothing we could chain to): no handler is installed; the process survives the signal, or
#   is not ours to handle.
# The handler stays after the last store closes; with no live store it only chains.
_live_finalizers: dict[int, weakref.finalize] = {}
_finalizer_keys = itertools.count()
_ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
_previous_handlers: dict[int, object] = {}  # signal -> the handler ours replaced


def _on_ending_signal(signum: int, frame: object) -> None:
    previous = _previous_handlers.get(signum)
    if callable(previous):
        previous(signum, frame)
        return
    for finalizer in list(_live_finalizers.values()):
        try:
            finalizer()
        except Exception:  # the process is ending: one store's failure must not keep the others' files
            logger.exception("cleaning up an NVMe store on signal %d failed", signum)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal would raise; a later store made on the main thread installs it
    for signum in _ENDING_SIGNALS:
        current = signal.getsignal(signum)
        if current is _on_ending_signal or current is signal.SIG_IGN or current is None:
            continue
        _previous_handlers[signum] = current
        signal.signal(signum, _on_ending_signal)


def _remove_folder(folder: str) -> None:
    def report(_function, path, exc) -> None:
        if not isinstance(exc, FileNotFoundError):
            logger.warning("could not remove %s of the NVMe store: %s", path, exc)

    if sys.version_info >= (3, 12):
        shutil.rmtree(folder, onexc=report)
    else:
        shutil.rmtree(folder, onerror=lambda function, path, info: report(function, path, info[1]))
