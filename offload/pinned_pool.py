"""A pool of reusable host buffers, page-locked when CUDA is present.

Pinning memory (``cudaHostAlloc``) costs milliseconds per call and fragments the kernel's
page-locked limit, so buffers are pinned once and recycled by size class, never per step
(DeepSpeed #7150: pinned-memory allocation failures under repeated pinning).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Iterator

import torch

from offload.aligned import ALIGNMENT_BYTES, aligned_empty, outside_inference_mode, round_up
from offload.sizes import format_size, parse_size

__all__ = ["PinnedHostPool", "PoolStats", "size_class_bytes", "HOST_ALIGNMENT_BYTES"]

logger = logging.getLogger(__name__)

# Every buffer starts on a 4 KiB boundary: the NVMe store can then read and write it with
# O_DIRECT without a staging copy (see [Note: 4 KiB alignment] in offload/aligned.py).
HOST_ALIGNMENT_BYTES = ALIGNMENT_BYTES

_SMALL_CLASS_LIMIT_BYTES = 1 << 20
_MIN_CLASS_BYTES = HOST_ALIGNMENT_BYTES

# [Note: size classes]
# Below 1 MiB a request is rounded up to a power of two (at least 4 KiB): small buffers are
# few and varied (tails, staging, scalars), and powers of two keep the number of classes (and
# so of idle cached buffers) small, at a worst-case cost of 2x on a few KiB.
# From 1 MiB up a request is rounded up to a multiple of 1 MiB instead. The big users are
# chunk buffers, and chunk sizes come out of the chunk-size search as arbitrary element counts
# (e.g. 37 Mi fp32 elements = 148 MiB): a power-of-two class would pin 256 MiB for it, 73%
# waste of the scarcest host resource, while 1 MiB classes waste under 1 MiB per buffer. The
# chunks of one model all have the same size, so they all land in one class and reuse each
# other's buffers exactly as power-of-two classes would.
# Unpinned buffers of 2 MiB or more live on transparent huge pages, which doubled direct-I/O
# read speed on the development VM (see [Note: huge pages for I/O buffers] in aligned.py).


def size_class_bytes(nbytes: int) -> int:
    """The capacity of the buffer that serves a request of ``nbytes`` bytes."""
    if nbytes <= _MIN_CLASS_BYTES:
        return _MIN_CLASS_BYTES
    if nbytes <= _SMALL_CLASS_LIMIT_BYTES:
        return 1 << (nbytes - 1).bit_length()
    return round_up(nbytes, _SMALL_CLASS_LIMIT_BYTES)


@dataclass(frozen=True, kw_only=True)
class PoolStats:
    bytes_reserved: int
    bytes_in_use: int
    buffers_total: int
    buffers_in_use: int
    allocations: int
    reuses: int


class _Block:
    """One buffer: ``aligned`` is its 4 KiB-aligned memory (a view that owns the allocation)."""

    __slots__ = ("aligned", "class_bytes")

    def __init__(self, aligned: torch.Tensor, class_bytes: int) -> None:
        self.aligned = aligned
        self.class_bytes = class_bytes


class PinnedHostPool:
    """Hands out host tensors of exactly the requested size, backed by recycled buffers.

    ``acquire`` returns a 1-D tensor of ``numel`` elements whose storage starts on a 4 KiB
    boundary; ``release`` gives it back for reuse by the next request of the same size class.
    The contents of an acquired buffer are whatever the previous user left there.

    ``pin_memory``: None pins when CUDA is available; True demands pinning (raises on a
    CPU-only build, where torch cannot pin); False never pins.
    ``limit_bytes``: cap on the bytes the pool holds (int or "8GiB"); None is unlimited.
    ``on_reserve``: told every change of :attr:`bytes_reserved` (positive: a new buffer;
    negative: idle buffers trimmed), so that a ledger can show what the pool holds.
    """

    def __init__(self, *, limit_bytes: int | str | None = None, pin_memory: bool | None = None,
                 on_reserve: Callable[[int], None] | None = None) -> None:
        self._limit_bytes = None if limit_bytes is None else parse_size(limit_bytes, field="limit_bytes")
        cuda = torch.cuda.is_available()
        if pin_memory is None:
            pin_memory = cuda
        elif pin_memory and not cuda:
            raise ValueError(
                "pin_memory=True needs CUDA, but torch.cuda.is_available() is False (a CPU-only"
                " torch build cannot pin memory); accepted here: None or False"
            )
        self._pin_memory = bool(pin_memory)
        self._on_reserve = on_reserve
        self._lock = threading.Lock()
        self._free: dict[int, list[_Block]] = {}
        self._in_use: dict[int, _Block] = {}  # keyed by the handed-out tensor's data_ptr
        self._bytes_reserved = 0
        self._bytes_in_use = 0
        self._buffers_total = 0
        self._allocations = 0
        self._reuses = 0

    @property
    def pinned(self) -> bool:
        return self._pin_memory

    @property
    def limit_bytes(self) -> int | None:
        return self._limit_bytes

    @property
    def bytes_reserved(self) -> int:
        """Capacity of every buffer the pool holds, in use or idle."""
        return self._bytes_reserved

    @property
    def bytes_in_use(self) -> int:
        """Capacity of the buffers currently handed out."""
        return self._bytes_in_use

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(bytes_reserved=self._bytes_reserved, bytes_in_use=self._bytes_in_use,
                             buffers_total=self._buffers_total, buffers_in_use=len(self._in_use),
                             allocations=self._allocations, reuses=self._reuses)

    def acquire(self, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` from a recycled buffer."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel={numel!r} must be a non-negative int")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype={dtype!r} must be a torch.dtype")
        # The tensor handed out outlives the call: a view taken under inference mode would be an
        # inference tensor, which training could not write (see [Note: buffers made under inference mode]).
        with outside_inference_mode():
            return self._acquire(numel, dtype)

    def _acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if numel == 0:  # no block: every empty tensor's data_ptr is 0, so none could be told apart
            return torch.empty(0, dtype=dtype)
        element_bytes = dtype.itemsize
        nbytes = numel * element_bytes
        class_bytes = size_class_bytes(nbytes)
        with self._lock:
            free = self._free.get(class_bytes)
            if free:
                block = free.pop()
                self._reuses += 1
            else:
                block = self._allocate_locked(class_bytes, nbytes)
            tensor = block.aligned[:nbytes].view(dtype)
            self._in_use[tensor.data_ptr()] = block
            self._bytes_in_use += class_bytes
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        """Return a tensor obtained from ``acquire``; the caller must not use it afterwards."""
        if tensor.numel() == 0:
            return  # handed out without a block
        with self._lock:
            block = self._in_use.pop(tensor.data_ptr(), None)
            if block is None:
                raise ValueError(
                    "release() got a tensor this pool did not hand out, or one already released"
                    f" (data_ptr={tensor.data_ptr():#x}, {tensor.numel()} x {tensor.dtype});"
                    " pass the exact tensor acquire() returned, not a slice of it"
                )
            self._bytes_in_use -= block.class_bytes
            self._free.setdefault(block.class_bytes, []).append(block)

    @contextlib.contextmanager
    def borrow(self, numel: int, dtype: torch.dtype = torch.uint8) -> Iterator[torch.Tensor]:
        """``with pool.borrow(n, torch.float32) as buf:`` acquires and always releases."""
        tensor = self.acquire(numel, dtype)
        try:
            yield tensor
        finally:
            self.release(tensor)

    def trim(self) -> int:
        """Free every idle buffer; return the bytes given back."""
        with self._lock:
            return self._trim_locked(keep_class=None)

    def close(self) -> None:
        """Free idle buffers; buffers still in use are freed when their tensors die."""
        self.trim()

    def _allocate_locked(self, class_bytes: int, nbytes: int) -> _Block:
        if self._limit_bytes is not None and self._bytes_reserved + class_bytes > self._limit_bytes:
            # Idle buffers of other classes are dead weight now; drop them before giving up.
            self._trim_locked(keep_class=class_bytes)
            if self._bytes_reserved + class_bytes > self._limit_bytes:
                missing = self._bytes_reserved + class_bytes - self._limit_bytes
                raise MemoryError(
                    f"PinnedHostPool limit exceeded: a request of {nbytes} bytes needs a new"
                    f" {class_bytes}-byte buffer ({format_size(class_bytes)}), the pool holds"
                    f" {self._bytes_reserved} bytes ({self._bytes_in_use} in use) and its limit is"
                    f" {self._limit_bytes} bytes: {missing} bytes short"
                )
        aligned = self._allocate_raw(class_bytes)
        self._bytes_reserved += class_bytes
        if self._on_reserve is not None:
            self._on_reserve(class_bytes)
        self._buffers_total += 1
        self._allocations += 1
        logger.debug("PinnedHostPool: new %s buffer (pinned=%s, reserved now %s)",
                     format_size(class_bytes), self._pin_memory, format_size(self._bytes_reserved))
        return _Block(aligned, class_bytes)

    def _allocate_raw(self, nbytes: int) -> torch.Tensor:
        try:
            return aligned_empty(nbytes, pin_memory=self._pin_memory)
        except RuntimeError as exc:
            raise MemoryError(
                f"could not allocate{' and pin' if self._pin_memory else ''} {nbytes} bytes of host"
                f" memory ({format_size(nbytes)}) with {self._bytes_reserved} bytes already held by"
                f" this pool: {exc}. Lower the host budget"
                + (" or raise the locked-memory limit (ulimit -l)" if self._pin_memory else "")
            ) from exc

    def _trim_locked(self, *, keep_class: int | None) -> int:
        freed = 0
        for class_bytes in list(self._free):
            if class_bytes == keep_class:
                continue
            for block in self._free.pop(class_bytes):
                freed += block.class_bytes
                self._buffers_total -= 1
        self._bytes_reserved -= freed
        if self._on_reserve is not None and freed:
            self._on_reserve(-freed)
        if self._pin_memory and freed:
            _empty_pinned_cache()
        return freed

    def __repr__(self) -> str:
        return (f"PinnedHostPool(pinned={self._pin_memory}, reserved={format_size(self._bytes_reserved)},"
                f" in_use={format_size(self._bytes_in_use)})")


def _empty_pinned_cache() -> None:
    """torch keeps freed pinned blocks in its own cache, still page-locked: give them back to
    the system too, or a trimmed pool's memory stays pinned."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
