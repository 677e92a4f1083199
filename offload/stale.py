"""Private per-process folders under ``nvme_dir``, and the detection of ones left by crashes.

A store writes into ``<nvme_dir>/gemini-<pid>-rank<rank>-<random>/`` with an ``owner`` file
holding its pid, the process start time and the host name. A crashed run (SIGKILL, OOM
killer, power loss) cannot clean up, and chunk files are large, so the next store in the
same ``nvme_dir`` finds such folders and removes them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import shutil
import socket

import psutil

__all__ = ["StaleFolder", "make_private_folder", "find_stale_folders", "remove_stale_folders",
           "FOLDER_PREFIX"]

logger = logging.getLogger(__name__)

FOLDER_PREFIX = "gemini-"
_FOLDER_RE = re.compile(r"^gemini-(?P<pid>\d+)-rank(?P<rank>\d+)-(?P<token>[0-9a-f]+)$")
_OWNER_FILE = "owner"


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


def make_private_folder(nvme_dir: str, *, rank: int) -> str:
    """Create and return this process's folder; raises OSError as the OS reports it."""
    pid = os.getpid()
    path = os.path.join(nvme_dir, f"{FOLDER_PREFIX}{pid}-rank{rank}-{secrets.token_hex(4)}")
    os.mkdir(path, 0o700)
    start = _process_start_time(pid)
    with open(os.path.join(path, _OWNER_FILE), "w") as f:
        f.write(f"{pid} {start!r} {socket.gethostname()}\n")
    return path


def _why_stale(path: str, pid: int, host: str) -> str | None:
    """The reason the folder's owner is gone, or None when it may still be alive."""
    owner_start: float | None = None
    owner_host = host
    try:
        with open(os.path.join(path, _OWNER_FILE)) as f:
            fields = f.read().split()
        owner_start = float(fields[1]) if fields[1] != "None" else None
        owner_host = fields[2]
    except (OSError, IndexError, ValueError):
        pass  # crashed before writing the owner file: judge by the pid alone
    if owner_host != host:
        return None  # a shared file system: another machine's pid says nothing here
    if not psutil.pid_exists(pid):
        return f"process {pid} is not running"
    if pid == os.getpid():
        return None
    live_start = _process_start_time(pid)
    if owner_start is not None and live_start is not None and abs(live_start - owner_start) > 1.0:
        return f"pid {pid} now belongs to another process (started at {live_start}, owner at {owner_start})"
    return None


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def find_stale_folders(nvme_dir: str) -> list[StaleFolder]:
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
        reason = _why_stale(path, pid, host)
        if reason is not None:
            stale.append(StaleFolder(path=path, pid=pid, reason=reason, size_bytes=_folder_bytes(path)))
    return stale


def remove_stale_folders(nvme_dir: str, *, remove: bool) -> list[StaleFolder]:
    """Report (and with ``remove`` delete) folders of dead owners; returns what was found."""
    found = find_stale_folders(nvme_dir)
    for folder in found:
        if remove:
            logger.warning("removing stale NVMe offload folder %s (%d bytes): %s", folder.path,
                           folder.size_bytes, folder.reason)
            shutil.rmtree(folder.path, ignore_errors=True)
        else:
            logger.warning("stale NVMe offload folder %s (%d bytes) left in place (clean_stale=False): %s",
                           folder.path, folder.size_bytes, folder.reason)
    return found
