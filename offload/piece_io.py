"""A request's pieces: how a tensor is cut into I/O calls, and the blocking work of one piece.

The functions here run on the store's worker threads, through the ``AIO_*`` wrappers; the
store plans the pieces and hands out the staging buffers on its loop thread (offload/nvme_files.py).
"""

from __future__ import annotations

import dataclasses
import errno as errno_codes
import os
import zlib
from typing import Sequence

import aiofiles.os
import torch
from torch.profiler import record_function

from offload.aligned import ALIGNMENT_BYTES, aligned_empty, byte_view, round_up
from offload.errors import NvmeCorruptionError, NvmeStoreError, io_error

__all__ = ["Piece", "StagingBuffers", "plan_pieces", "write_piece", "read_piece", "piece_crcs", "verify_piece",
           "AIO_WRITE_PIECE", "AIO_READ_PIECE", "AIO_PIECE_CRCS", "AIO_VERIFY_PIECE"]

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

_ZERO_PAD = bytes(ALIGNMENT_BYTES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Piece:
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


class StagingBuffers:
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


def plan_pieces(nbytes: int, *, aligned: bool, direct_io: bool, piece_bytes: int, block_bytes: int) -> list[Piece]:
    """The pieces of a request of ``nbytes``; ``aligned``: the tensor starts on a 4 KiB boundary."""
    blocks_per_piece = piece_bytes // block_bytes
    pieces = []
    for index, offset in enumerate(range(0, nbytes, piece_bytes)):
        length = min(piece_bytes, nbytes - offset)
        if not direct_io:
            direct = length
        elif aligned:
            direct = length // ALIGNMENT_BYTES * ALIGNMENT_BYTES
        else:
            direct = 0
        pieces.append(Piece(offset_bytes=offset, length_bytes=length, direct_bytes=direct,
                            first_block=index * blocks_per_piece, block_bytes=block_bytes))
    return pieces


# ---------------------------------------------------------------------------------------
# Blocking per-piece work, run on the worker threads.


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


def write_piece(fd: int, path: str, folder: str, src: memoryview, piece: Piece,
                staging: memoryview | None) -> None:
    with record_function("gemini::nvme_write"):
        iov = [src[:piece.direct_bytes]] if piece.direct_bytes else []
        staged = piece.staged_bytes
        if staged:
            padded = round_up(staged, ALIGNMENT_BYTES)
            assert staging is not None  # NvmeFiles._io_piece stages every piece with staged bytes
            staging[:staged] = src[piece.direct_bytes:]
            staging[staged:padded] = _ZERO_PAD[:padded - staged]
            iov.append(staging[:padded])
        try:
            _pwritev_all(fd, iov, piece.offset_bytes)
        except OSError as exc:
            raise io_error(exc, operation="write", path=path, offset_bytes=piece.offset_bytes,
                           length_bytes=piece.length_bytes, folder=folder) from exc


def read_piece(fd: int, path: str, folder: str, dst: memoryview, piece: Piece,
               staging: memoryview | None) -> None:
    with record_function("gemini::nvme_read"):
        iov = [dst[:piece.direct_bytes]] if piece.direct_bytes else []
        staged = piece.staged_bytes
        padded = round_up(staged, ALIGNMENT_BYTES) if staged else 0
        if staged:
            assert staging is not None  # NvmeFiles._io_piece stages every piece with staged bytes
            iov.append(staging[:padded])
        want = piece.direct_bytes + padded
        try:
            got = _preadv_all(fd, iov, piece.offset_bytes)
        except OSError as exc:
            raise io_error(exc, operation="read", path=path, offset_bytes=piece.offset_bytes,
                           length_bytes=piece.length_bytes, folder=folder) from exc
        if got != want:
            raise NvmeStoreError(
                f"NVMe read of {path} hit the end of the file at byte offset"
                f" {piece.offset_bytes + got}, expected {want} bytes from offset {piece.offset_bytes}:"
                " the file was truncated underneath the store",
                path=path, operation="read", errno=errno_codes.EIO)
        if staged:
            dst[piece.direct_bytes:] = staging[:staged]


def piece_crcs(data: memoryview, piece: Piece) -> list[int]:
    with record_function("gemini::nvme_checksum"):
        step = piece.block_bytes
        return [zlib.crc32(data[start:start + step]) for start in piece.blocks()]


def verify_piece(path: str, data: memoryview, piece: Piece, expected_crcs: Sequence[int]) -> None:
    for index, crc in enumerate(piece_crcs(data, piece)):
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


# aiofiles' wrappers run the blocking functions on the loop's default executor, which the
# store's IoLoopThread bounds to max_in_flight workers.
AIO_WRITE_PIECE = aiofiles.os.wrap(write_piece)
AIO_READ_PIECE = aiofiles.os.wrap(read_piece)
AIO_PIECE_CRCS = aiofiles.os.wrap(piece_crcs)
AIO_VERIFY_PIECE = aiofiles.os.wrap(verify_piece)
