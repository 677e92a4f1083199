"""Aligned host buffers and zero-copy byte views of tensors, as direct I/O needs them."""

from __future__ import annotations

import contextlib
import ctypes
import mmap

import torch

__all__ = ["ALIGNMENT_BYTES", "HUGE_PAGE_BYTES", "round_up", "aligned_empty", "byte_view", "tensor_nbytes",
           "outside_inference_mode"]

# [Note: 4 KiB alignment]
# O_DIRECT requires the buffer address, the length and the file offset to be multiples of
# the device's logical block size: 512 B on most NVMe drives, 4 KiB on some (and on most
# 4Kn enterprise drives). Aligning to 4 KiB satisfies both, and equals the page size, so a
# page-aligned pinned allocation qualifies as it is.
ALIGNMENT_BYTES = 4096


def round_up(n: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is >= ``n`` (bytes in offload, elements in chunks)."""
    if multiple <= 0:
        raise ValueError(f"{multiple=} must be positive")
    return -(-n // multiple) * multiple


HUGE_PAGE_BYTES = 2 << 20

# [Note: huge pages for I/O buffers]
# Direct I/O pins the buffer's pages for each request and hands the device one scatter-gather
# segment per physically contiguous run. A 1 MiB request over scattered 4 KiB pages is 256
# segments, more than many queues take at once (virtio-blk here: max_segments=254), so it is
# split, and every page is looked up and pinned. Over transparent huge pages it is one or two
# segments. Measured on the development VM, interleaved, same files: NvmeStore reads into
# 4 KiB-page buffers 0.7-1.0 GB/s, into huge-page buffers 1.4-1.9 GB/s (DeepSpeed's mlocked
# buffers: 1.6-1.8 GB/s). So large host buffers come from a private anonymous mapping with
# MADV_HUGEPAGE, which also works where THP is "madvise"-only (the common default), and
# starts on a 2 MiB boundary so that every whole 2 MiB of the buffer can be one huge page.
# (Python's default anonymous mmap is MAP_SHARED, i.e. shmem, which THP ignores.)


def _huge_page_empty(nbytes: int) -> torch.Tensor | None:
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return None
    try:
        # The extra 2 MiB is address space only: the unused head is never touched.
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive
    offset = (-whole.data_ptr()) % HUGE_PAGE_BYTES
    return whole[offset:offset + nbytes]


# [Note: buffers made under inference mode]
# A tensor allocated inside ``torch.inference_mode()`` is an inference tensor for good: no
# in-place update is allowed on it outside inference mode. Buffers that outlive the call that
# made them (chunk payloads, pool buffers) are made outside it, so that an evaluation pass under
# ``inference_mode`` (whose hooks fetch chunks) leaves buffers that training can still write.
# Leaving inference mode turns grad mode on, which allocation does not care about.


def outside_inference_mode() -> contextlib.AbstractContextManager:
    """A context in which new tensors are normal ones (see [Note: buffers made under inference mode])."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def aligned_empty(nbytes: int, *, pin_memory: bool = False, huge_pages: bool | None = None) -> torch.Tensor:
    """An uninitialised 1-D uint8 tensor of ``nbytes`` whose data starts on a 4 KiB boundary.

    ``huge_pages``: None uses transparent huge pages for unpinned buffers of 2 MiB or more
    (see [Note: huge pages for I/O buffers]); False never does. Pinned buffers come from
    the CUDA host allocator, which is page-aligned already.
    """
    if huge_pages is None:
        huge_pages = not pin_memory and nbytes >= HUGE_PAGE_BYTES
    with outside_inference_mode():
        if huge_pages and not pin_memory:
            buffer = _huge_page_empty(nbytes)
            if buffer is not None:
                return buffer
        # torch's CPU allocator only promises 64-byte alignment: allocate one alignment unit
        # more and slice; the returned view keeps the whole allocation alive.
        raw = torch.empty(nbytes + ALIGNMENT_BYTES, dtype=torch.uint8, pin_memory=pin_memory)
        offset = (-raw.data_ptr()) % ALIGNMENT_BYTES
        return raw[offset:offset + nbytes]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes, without copying.

    Works for every dtype (bfloat16 and float8 included, which numpy cannot represent). The
    view does not keep the tensor alive: the caller must hold a reference while using it.
    """
    nbytes = tensor_nbytes(tensor)
    if nbytes == 0:
        return memoryview(bytearray(0))
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")
