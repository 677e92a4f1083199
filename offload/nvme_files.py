"""The store's files, and the requests that write, read and delete them on the loop thread.

``NvmeFiles`` keeps which key lives in which file, orders the requests made on one key,
cuts each request into pieces (offload/piece_io.py) run ``max_in_flight`` at a time, and
counts what was moved. Everything here runs on the store's loop thread, except reading the
counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno as errno_codes
import logging
import os
import shutil
import time
from typing import AsyncIterator, Hashable, Sequence

import aiofiles.os
import torch

from offload.aligned import ALIGNMENT_BYTES, byte_view, round_up, tensor_nbytes
from offload.direct_io import IoMode
from offload.errors import NvmeStoreError, io_error
from offload.io_loop import IoLoopThread
from offload.piece_io import (AIO_PIECE_CRCS, AIO_READ_PIECE, AIO_VERIFY_PIECE, AIO_WRITE_PIECE, Piece,
                              StagingBuffers, plan_pieces)
from offload.sizes import format_size

__all__ = ["NvmeFiles", "FileEntry", "BusyClock"]

# The store's messages keep the logger they had when it was one module.
logger = logging.getLogger("offload.nvme_store")

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileEntry:
    """What the store knows of one key's file (see [Note: file format])."""

    path: str
    nbytes: int
    file_bytes: int
    dtype: torch.dtype
    numel: int
    block_crcs: tuple[int, ...] | None


