"""Private per-process folders under ``nvme_dir``, and the detection of ones left by crashes.

A store writes into ``<nvme_dir>/gemini-<pid>-rank<rank>-<random>/``. For its whole life it
holds an exclusive ``flock`` on the folder's ``lock`` file; the kernel drops that lock when
the process dies however it dies (SIGKILL, OOM killer), so "nobody holds the lock" is the
test of a folder left by a crash. The sweep takes the lock itself (non-blocking) before it
deletes a folder and keeps it while deleting, so it never deletes a folder a live store
uses — whatever PID namespace, container or machine that store runs in, as long as the
file system honours ``flock`` across them (local file systems and NFSv4 do).

The ``owner`` file beside it (pid, process start time, host name) is information for a
person looking at the folder. Only for a folder without a ``lock`` file — made by a version
before the lock, which could not tell a live owner in another PID namespace from a dead
one — and on a file system refusing ``flock`` is liveness judged from it, as before: the
folder is stale when, on this host, its pid is not running or now belongs to a process
started at another time.

The lock lives as long as any descriptor of it: a child forked by the store's process (a
DataLoader worker) that outlives a crash keeps the folder "in use" until it ends too. A
crash in the microseconds between making a folder and renaming it to its final name leaves
a ``.gemini-*.new`` folder of two tiny files, which no sweep touches.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import re
import secrets
import shutil
import socket

import psutil

__all__ = ["StaleFolder", "make_private_folder", "find_stale_folders", "remove_stale_folders",
           "FOLDER_PREFIX", "LOCK_FILE"]

logger = logging.getLogger(__name__)

FOLDER_PREFIX = "gemini-"
_FOLDER_RE = re.compile(r"^gemini-(?P<pid>\d+)-rank(?P<rank>\d+)-(?P<token>[0-9a-f]+)$")
_OWNER_FILE = "owner"
LOCK_FILE = "lock"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StaleFolder:
    path: str
    pid: int
    reason: str
    size_bytes: int


def _process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def make_private_folder(nvme_dir: str, *, rank: int) -> tuple[str, int | None]:
    """Create this process's folder and lock it; returns its path and the descriptor holding
    the lock (None where the file system has no ``flock``), which the caller keeps open for
    as long as it uses the folder. Raises OSError as the OS reports it."""
    pid = os.getpid()
    name = f"{FOLDER_PREFIX}{pid}-rank{rank}-{secrets.token_hex(4)}"
    path = os.path.join(nvme_dir, name)
    # Built under a name the sweep ignores and renamed once locked: a folder bearing the
    # sweep's name is locked from the moment it exists, so no sweep sees it unlocked.
    building = os.path.join(nvme_dir, f".{name}.new")
    os.mkdir(building, 0o700)
    fd = None
    try:
        fd = os.open(os.path.join(building, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:  # ENOLCK, EOPNOTSUPP: some FUSE and network file systems
            logger.warning("the file system of %s refuses flock ([Errno %s] %s): other runs sharing it"
                           " judge this run's folder by its pid alone", nvme_dir, exc.errno, exc.strerror)
            os.close(fd)
            fd = None
        with open(os.path.join(building, _OWNER_FILE), "w") as f:
            f.write(f"{pid} {_process_start_time(pid)!r} {socket.gethostname()}\n")
        os.rename(building, path)
    except BaseException:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(building, ignore_errors=True)
        raise
    return path, fd


def _owner(path: str, pid: int) -> tuple[float | None, str | None]:
    """The owner file's start time and host; (None, None) when unreadable (a crash before
    it was written, or another user's folder)."""
    try:
        with open(os.path.join(path, _OWNER_FILE)) as f:
            fields = f.read().split()
        return (float(fields[1]) if fields[1] != "None" else None), fields[2]
    except (OSError, IndexError, ValueError):
        return None, None


def _why_stale_by_pid(path: str, pid: int, host: str) -> str | None:
    """The reason the folder's owner is gone judging by pid, or None when it may be alive."""
    owner_start, owner_host = _owner(path, pid)
    if owner_host is not None and owner_host != host:
        return None  # a shared file system: another machine's pid says nothing here
    if not psutil.pid_exists(pid):
        return f"process {pid} is not running"
    if pid == os.getpid():
        return None
    live_start = _process_start_time(pid)
    if owner_start is not None and live_start is not None and abs(live_start - owner_start) > 1.0:
        return f"pid {pid} now belongs to another process (started at {live_start}, owner at {owner_start})"
    return None


def _claim(path: str, pid: int, host: str) -> tuple[str | None, int | None]:
    """Why the folder is stale (None: it is, or may be, in use) and, when the verdict came
    from taking its lock, the descriptor now holding that lock, which the caller closes once
    done with the folder."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not os.path.isdir(path):
            return None, None  # removed meanwhile, by its owner or another sweep
        return _why_stale_by_pid(path, pid, host), None  # a folder of a version before the lock
    except OSError as exc:
        logger.debug("cannot open the lock of %s to judge it: %s", path, exc)
        return None, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, None
    except OSError:
        os.close(fd)
        return _why_stale_by_pid(path, pid, host), None  # no flock on this file system
    _, owner_host = _owner(path, pid)
    return f"no process holds its lock (its owner was pid {pid} on {owner_host or 'an unknown host'})", fd


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _sweep(nvme_dir: str, *, remove: bool, log: bool) -> list[StaleFolder]:
    host = socket.gethostname()
    stale = []
    try:
        names = os.listdir(nvme_dir)
    except OSError:
        return []
    for name in sorted(names):
        match = _FOLDER_RE.match(name)
        path = os.path.join(nvme_dir, name)
        if match is None or not os.path.isdir(path) or os.path.islink(path):
            continue
        pid = int(match["pid"])
        reason, lock_fd = _claim(path, pid, host)
        try:
            if reason is None:
                continue
            folder = StaleFolder(path=path, pid=pid, reason=reason, size_bytes=_folder_bytes(path))
            stale.append(folder)
            if remove:
                logger.warning("removing stale NVMe offload folder %s (%d bytes): %s", folder.path,
                               folder.size_bytes, folder.reason)
                # Under the lock: a store cannot be using what we delete.
                shutil.rmtree(folder.path, ignore_errors=True)
            elif log:
                logger.warning("stale NVMe offload folder %s (%d bytes) left in place (clean_stale=False): %s",
                               folder.path, folder.size_bytes, folder.reason)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
    return stale


def find_stale_folders(nvme_dir: str) -> list[StaleFolder]:
    """Folders under ``nvme_dir`` that no live store uses (their locks are released again)."""
    return _sweep(nvme_dir, remove=False, log=False)


def remove_stale_folders(nvme_dir: str, *, remove: bool) -> list[StaleFolder]:
    """Report (and with ``remove`` delete) folders no live store uses; returns what was found."""
    return _sweep(nvme_dir, remove=remove, log=True)
