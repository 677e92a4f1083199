"""Chunk payloads in files on a fast drive: aligned, asynchronous, checksummed.

``NvmeStore`` writes CPU tensors to files in a private folder under ``nvme_dir`` and reads
them back into preallocated tensors. Requests return ``concurrent.futures.Future``s and are
served by an asyncio loop on a background thread, whose blocking calls (open, fallocate,
``preadv``/``pwritev`` of one piece, close, unlink) run through ``aiofiles.os`` wrappers on a
bounded thread pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import errno as errno_codes
import itertools
import logging
import mmap
import os
import shutil
import signal
import stat
import sys
import threading
import time
import weakref
import zlib
from typing import Hashable, Sequence

import aiofiles.os
import torch
from torch.profiler import record_function

from offload.aligned import ALIGNMENT_BYTES, aligned_empty, byte_view, round_up, tensor_nbytes
from offload.sizes import format_size, parse_size
from offload.errors import NvmeCorruptionError, NvmeStoreError
from offload.io_loop import IoLoopThread
from offload.stale import make_private_folder, remove_stale_folders

__all__ = ["NvmeStore", "NvmeStoreConfig", "NvmeStats", "IoMode", "StoreState"]

logger = logging.getLogger(__name__)

# [Note: how a request becomes I/O]
# A request is cut into pieces of ``piece_bytes`` (4 MiB by default). Each piece is one
# positional ``pwritev``/``preadv`` call on a worker thread plus a crc32 of each of its
# ``block_bytes`` blocks (1 MiB by default), so pieces' I/O and checksums run in parallel and
# the GIL is released for both (CPython's zlib drops it above 5 KiB). ``max_in_flight``
# bounds the pieces being transferred at once, over all requests: the queue depth the drive
# sees, and the number of worker threads. A piece goes straight between the drive and the
# caller's memory when that memory is 4 KiB-aligned (as PinnedHostPool buffers are); only a
# tail shorter than 4 KiB, or a whole piece of an unaligned tensor, is copied through one of
# ``max_in_flight`` aligned staging buffers, because O_DIRECT cannot move it directly. A
# positional call needs no shared file offset, so one file descriptor per request serves
# all of its pieces concurrently.
#
# [Note: piece size]
# Each piece costs a trip through the executor (a queue put, a thread wake-up, a
# call_soon_threadsafe back to the loop) on top of its syscall: measured on the 2-core
# development VM, ~0.2 s of user and ~0.15 s of system CPU per GB moved with 1 MiB pieces,
# ~0.06 s and ~0.03 s with 4 MiB pieces, which lifted writes from 1.6 to 2.5 GB/s and reads
# from 1.6 to 2.1 GB/s without checksums (DeepSpeed's 1 MiB default suits its C++ libaio
# loop, which has no such per-request cost). The checksum block stays at 1 MiB: it only sets
# how precisely a corruption is located, and costs the same CPU per byte at any size.
#
# [Note: queue depth]
# 16 pieces in flight (64 MiB), where DeepSpeed and fio use 8 requests: a worker whose
# pwritev has returned still holds its slot until it gets the GIL back and the loop hears of
# it, so with 2 CPUs shared with checksum threads the drive sees fewer requests than there
# are slots. Four interleaved benchmark runs on the development VM, 8 -> 16 in flight:
# writes 1.9-2.4 -> 2.4-2.7 GB/s, reads 1.5-2.2 -> 1.6-2.3 GB/s. Staging memory does not
# grow with it: tails use 4 KiB buffers, and piece-sized ones exist only for unaligned
# tensors, created on first need.
#
# [Note: file format]
# One file per stored key, ``<seq>.bin``, holding the tensor's bytes; under direct I/O the
# file is zero-padded to a multiple of 4 KiB. The logical length, dtype, element count and
# one crc32 per block live in memory only: the store is scratch space for one process, and
# its folder is deleted when the process is done with it. A write goes to a new file and
# replaces the key's old file only once complete, so a failed overwrite keeps the old
# version readable.

_AIO_OPEN = aiofiles.os.wrap(os.open)
_AIO_CLOSE = aiofiles.os.wrap(os.close)
_AIO_FSTAT = aiofiles.os.wrap(os.fstat)
_AIO_FALLOCATE = aiofiles.os.wrap(os.posix_fallocate)
_ZERO_PAD = bytes(ALIGNMENT_BYTES)


class IoMode(enum.Enum):
    DIRECT = "direct"      # O_DIRECT: the page cache is bypassed
    BUFFERED = "buffered"  # the filesystem refused O_DIRECT (tmpfs, some network/overlay fs)


class StoreState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NvmeStoreConfig:
    """Settings of an NvmeStore; invalid values raise ValueError naming the field.

    max_in_flight: pieces transferred at once (the queue depth), 1..256.
    block_bytes: checksum unit, a multiple of 4096 (int or "1MiB").
    piece_bytes: I/O request unit, a multiple of block_bytes (int or "4MiB").
    use_direct_io: None probes the filesystem; True requires O_DIRECT; False never uses it.
    clean_stale: remove folders left by crashed runs (False only reports them).
    verify_checksums: record a crc32 per block on write and check it on read.
    preallocate: reserve each file's full size with posix_fallocate before writing, so a
        full disk fails at once, before any byte is written, and extents are contiguous.
    checksum_workers: threads computing checksums, apart from the I/O threads; None is
        min(4, CPU count).
    rank: data-parallel rank in the folder name; None reads torch.distributed or $RANK.
    """

    max_in_flight: int = 16
    block_bytes: int | str = 1 << 20
    piece_bytes: int | str = 4 << 20
    use_direct_io: bool | None = None
    clean_stale: bool = True
    verify_checksums: bool = True
    preallocate: bool = True
    checksum_workers: int | None = None
    rank: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_in_flight, bool) or not isinstance(self.max_in_flight, int) \
                or not 1 <= self.max_in_flight <= 256:
            raise ValueError(f"max_in_flight={self.max_in_flight!r} is invalid; accepted: an int in 1..256")
        block = parse_size(self.block_bytes, field="block_bytes")
        if block <= 0 or block % ALIGNMENT_BYTES:
            raise ValueError(
                f"block_bytes={self.block_bytes!r} is invalid; accepted: a positive multiple of"
                f" {ALIGNMENT_BYTES} bytes, e.g. 1048576 or '1MiB'"
            )
        object.__setattr__(self, "block_bytes", block)
        piece = parse_size(self.piece_bytes, field="piece_bytes")
        if piece <= 0 or piece % block:
            raise ValueError(
                f"piece_bytes={self.piece_bytes!r} is invalid; accepted: a positive multiple of"
                f" block_bytes ({block})"
            )
        object.__setattr__(self, "piece_bytes", piece)
        for name in ("clean_stale", "verify_checksums", "preallocate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; accepted: True or False")
        if self.use_direct_io not in (None, True, False):
            raise ValueError(f"use_direct_io={self.use_direct_io!r} is invalid; accepted: None, True or False")
        if self.checksum_workers is not None and (isinstance(self.checksum_workers, bool)
                                                   or not isinstance(self.checksum_workers, int)
                                                   or not 1 <= self.checksum_workers <= 64):
            raise ValueError(f"checksum_workers={self.checksum_workers!r} is invalid; accepted: None or"
                             " an int in 1..64")
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int)
                                      or self.rank < 0):
            raise ValueError(f"rank={self.rank!r} is invalid; accepted: None or an int >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NvmeStats:
    """Counters since the store opened. ``*_seconds`` are busy time: wall time during which
    at least one read (write) request was running, so ``*_bytes / *_seconds`` is the
    achieved bandwidth however many requests overlapped."""

    io_mode: IoMode
    keys: int
    bytes_stored: int
    bytes_on_disk: int
    read_bytes: int
    write_bytes: int
    read_seconds: float
    write_seconds: float
    reads: int
    writes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Entry:
    path: str
    nbytes: int
    file_bytes: int
    dtype: torch.dtype
    numel: int
    block_crcs: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Piece:
    """One I/O call's share of a request."""

    offset_bytes: int   # the same in the tensor and in the file
    length_bytes: int   # logical bytes of the piece
    direct_bytes: int   # moved between the drive and the caller's memory without a copy
    first_block: int    # index of its first checksum block in the request
    block_bytes: int

    @property
    def staged_bytes(self) -> int:
        return self.length_bytes - self.direct_bytes

    def blocks(self) -> range:
        """Offsets of its checksum blocks, relative to the piece."""
        return range(0, self.length_bytes, self.block_bytes)


