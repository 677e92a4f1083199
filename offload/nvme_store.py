"""Chunk payloads in files on a fast drive: aligned, asynchronous, checksummed.

``NvmeStore`` writes CPU tensors to files in a private folder under ``nvme_dir`` and reads
them back into preallocated tensors. Requests return ``concurrent.futures.Future``s and are
served by an asyncio loop on a background thread, whose blocking calls (open, fallocate,
``preadv``/``pwritev`` of one piece, close, unlink) run through ``aiofiles.os`` wrappers on a
bounded thread pool.

This module is the store's API: its settings, its counters and the store itself. Behind it:
offload/store_folder.py makes its private folder and removes it when the store is done,
offload/direct_io.py decides whether O_DIRECT works there, offload/nvme_files.py runs the
requests on the loop thread, and offload/piece_io.py does each piece's blocking I/O.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import logging
import os
from typing import Hashable

import torch

from offload.aligned import ALIGNMENT_BYTES
from offload.direct_io import IoMode, choose_io_mode
from offload.io_loop import IoLoopThread
from offload.nvme_files import NvmeFiles
from offload.sizes import format_size, parse_size
from offload.stale import remove_stale_folders
from offload.store_folder import check_nvme_dir, default_rank, make_store_folder, register_cleanup, shutdown

# Importable from this module before it was split, and so still; the modules above use them now.
from offload.aligned import aligned_empty, byte_view, round_up, tensor_nbytes
from offload.errors import NvmeCorruptionError, NvmeStoreError
from offload.stale import make_private_folder

__all__ = ["NvmeStore", "NvmeStoreConfig", "NvmeStats", "IoMode", "StoreState"]
# Referenced, so that pyflakes does not report the names above as unused imports.
_REEXPORTED = (aligned_empty, byte_view, round_up, tensor_nbytes, NvmeCorruptionError, NvmeStoreError,
               make_private_folder)

logger = logging.getLogger(__name__)


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


class NvmeStore:
    """Asynchronous, checksummed storage of CPU tensors in files under ``nvme_dir``.

    ``write(key, tensor)`` and ``read(key, out)`` return futures; the caller must keep a
    written tensor unchanged and a read's ``out`` untouched until the future is done. The
    store never modifies a tensor it writes; after a failed read ``out`` holds unspecified
    bytes. Requests on the same key run in the order they were made; requests on different
    keys overlap. Cancelling a future stops the wait, not the I/O (see [Note: cancellation] in
    offload/nvme_files.py). Use as a context manager, or call ``close()``; files are also removed
    when the store is garbage-collected, at interpreter exit and on SIGTERM or SIGHUP (see [Note: SIGTERM]
    in offload/store_folder.py).
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

        check_nvme_dir(self._nvme_dir)
        self.stale_folders = remove_stale_folders(self._nvme_dir, remove=self.config.clean_stale)
        rank_value = self.config.rank if self.config.rank is not None else default_rank()
        self._folder, lock_fd = make_store_folder(self._nvme_dir, rank=rank_value)

        try:
            self._io_mode = choose_io_mode(self._folder, nvme_dir=self._nvme_dir,
                                           use_direct_io=self.config.use_direct_io)
            self._io = IoLoopThread(name=f"nvme-store-{os.path.basename(self._folder)}",
                                    max_workers=self.config.max_in_flight,
                                    cpu_workers=self.config.checksum_workers)
        except BaseException:
            shutdown(None, self._folder, os.getpid(), lock_fd, -1)
            raise
        self._finalizer = register_cleanup(self, self._io, self._folder, lock_fd)

        # Loop-thread state: the files and the requests on them.
        self._files = NvmeFiles(self._folder, nvme_dir=self._nvme_dir, io=self._io, io_mode=self._io_mode,
                                max_in_flight=self.config.max_in_flight, block_bytes=self._block_bytes,
                                piece_bytes=self._piece_bytes, verify_checksums=self.config.verify_checksums,
                                preallocate=self.config.preallocate)
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
        return self._files.bytes_stored

    @property
    def bytes_on_disk(self) -> int:
        """File bytes, with the padding direct I/O needs."""
        return self._files.bytes_on_disk

    @property
    def read_bytes(self) -> int:
        return self._files.read_bytes

    @property
    def write_bytes(self) -> int:
        return self._files.write_bytes

    @property
    def read_seconds(self) -> float:
        return self._files.read_clock.seconds

    @property
    def write_seconds(self) -> float:
        return self._files.write_clock.seconds

    def stats(self) -> NvmeStats:
        files = self._files
        return NvmeStats(io_mode=self._io_mode, keys=len(files.entries), bytes_stored=files.bytes_stored,
                         bytes_on_disk=files.bytes_on_disk, read_bytes=files.read_bytes,
                         write_bytes=files.write_bytes, read_seconds=self.read_seconds,
                         write_seconds=self.write_seconds, reads=files.reads, writes=files.writes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._files.entries

    def __len__(self) -> int:
        return len(self._files.entries)

    def keys(self) -> list[Hashable]:
        return list(self._files.entries)

    def path_of(self, key: Hashable) -> str:
        """The file holding a completed write of ``key`` (for diagnostics and tests)."""
        return self._files.entry(key).path

    def write(self, key: Hashable, tensor: torch.Tensor) -> "concurrent.futures.Future[None]":
        """Store ``tensor``'s bytes under ``key`` (replacing an earlier value once complete)."""
        self._check_open()
        _check_host_tensor(tensor, "tensor")
        return self._submit(self._files.write_request(key, tensor))

    def read(self, key: Hashable, out: torch.Tensor) -> "concurrent.futures.Future[torch.Tensor]":
        """Read ``key`` into ``out`` (same dtype and element count); the future yields ``out``."""
        self._check_open()
        _check_host_tensor(out, "out")
        return self._submit(self._files.read_request(key, out))

    def delete(self, key: Hashable) -> "concurrent.futures.Future[None]":
        """Remove ``key`` and its file, after the requests already made on it."""
        self._check_open()
        return self._submit(self._files.delete_request(key))

    def close(self) -> None:
        """Wait for requests in flight, then stop the I/O threads and delete every file."""
        if self._state is StoreState.CLOSED:
            return
        if self._io.on_own_thread():
            raise RuntimeError("NvmeStore.close() was called from the store's own I/O thread (a"
                               " future's done-callback?); call it from another thread")
        self._state = StoreState.CLOSED
        self._io.submit(self._files.drain()).result()
        self._files.forget()
        self._finalizer()
        logger.debug("NvmeStore in %s closed", self._folder)

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NvmeStore({self._folder!r}, {self._io_mode.value}, {self._state.value},"
                f" {len(self._files.entries)} keys, {format_size(self._files.bytes_stored)})")

    # -- submission (caller threads) -------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not StoreState.OPEN:
            raise RuntimeError(f"NvmeStore in {self._folder} is closed")

    def _submit(self, coro) -> concurrent.futures.Future:
        return self._io.submit(self._files.run_to_completion(coro, self))


def _check_host_tensor(tensor: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}; the NVMe store moves host tensors only"
                         " (copy into a PinnedHostPool buffer first)")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous; the NVMe store needs contiguous tensors")

