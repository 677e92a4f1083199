"""Exceptions of the offload package: each names the file and the operation that failed."""

from __future__ import annotations

__all__ = ["NvmeStoreError", "NvmeCorruptionError"]


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