class _BusyClock:
    """Wall time during which at least one request was active; used on the loop thread only."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._active = 0
        self._since = 0.0

    def start(self) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def stop(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._seconds += time.perf_counter() - self._since

    @property
    def seconds(self) -> float:
        if self._active:
            return self._seconds + time.perf_counter() - self._since
        return self._seconds


class _StagingBuffers:
    """At most ``count`` aligned buffers of ``nbytes``, created on first need.

    Taken and given back on the loop thread only; a piece holds at most one while it holds
    an in-flight slot, so with ``count == max_in_flight`` one is always free.
    """

    def __init__(self, *, count: int, nbytes: int) -> None:
        self._count = count
        self._nbytes = nbytes
        self._free: list[memoryview] = []
        self._owners: list[torch.Tensor] = []

    def take(self) -> memoryview:
        if self._free:
            return self._free.pop()
        if len(self._owners) >= self._count:
            raise AssertionError("staging buffers exhausted: more blocks in flight than slots")
        owner = aligned_empty(self._nbytes)
        self._owners.append(owner)
        return byte_view(owner)

    def give(self, buffer: memoryview) -> None:
        self._free.append(buffer)


# ---------------------------------------------------------------------------------------
# Blocking per-piece work, run on the worker threads.


def _io_error(exc: OSError, *, operation: str, path: str, offset_bytes: int, length_bytes: int,
              folder: str) -> NvmeStoreError:
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


def _advance(iov: Sequence[memoryview], done_bytes: int) -> list[memoryview]:
    rest = []
    for view in iov:
        if done_bytes >= len(view):
            done_bytes -= len(view)
            continue
        rest.append(view[done_bytes:])
        done_bytes = 0
    return rest


def _pwritev_all(fd: int, iov: list[memoryview], offset_bytes: int) -> None:
    # A regular file takes a short write only at a limit (full disk, ulimit -f); writing the
    # rest then fails with the errno that names the cause, which is what the user needs.
    while iov:
        done = os.pwritev(fd, iov, offset_bytes)
        if done <= 0:
            raise OSError(errno_codes.EIO, "write made no progress")
        offset_bytes += done
        iov = _advance(iov, done)


def _preadv_all(fd: int, iov: list[memoryview], offset_bytes: int) -> int:
    total = 0
    while iov:
        done = os.preadv(fd, iov, offset_bytes)
        if done == 0:
            break  # end of file: the caller reports the file as truncated
        total += done
        offset_bytes += done
        iov = _advance(iov, done)
    return total


def _write_piece(fd: int, path: str, folder: str, src: memoryview, piece: _Piece,
                 staging: memoryview | None) -> None:
    with record_function("gemini::nvme_write"):
        iov = [src[:piece.direct_bytes]] if piece.direct_bytes else []
        staged = piece.staged_bytes
        if staged:
            padded = round_up(staged)
            assert staging is not None
            staging[:staged] = src[piece.direct_bytes:]
            staging[staged:padded] = _ZERO_PAD[:padded - staged]
            iov.append(staging[:padded])
        try:
            _pwritev_all(fd, iov, piece.offset_bytes)
        except OSError as exc:
            raise _io_error(exc, operation="write", path=path, offset_bytes=piece.offset_bytes,
                            length_bytes=piece.length_bytes, folder=folder) from exc


def _read_piece(fd: int, path: str, folder: str, dst: memoryview, piece: _Piece,
                staging: memoryview | None) -> None:
    with record_function("gemini::nvme_read"):
        iov = [dst[:piece.direct_bytes]] if piece.direct_bytes else []
        staged = piece.staged_bytes
        padded = round_up(staged) if staged else 0
        if staged:
            assert staging is not None
            iov.append(staging[:padded])
        want = piece.direct_bytes + padded
        try:
            got = _preadv_all(fd, iov, piece.offset_bytes)
        except OSError as exc:
            raise _io_error(exc, operation="read", path=path, offset_bytes=piece.offset_bytes,
                            length_bytes=piece.length_bytes, folder=folder) from exc
        if got != want:
            raise NvmeStoreError(
                f"NVMe read of {path} hit the end of the file at byte offset"
                f" {piece.offset_bytes + got}, expected {want} bytes from offset {piece.offset_bytes}:"
                " the file was truncated underneath the store",
                path=path, operation="read", errno=errno_codes.EIO)
        if staged:
            dst[piece.direct_bytes:] = staging[:staged]


def _piece_crcs(data: memoryview, piece: _Piece) -> list[int]:
    with record_function("gemini::nvme_checksum"):
        step = piece.block_bytes
        return [zlib.crc32(data[start:start + step]) for start in piece.blocks()]


def _verify_piece(path: str, data: memoryview, piece: _Piece, expected_crcs: Sequence[int]) -> None:
    for index, crc in enumerate(_piece_crcs(data, piece)):
        if crc != expected_crcs[index]:
            start = index * piece.block_bytes
            offset = piece.offset_bytes + start
            length = min(piece.block_bytes, piece.length_bytes - start)
            raise NvmeCorruptionError(
                f"checksum mismatch reading {path}: block {piece.first_block + index} at byte"
                f" offset {offset} ({length} bytes) has crc32 {crc:#010x},"
                f" {expected_crcs[index]:#010x} was written; the file was modified or the"
                " drive returned corrupt data",
                path=path, offset_bytes=offset, length_bytes=length)


_DISK_FULL = (errno_codes.ENOSPC, errno_codes.EDQUOT)


def _disk_full_error(exc: OSError, *, folder: str, doing: str, operation: str) -> NvmeStoreError:
    try:
        free = f"{format_size(shutil.disk_usage(folder).free)} free"
    except OSError:
        free = "free space unknown"
    what = "the quota is exhausted" if exc.errno == errno_codes.EDQUOT else "the disk is full"
    return NvmeStoreError(
        f"{doing} in {folder} failed: {what} ([Errno {exc.errno}] {exc.strerror}; {free});"
        f" free space on that drive or give another nvme_dir",
        path=folder, operation=operation, errno=exc.errno)


def _probe_direct_io(folder: str) -> str | None:
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
            if exc.errno in _DISK_FULL:  # no inode left
                raise _disk_full_error(exc, folder=folder, doing="creating the O_DIRECT probe file",
                                       operation="probe direct I/O") from exc
            return f"opening a file with O_DIRECT failed: [Errno {exc.errno}] {exc.strerror}"
        try:
            # preadv into the aligned buffer: os.pread would read into a fresh, unaligned bytes.
            if os.pwrite(fd, buffer, 0) != ALIGNMENT_BYTES or os.preadv(fd, [buffer], 0) != ALIGNMENT_BYTES:
                return "an aligned O_DIRECT write/read moved the wrong number of bytes"
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                raise _disk_full_error(exc, folder=folder, doing=f"a {ALIGNMENT_BYTES}-byte O_DIRECT probe write",
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


def _default_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _shutdown(io: IoLoopThread | None, folder: str, owner_pid: int, lock_fd: int | None, key: int) -> None:
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
# SIGTERM is how schedulers, `docker stop` and `kill` end a job. So the first store made on
# the main thread (only there can Python set a handler) installs ``_on_sigterm``, which
# chains to the handler it replaced:
# - SIG_DFL (Python's own default for SIGTERM): remove every live store's folder, restore
#   SIG_DFL and send SIGTERM again, so the process still dies of SIGTERM (exit status -15,
#   as its parent expects).
# - a Python handler: call it and nothing else. It may end the process (sys.exit: the
#   finalizers then run at exit) or note the signal and let training finish and save a
#   checkpoint, which needs the stores' files, so they must not be deleted under it.
# - SIG_IGN, or a handler set from C (getsignal() gives None, nothing we could chain to):
#   no handler is installed; the process survives SIGTERM, or is not ours to handle.
# The handler stays after the last store closes; with no live store it only chains.
_live_finalizers: dict[int, weakref.finalize] = {}
_finalizer_keys = itertools.count()
_sigterm_previous: object = None


def _on_sigterm(signum: int, frame: object) -> None:
    previous = _sigterm_previous
    if callable(previous):
        previous(signum, frame)
        return
    for finalizer in list(_live_finalizers.values()):
        try:
            finalizer()
        except Exception:  # the process is ending: one store's failure must not keep the others' files
            logger.exception("cleaning up an NVMe store on SIGTERM failed")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_handler() -> None:
    global _sigterm_previous
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal would raise; a later store made on the main thread installs it
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current is signal.SIG_IGN or current is None:
        return
    _sigterm_previous = current
    signal.signal(signal.SIGTERM, _on_sigterm)


def _remove_folder(folder: str) -> None:
    def report(_function, path, exc) -> None:
        if not isinstance(exc, FileNotFoundError):
            logger.warning("could not remove %s of the NVMe store: %s", path, exc)

    if sys.version_info >= (3, 12):
        shutil.rmtree(folder, onexc=report)
    else:
        shutil.rmtree(folder, onerror=lambda function, path, info: report(function, path, info[1]))


def _check_nvme_dir(nvme_dir: str) -> None:
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


# ---------------------------------------------------------------------------------------


class NvmeStore:
    """Asynchronous, checksummed storage of CPU tensors in files under ``nvme_dir``.

    ``write(key, tensor)`` and ``read(key, out)`` return futures; the caller must keep a
    written tensor unchanged and a read's ``out`` untouched until the future is done. The
    store never modifies a tensor it writes; after a failed read ``out`` holds unspecified
    bytes. Requests on the same key run in the order they were made; requests on different
    keys overlap. Cancelling a future stops the wait, not the I/O (see [Note: cancellation]). Use as a context manager, or call ``close()``; files are also removed when
    the store is garbage-collected, at interpreter exit and on SIGTERM (see [Note: SIGTERM]).
    While open, the store holds an exclusive ``flock`` on its folder's lock file, which tells
    other runs' sweeps of ``nvme_dir`` that the folder is in use (see offload/stale.py).
    """

    def __init__(self, nvme_dir: str | os.PathLike, *, max_in_flight: int = 16,
                 block_bytes: int | str = 1 << 20, piece_bytes: int | str = 4 << 20,
                 use_direct_io: bool | None = None,
                 clean_stale: bool = True, verify_checksums: bool = True, preallocate: bool = True,
                 checksum_workers: int | None = None, rank: int | None = None) -> None:
        self.config = NvmeStoreConfig(max_in_flight=max_in_flight, block_bytes=block_bytes,
                                      piece_bytes=piece_bytes,
                                      use_direct_io=use_direct_io, clean_stale=clean_stale,
                                      verify_checksums=verify_checksums, preallocate=preallocate,
                                      checksum_workers=checksum_workers, rank=rank)
        if nvme_dir is None or os.fspath(nvme_dir) == "":
            raise ValueError(f"nvme_dir={nvme_dir!r} is invalid; accepted: the path of an existing directory")
        self._nvme_dir = os.path.abspath(os.fspath(nvme_dir))
        self._block_bytes: int = self.config.block_bytes  # type: ignore[assignment]
        self._piece_bytes: int = self.config.piece_bytes  # type: ignore[assignment]

        _check_nvme_dir(self._nvme_dir)
        self.stale_folders = remove_stale_folders(self._nvme_dir, remove=self.config.clean_stale)
        rank_value = self.config.rank if self.config.rank is not None else _default_rank()
        try:
            self._folder, lock_fd = make_private_folder(self._nvme_dir, rank=rank_value)
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                raise _disk_full_error(exc, folder=self._nvme_dir, doing="creating the store's folder",
                                       operation="create folder") from exc
            raise NvmeStoreError(
                f"cannot create the store's folder in nvme_dir {self._nvme_dir!r}:"
                f" [Errno {exc.errno}] {exc.strerror}",
                path=self._nvme_dir, operation="create folder", errno=exc.errno) from exc

        try:
            self._io_mode = self._choose_io_mode()
            self._io = IoLoopThread(name=f"nvme-store-{os.path.basename(self._folder)}",
                                    max_workers=self.config.max_in_flight,
                                    cpu_workers=self.config.checksum_workers)
        except BaseException:
            _shutdown(None, self._folder, os.getpid(), lock_fd, -1)
            raise
        key = next(_finalizer_keys)
        self._finalizer = weakref.finalize(self, _shutdown, self._io, self._folder, os.getpid(), lock_fd, key)
        _live_finalizers[key] = self._finalizer
        _install_sigterm_handler()

        # Loop-thread state.
        self._entries: dict[Hashable, _Entry] = {}
        self._key_tail: dict[Hashable, asyncio.Future] = {}
        self._slots: asyncio.Semaphore | None = None
        # Aligned tensors need a 4 KiB buffer for a short tail; unaligned ones a whole piece.
        self._tail_staging = _StagingBuffers(count=self.config.max_in_flight, nbytes=ALIGNMENT_BYTES)
        self._piece_staging = _StagingBuffers(count=self.config.max_in_flight, nbytes=self._piece_bytes)
        self._next_file = 0
        self._preallocate = self.config.preallocate
        self._read_clock = _BusyClock()
        self._write_clock = _BusyClock()
        self._read_bytes = 0
        self._write_bytes = 0
        self._reads = 0
        self._writes = 0
        self._bytes_stored = 0
        self._bytes_on_disk = 0
        self._tasks: set[asyncio.Task] = set()
        self._state = StoreState.OPEN
        logger.info("NvmeStore in %s: %s I/O, %s pieces, %d in flight, checksums %s",
                    self._folder, self._io_mode.value, format_size(self._piece_bytes),
                    self.config.max_in_flight,
                    f"per {format_size(self._block_bytes)}" if self.config.verify_checksums else "off")

    # -- public API ------------------------------------------------------------------

    @property
    def folder(self) -> str:
        """This store's private folder (removed on close)."""
        return self._folder

    @property
    def io_mode(self) -> IoMode:
        return self._io_mode

    @property
    def state(self) -> StoreState:
        return self._state

    @property
    def bytes_stored(self) -> int:
        """Logical bytes of every stored key."""
        return self._bytes_stored

    @property
    def bytes_on_disk(self) -> int:
        """File bytes, with the padding direct I/O needs."""
        return self._bytes_on_disk

    @property
    def read_bytes(self) -> int:
        return self._read_bytes

    @property
    def write_bytes(self) -> int:
        return self._write_bytes

    @property
    def read_seconds(self) -> float:
        return self._read_clock.seconds

    @property
    def write_seconds(self) -> float:
        return self._write_clock.seconds

    def stats(self) -> NvmeStats:
        return NvmeStats(io_mode=self._io_mode, keys=len(self._entries), bytes_stored=self._bytes_stored,
                         bytes_on_disk=self._bytes_on_disk, read_bytes=self._read_bytes,
                         write_bytes=self._write_bytes, read_seconds=self.read_seconds,
                         write_seconds=self.write_seconds, reads=self._reads, writes=self._writes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def path_of(self, key: Hashable) -> str:
        """The file holding a completed write of ``key`` (for diagnostics and tests)."""
        return self._entry(key).path

    def nbytes_of(self, key: Hashable) -> int:
        return self._entry(key).nbytes

    def write(self, key: Hashable, tensor: torch.Tensor) -> "concurrent.futures.Future[None]":
        """Store ``tensor``'s bytes under ``key`` (replacing an earlier value once complete)."""
        self._check_open()
        _check_host_tensor(tensor, "tensor")
        return self._submit(self._write_request(key, tensor))

    def read(self, key: Hashable, out: torch.Tensor) -> "concurrent.futures.Future[torch.Tensor]":
        """Read ``key`` into ``out`` (same dtype and element count); the future yields ``out``."""
        self._check_open()
        _check_host_tensor(out, "out")
        return self._submit(self._read_request(key, out))

    def delete(self, key: Hashable) -> "concurrent.futures.Future[None]":
        """Remove ``key`` and its file, after the requests already made on it."""
        self._check_open()
        return self._submit(self._delete_request(key))

    def close(self) -> None:
        """Wait for requests in flight, then stop the I/O threads and delete every file."""
        if self._state is StoreState.CLOSED:
            return
        if self._io.on_own_thread():
            raise RuntimeError("NvmeStore.close() was called from the store's own I/O thread (a"
                               " future's done-callback?); call it from another thread")
        self._state = StoreState.CLOSED
        self._io.submit(self._drain()).result()
        self._bytes_on_disk = 0
        self._bytes_stored = 0
        self._entries.clear()
        self._finalizer()
        logger.debug("NvmeStore in %s closed", self._folder)

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NvmeStore({self._folder!r}, {self._io_mode.value}, {self._state.value},"
                f" {len(self._entries)} keys, {format_size(self._bytes_stored)})")

    # -- construction helpers --------------------------------------------------------

    def _choose_io_mode(self) -> IoMode:
        wanted = self.config.use_direct_io
        if wanted is False:
            return IoMode.BUFFERED
        reason = _probe_direct_io(self._folder)
        if reason is None:
            return IoMode.DIRECT
        if wanted is True:
            raise NvmeStoreError(
                f"use_direct_io=True but O_DIRECT does not work in {self._nvme_dir}: {reason}",
                path=self._nvme_dir, operation="probe direct I/O", errno=errno_codes.EINVAL)
        logger.warning("O_DIRECT does not work in %s (%s); falling back to buffered I/O, so the page"
                       " cache will also hold offloaded chunks", self._nvme_dir, reason)
        return IoMode.BUFFERED

    # -- submission (caller threads) -------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not StoreState.OPEN:
            raise RuntimeError(f"NvmeStore in {self._folder} is closed")

    def _submit(self, coro) -> concurrent.futures.Future:
        return self._io.submit(self._run_to_completion(coro))

    def _entry(self, key: Hashable) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"no tensor stored under key {key!r} in {self._folder}") from None

    # -- requests (loop thread) ------------------------------------------------------

    # [Note: cancellation]
    # A blocking pwritev/preadv on a worker thread cannot be interrupted. If cancelling a
    # future cancelled its request, the request would close its file descriptor while a
    # worker still wrote through it, and the descriptor number, reused by the next open,
    # would send those bytes into another key's file. So a cancelled future only stops the
    # caller's wait: the request runs to completion (a write lands, a read fills ``out``),
    # shielded, and close() waits for it like for any other.

    async def _run_to_completion(self, coro):
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise

    async def _drain(self) -> None:
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    def _enter_key(self, key: Hashable) -> tuple[asyncio.Future | None, asyncio.Future]:
        # Runs before the request's first await, i.e. in submission order: chaining each
        # request behind the previous one on its key keeps same-key requests ordered.
        token = asyncio.get_running_loop().create_future()
        previous = self._key_tail.get(key)
        self._key_tail[key] = token
        return previous, token

    def _leave_key(self, key: Hashable, token: asyncio.Future) -> None:
        token.set_result(None)
        if self._key_tail.get(key) is token:
            del self._key_tail[key]

    async def _write_request(self, key: Hashable, tensor: torch.Tensor) -> None:
        previous, token = self._enter_key(key)
        try:
            if previous is not None:
                await previous
            self._write_clock.start()
            try:
                await self._write(key, tensor)
            finally:
                self._write_clock.stop()
        finally:
            self._leave_key(key, token)

    async def _read_request(self, key: Hashable, out: torch.Tensor) -> torch.Tensor:
        previous, token = self._enter_key(key)
        try:
            if previous is not None:
                await previous
            self._read_clock.start()
            try:
                await self._read(key, out)
            finally:
                self._read_clock.stop()
            return out
        finally:
            self._leave_key(key, token)

    async def _delete_request(self, key: Hashable) -> None:
        previous, token = self._enter_key(key)
        try:
            if previous is not None:
                await previous
            entry = self._entry(key)
            del self._entries[key]
            await self._discard_file(entry)
        finally:
            self._leave_key(key, token)

    def _plan(self, nbytes: int, aligned: bool) -> list[_Piece]:
        direct_io = self._io_mode is IoMode.DIRECT
        blocks_per_piece = self._piece_bytes // self._block_bytes
        pieces = []
        for index, offset in enumerate(range(0, nbytes, self._piece_bytes)):
            length = min(self._piece_bytes, nbytes - offset)
            if not direct_io:
                direct = length
            elif aligned:
                direct = length // ALIGNMENT_BYTES * ALIGNMENT_BYTES
            else:
                direct = 0
            pieces.append(_Piece(offset_bytes=offset, length_bytes=length, direct_bytes=direct,
                                 first_block=index * blocks_per_piece, block_bytes=self._block_bytes))
        return pieces

    async def _io_piece(self, fn, *args, piece: _Piece) -> None:
        """Run one piece's I/O while holding one of the ``max_in_flight`` slots."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_in_flight)
        pool = None
        if piece.staged_bytes:
            pool = self._tail_staging if round_up(piece.staged_bytes) <= ALIGNMENT_BYTES else self._piece_staging
        async with self._slots:
            staging = pool.take() if pool is not None else None
            try:
                await fn(*args, piece, staging, executor=self._io.executor)
            finally:
                if staging is not None:
                    pool.give(staging)

    # [Note: checksums off the I/O slots]
    # A crc32 runs at 2-4 GB/s per core, as long as a fast drive takes to move the bytes.
    # Computed inside the I/O slot it would leave the slot's queue entry idle meanwhile,
    # halving the effective queue depth; so checksums run on a separate pool of CPU
    # workers: a written piece's crc alongside its pwritev (the caller keeps the tensor
    # unchanged until the future completes), a read piece's after its preadv, while the slot
    # already serves the next piece.

    async def _write_piece(self, fd: int, path: str, data: memoryview, piece: _Piece,
                           checksum: bool) -> list[int]:
        io = self._io_piece(_AIO_WRITE_PIECE, fd, path, self._folder, data, piece=piece)
        if not checksum:
            await io
            return []
        crcs = _AIO_PIECE_CRCS(data, piece, executor=self._io.cpu_executor)
        results = await asyncio.gather(io, crcs, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results[1]

    async def _read_piece(self, fd: int, path: str, data: memoryview, piece: _Piece,
                          expected_crcs: Sequence[int] | None) -> None:
        await self._io_piece(_AIO_READ_PIECE, fd, path, self._folder, data, piece=piece)
        if expected_crcs is not None:
            await _AIO_VERIFY_PIECE(path, data, piece, expected_crcs, executor=self._io.cpu_executor)

    async def _gather_pieces(self, coros) -> list:
        # Wait for every piece even after one fails: the file descriptor is closed (and on a
        # failed write the file removed) only when no worker uses it any more.
        results = await asyncio.gather(*coros, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _write(self, key: Hashable, tensor: torch.Tensor) -> None:
        nbytes = tensor_nbytes(tensor)
        direct_io = self._io_mode is IoMode.DIRECT
        file_bytes = round_up(nbytes) if direct_io else nbytes
        self._next_file += 1
        path = os.path.join(self._folder, f"{self._next_file:08d}.bin")
        free_bytes = shutil.disk_usage(self._folder).free
        if file_bytes > free_bytes:
            raise NvmeStoreError(
                f"NVMe write of key {key!r} needs {file_bytes} bytes in {path} but the drive has"
                f" {free_bytes} bytes free ({format_size(file_bytes - free_bytes)} short)",
                path=path, operation="write", errno=errno_codes.ENOSPC)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct_io else 0)
        try:
            try:
                fd = await _AIO_OPEN(path, flags, 0o600)
            except OSError as exc:
                raise _io_error(exc, operation="open for write", path=path, offset_bytes=0,
                                length_bytes=file_bytes, folder=self._folder) from exc
            try:
                if self._preallocate and file_bytes:
                    await self._allocate(fd, path, file_bytes)
                src = byte_view(tensor)
                aligned = tensor.data_ptr() % ALIGNMENT_BYTES == 0
                checksum = self.config.verify_checksums
                piece_crcs = await self._gather_pieces(
                    self._write_piece(fd, path, src[p.offset_bytes:p.offset_bytes + p.length_bytes], p,
                                      checksum)
                    for p in self._plan(nbytes, aligned))
            finally:
                await _AIO_CLOSE(fd)
        except BaseException:
            try:
                await aiofiles.os.remove(path)
            except OSError:
                pass
            raise
        entry = _Entry(path=path, nbytes=nbytes, file_bytes=file_bytes, dtype=tensor.dtype,
                       numel=tensor.numel(),
                       block_crcs=tuple(c for crcs in piece_crcs for c in crcs) if checksum else None)
        old = self._entries.get(key)
        self._entries[key] = entry
        self._bytes_stored += nbytes
        self._bytes_on_disk += file_bytes
        self._write_bytes += nbytes
        self._writes += 1
        if old is not None:
            await self._discard_file(old)

    async def _allocate(self, fd: int, path: str, file_bytes: int) -> None:
        # [Note: preallocation]
        # On ext4, direct writes that extend a file take the inode lock exclusively, so the
        # pieces of one request serialise: measured 0.4-0.5 GB/s against 1.0 GB/s into a
        # preallocated file. posix_fallocate also makes a full disk fail here, before any
        # byte is written, with ENOSPC.
        try:
            await _AIO_FALLOCATE(fd, 0, file_bytes)
        except OSError as exc:
            if exc.errno in (errno_codes.EOPNOTSUPP, errno_codes.ENOSYS, errno_codes.EINVAL, errno_codes.EBADF):
                # A filesystem without fallocate (glibc's emulation cannot write through
                # O_DIRECT): not an error, only slower.
                self._preallocate = False
                logger.info("posix_fallocate is not supported in %s ([Errno %s] %s); writing without"
                            " preallocation", self._nvme_dir, exc.errno, exc.strerror)
                return
            raise _io_error(exc, operation="allocate", path=path, offset_bytes=0,
                            length_bytes=file_bytes, folder=self._folder) from exc

    async def _read(self, key: Hashable, out: torch.Tensor) -> None:
        entry = self._entry(key)
        if out.dtype != entry.dtype or out.numel() != entry.numel:
            raise ValueError(
                f"read of key {key!r} into a tensor of {out.numel()} x {out.dtype}; the stored"
                f" tensor has {entry.numel} x {entry.dtype} (accepted: the same dtype and numel)")
        direct_io = self._io_mode is IoMode.DIRECT
        flags = os.O_RDONLY | (os.O_DIRECT if direct_io else 0)
        try:
            fd = await _AIO_OPEN(entry.path, flags)
        except FileNotFoundError as exc:
            raise NvmeStoreError(
                f"NVMe file {entry.path} of key {key!r} was deleted underneath the store",
                path=entry.path, operation="open for read", errno=exc.errno) from exc
        except OSError as exc:
            raise _io_error(exc, operation="open for read", path=entry.path, offset_bytes=0,
                            length_bytes=entry.file_bytes, folder=self._folder) from exc
        try:
            size = (await _AIO_FSTAT(fd)).st_size
            if size < entry.file_bytes:
                raise NvmeStoreError(
                    f"NVMe file {entry.path} of key {key!r} has {size} bytes, {entry.file_bytes}"
                    " were written: it was truncated underneath the store",
                    path=entry.path, operation="read", errno=errno_codes.EIO)
            dst = byte_view(out)
            aligned = out.data_ptr() % ALIGNMENT_BYTES == 0
            crcs = entry.block_crcs
            blocks_per_piece = self._piece_bytes // self._block_bytes
            await self._gather_pieces(
                self._read_piece(fd, entry.path, dst[p.offset_bytes:p.offset_bytes + p.length_bytes], p,
                                 None if crcs is None else crcs[p.first_block:p.first_block + blocks_per_piece])
                for p in self._plan(entry.nbytes, aligned))
        finally:
            await _AIO_CLOSE(fd)
        self._read_bytes += entry.nbytes
        self._reads += 1

    async def _discard_file(self, entry: _Entry) -> None:
        self._bytes_stored -= entry.nbytes
        self._bytes_on_disk -= entry.file_bytes
        try:
            await aiofiles.os.remove(entry.path)
        except FileNotFoundError:
            logger.warning("NVMe file %s was already gone when its key was deleted", entry.path)
        except OSError as exc:
            raise _io_error(exc, operation="delete", path=entry.path, offset_bytes=0,
                            length_bytes=entry.file_bytes, folder=self._folder) from exc


def _check_host_tensor(tensor: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}; the NVMe store moves host tensors only"
                         " (copy into a PinnedHostPool buffer first)")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous; the NVMe store needs contiguous tensors")


# aiofiles' wrappers run the blocking functions on the loop's default executor, which the
# store's IoLoopThread bounds to max_in_flight workers.
_AIO_WRITE_PIECE = aiofiles.os.wrap(_write_piece)
_AIO_READ_PIECE = aiofiles.os.wrap(_read_piece)
_AIO_PIECE_CRCS = aiofiles.os.wrap(_piece_crcs)
_AIO_VERIFY_PIECE = aiofiles.os.wrap(_verify_piece)
