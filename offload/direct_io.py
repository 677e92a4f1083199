"""Whether O_DIRECT works in a folder, and the I/O mode a store uses there."""

from __future__ import annotations

import enum
import errno as errno_codes
import logging
import mmap
import os

from offload.aligned import ALIGNMENT_BYTES
from offload.errors import DISK_FULL, NvmeStoreError, disk_full_error

__all__ = ["IoMode", "probe_direct_io", "choose_io_mode"]

# The store's messages keep the logger they had when it was one module.
logger = logging.getLogger("offload.nvme_store")


class IoMode(enum.Enum):
    DIRECT = "direct"      # O_DIRECT: the page cache is bypassed
    BUFFERED = "buffered"  # the filesystem refused O_DIRECT (tmpfs, some network/overlay fs)


def probe_direct_io(folder: str) -> str | None:
    """None when O_DIRECT works in ``folder``, else why not; raises NvmeStoreError when the
    drive is full, which says nothing about O_DIRECT and would fail buffered I/O too."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    path = os.path.join(folder, ".direct-io-probe")
    buffer = mmap.mmap(-1, ALIGNMENT_BYTES)  # anonymous mappings are page-aligned
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno in DISK_FULL:  # no inode left
                raise disk_full_error(exc, folder=folder, doing="creating the O_DIRECT probe file",
                                      operation="probe direct I/O") from exc
            return f"opening a file with O_DIRECT failed: [Errno {exc.errno}] {exc.strerror}"
        try:
            # preadv into the aligned buffer: os.pread would read into a fresh, unaligned bytes.
            if os.pwrite(fd, buffer, 0) != ALIGNMENT_BYTES or os.preadv(fd, [buffer], 0) != ALIGNMENT_BYTES:
                return "an aligned O_DIRECT write/read moved the wrong number of bytes"
        except OSError as exc:
            if exc.errno in DISK_FULL:
                raise disk_full_error(exc, folder=folder, doing=f"a {ALIGNMENT_BYTES}-byte O_DIRECT probe write",
                                      operation="probe direct I/O") from exc
            return f"an aligned O_DIRECT write/read failed: [Errno {exc.errno}] {exc.strerror}"
        finally:
            os.close(fd)
    finally:
        buffer.close()
        try:
            os.unlink(path)
        except OSError:
            pass
    return None


def choose_io_mode(folder: str, *, nvme_dir: str, use_direct_io: bool | None) -> IoMode:
    """The mode for a store's ``folder`` under ``nvme_dir`` (named in messages), as
    ``use_direct_io`` asks: None probes and falls back with a warning; True requires O_DIRECT."""
    if use_direct_io is False:
        return IoMode.BUFFERED
    reason = probe_direct_io(folder)
    if reason is None:
        return IoMode.DIRECT
    if use_direct_io is True:
        raise NvmeStoreError(
            f"use_direct_io=True but O_DIRECT does not work in {nvme_dir}: {reason}",
            path=nvme_dir, operation="probe direct I/O", errno=errno_codes.EINVAL)
    logger.warning("O_DIRECT does not work in %s (%s); falling back to buffered I/O, so the page"
                   " cache will also hold offloaded chunks", nvme_dir, reason)
    return IoMode.BUFFERED
