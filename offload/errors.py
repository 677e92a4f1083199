"""Exceptions of the offload package: each names the file and the operation that failed.

``io_error`` and ``disk_full_error`` word them from the OSError a system call raised."""

from __future__ import annotations

import errno as errno_codes
import shutil

from offload.sizes import format_size

__all__ = ["NvmeStoreError", "NvmeCorruptionError", "DISK_FULL", "io_error", "disk_full_error"]


class NvmeStoreError(OSError):
    """An NVMe store operation failed; ``path`` and ``operation`` say where and doing what.

    A subclass of OSError so that callers catching I/O errors broadly still catch it;
    ``errno`` is the underlying error number when there was one (ENOSPC, EFBIG, ENOENT, ...).
    """

    def __init__(self, message: str, *, path: str, operation: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.filename = path
        self.path = path
        self.operation = operation

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):  # keep the keyword-only fields across pickling (subprocess tests, DP)
        return (_rebuild, (type(self), self.args[0], self.__dict__.copy()))


class NvmeCorruptionError(NvmeStoreError):
    """Bytes read back do not match the checksum recorded when they were written."""

    def __init__(self, message: str, *, path: str, offset_bytes: int, length_bytes: int) -> None:
        super().__init__(message, path=path, operation="verify")
        self.offset_bytes = offset_bytes
        self.length_bytes = length_bytes


def _rebuild(cls: type, message: str, state: dict) -> NvmeStoreError:
    err = cls.__new__(cls)
    OSError.__init__(err, message)
    err.__dict__.update(state)
    return err


def io_error(exc: OSError, *, operation: str, path: str, offset_bytes: int, length_bytes: int,
             folder: str) -> NvmeStoreError:
    """``exc`` from a system call on one of the store's files, as an NvmeStoreError saying
    which bytes of which file, and how much room is left when the drive ran out of it."""
    hint = ""
    if exc.errno in (errno_codes.ENOSPC, errno_codes.EFBIG, errno_codes.EDQUOT):
        try:
            hint = f"; {shutil.disk_usage(folder).free} bytes free on the drive"
        except OSError:
            pass
        if exc.errno == errno_codes.EFBIG:
            hint += " (the file-size limit, ulimit -f, was hit)"
    return NvmeStoreError(
        f"NVMe {operation} of {length_bytes} bytes at byte offset {offset_bytes} of {path}"
        f" failed: [Errno {exc.errno}] {exc.strerror}{hint}",
        path=path, operation=operation, errno=exc.errno)


DISK_FULL = (errno_codes.ENOSPC, errno_codes.EDQUOT)


def disk_full_error(exc: OSError, *, folder: str, doing: str, operation: str) -> NvmeStoreError:
    """``exc`` (an errno in DISK_FULL) met while ``doing`` something in ``folder``."""
    try:
        free = f"{format_size(shutil.disk_usage(folder).free)} free"
    except OSError:
        free = "free space unknown"
    what = "the quota is exhausted" if exc.errno == errno_codes.EDQUOT else "the disk is full"
    return NvmeStoreError(
        f"{doing} in {folder} failed: {what} ([Errno {exc.errno}] {exc.strerror}; {free});"
        f" free space on that drive or give another nvme_dir",
        path=folder, operation=operation, errno=exc.errno)