class BusyClock:
    """Wall time during which at least one request was active (``with clock:`` around each);
    used on the loop thread only."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._active = 0
        self._since = 0.0

    def __enter__(self) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def __exit__(self, *exc_info: object) -> None:
        self._active -= 1
        if self._active == 0:
            self._seconds += time.perf_counter() - self._since

    @property
    def seconds(self) -> float:
        if self._active:
            return self._seconds + time.perf_counter() - self._since
        return self._seconds


class NvmeFiles:
    """The files in ``folder``, the key each holds, and the requests on them (see [Note: how a
    request becomes I/O] in offload/piece_io.py)."""

    def __init__(self, folder: str, *, nvme_dir: str, io: IoLoopThread, io_mode: IoMode, max_in_flight: int,
                 block_bytes: int, piece_bytes: int, verify_checksums: bool, preallocate: bool) -> None:
        self._folder = folder
        self._nvme_dir = nvme_dir
        self._io = io
        self._io_mode = io_mode
        self._max_in_flight = max_in_flight
        self._block_bytes = block_bytes
        self._piece_bytes = piece_bytes
        self._verify_checksums = verify_checksums
        self.entries: dict[Hashable, FileEntry] = {}
        self._key_tail: dict[Hashable, asyncio.Future] = {}
        self._slots: asyncio.Semaphore | None = None
        # Aligned tensors need a 4 KiB buffer for a short tail; unaligned ones a whole piece.
        self._tail_staging = StagingBuffers(count=max_in_flight, nbytes=ALIGNMENT_BYTES)
        self._piece_staging = StagingBuffers(count=max_in_flight, nbytes=piece_bytes)
        self._next_file = 0
        self._preallocate = preallocate
        self.read_clock = BusyClock()
        self.write_clock = BusyClock()
        self.read_bytes = 0
        self.write_bytes = 0
        self.reads = 0
        self.writes = 0
        self.bytes_stored = 0
        self.bytes_on_disk = 0
        self._tasks: set[asyncio.Task] = set()

    def entry(self, key: Hashable) -> FileEntry:
        try:
            return self.entries[key]
        except KeyError:
            raise KeyError(f"no tensor stored under key {key!r} in {self._folder}") from None

    def forget(self) -> None:
        """Drop every entry (the store is closed: its folder goes, files and all)."""
        self.bytes_on_disk = 0
        self.bytes_stored = 0
        self.entries.clear()

    # [Note: cancellation]
    # A blocking pwritev/preadv on a worker thread cannot be interrupted. If cancelling a
    # future cancelled its request, the request would close its file descriptor while a
    # worker still wrote through it, and the descriptor number, reused by the next open,
    # would send those bytes into another key's file. So a cancelled future only stops the
    # caller's wait: the request runs to completion (a write lands, a read fills ``out``),
    # shielded, and close() waits for it like for any other.

    async def run_to_completion(self, coro, owner: object):
        """Run ``coro`` (a request) shielded from cancellation. ``owner``, the store, stays
        referenced here until the request is done, as it was when the requests were its own
        methods: it is not finalized (its threads stopped, its folder removed) under them."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    @contextlib.asynccontextmanager
    async def _turn_on(self, key: Hashable) -> AsyncIterator[None]:
        """The request's turn on ``key``: entered once the requests made on it before are done."""
        # Entered before the request's first await, i.e. in submission order: chaining each
        # request behind the previous one on its key keeps same-key requests ordered.
        token = asyncio.get_running_loop().create_future()
        previous = self._key_tail.get(key)
        self._key_tail[key] = token
        try:
            if previous is not None:
                await previous
            yield
        finally:
            token.set_result(None)
            if self._key_tail.get(key) is token:
                del self._key_tail[key]

    async def write_request(self, key: Hashable, tensor: torch.Tensor) -> None:
        async with self._turn_on(key):
            with self.write_clock:
                await self._write(key, tensor)

    async def read_request(self, key: Hashable, out: torch.Tensor) -> torch.Tensor:
        async with self._turn_on(key):
            with self.read_clock:
                await self._read(key, out)
            return out

    async def delete_request(self, key: Hashable) -> None:
        async with self._turn_on(key):
            entry = self.entry(key)
            del self.entries[key]
            await self._discard_file(entry)

    def _plan(self, nbytes: int, aligned: bool) -> list[Piece]:
        return plan_pieces(nbytes, aligned=aligned, direct_io=self._io_mode is IoMode.DIRECT,
                           piece_bytes=self._piece_bytes, block_bytes=self._block_bytes)

    async def _io_piece(self, fn, *args, piece: Piece) -> None:
        """Run one piece's I/O while holding one of the ``max_in_flight`` slots."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_in_flight)
        pool = None
        if piece.staged_bytes:
            pool = self._tail_staging if round_up(piece.staged_bytes, ALIGNMENT_BYTES) <= ALIGNMENT_BYTES else self._piece_staging
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

    async def _write_piece(self, fd: int, path: str, data: memoryview, piece: Piece,
                           checksum: bool) -> list[int]:
        io = self._io_piece(AIO_WRITE_PIECE, fd, path, self._folder, data, piece=piece)
        if not checksum:
            await io
            return []
        crcs = AIO_PIECE_CRCS(data, piece, executor=self._io.cpu_executor)
        results = await asyncio.gather(io, crcs, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results[1]

    async def _read_piece(self, fd: int, path: str, data: memoryview, piece: Piece,
                          expected_crcs: Sequence[int] | None) -> None:
        await self._io_piece(AIO_READ_PIECE, fd, path, self._folder, data, piece=piece)
        if expected_crcs is not None:
            await AIO_VERIFY_PIECE(path, data, piece, expected_crcs, executor=self._io.cpu_executor)

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
        file_bytes = round_up(nbytes, ALIGNMENT_BYTES) if direct_io else nbytes
        self._next_file += 1
        path = os.path.join(self._folder, f"{self._next_file:08d}.bin")
        if not os.path.isdir(self._folder):
            # Deleted underneath (a tmp cleaner, rm -r): its files are gone (their reads raise, naming
            # each), and what is written from now on - a checkpoint loaded into the engine, the usual
            # recovery - needs the folder back (a bare FileNotFoundError otherwise).
            os.makedirs(self._folder, exist_ok=True)
            logger.warning("NVMe folder %s was deleted while in use: made again; the files it held are lost",
                           self._folder)
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
                raise io_error(exc, operation="open for write", path=path, offset_bytes=0,
                               length_bytes=file_bytes, folder=self._folder) from exc
            try:
                if self._preallocate and file_bytes:
                    await self._allocate(fd, path, file_bytes)
                src = byte_view(tensor)
                aligned = tensor.data_ptr() % ALIGNMENT_BYTES == 0
                checksum = self._verify_checksums
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
        entry = FileEntry(path=path, nbytes=nbytes, file_bytes=file_bytes, dtype=tensor.dtype,
                          numel=tensor.numel(),
                          block_crcs=tuple(c for crcs in piece_crcs for c in crcs) if checksum else None)
        old = self.entries.get(key)
        self.entries[key] = entry
        self.bytes_stored += nbytes
        self.bytes_on_disk += file_bytes
        self.write_bytes += nbytes
        self.writes += 1
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
            raise io_error(exc, operation="allocate", path=path, offset_bytes=0,
                           length_bytes=file_bytes, folder=self._folder) from exc

    async def _read(self, key: Hashable, out: torch.Tensor) -> None:
        entry = self.entry(key)
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
            raise io_error(exc, operation="open for read", path=entry.path, offset_bytes=0,
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
        self.read_bytes += entry.nbytes
        self.reads += 1

    async def _discard_file(self, entry: FileEntry) -> None:
        self.bytes_stored -= entry.nbytes
        self.bytes_on_disk -= entry.file_bytes
        try:
            await aiofiles.os.remove(entry.path)
        except FileNotFoundError:
            logger.warning("NVMe file %s was already gone when its key was deleted", entry.path)
        except OSError as exc:
            raise io_error(exc, operation="delete", path=entry.path, offset_bytes=0,
                           length_bytes=entry.file_bytes, folder=self._folder) from exc
