import threading

import pytest
import torch

from offload import PinnedHostPool
from offload.pinned_pool import size_class_bytes


def test_size_classes():
    assert size_class_bytes(0) == 4096
    assert size_class_bytes(4097) == 8192
    assert size_class_bytes(300_000) == 1 << 19
    assert size_class_bytes(1 << 20) == 1 << 20
    assert size_class_bytes((1 << 20) + 1) == 2 << 20
    assert size_class_bytes(148 << 20) == 148 << 20  # not 256 MiB


def test_acquire_gives_exact_aligned_views_and_reuses_after_release():
    pool = PinnedHostPool()
    a = pool.acquire(1000, torch.float32)
    assert a.shape == (1000,) and a.dtype == torch.float32 and a.data_ptr() % 4096 == 0
    assert pool.bytes_in_use == 4096 and pool.bytes_reserved == 4096
    other = pool.acquire(3000, torch.float32)  # 12000 B -> the 16 KiB class: a new buffer
    assert other.data_ptr() != a.data_ptr()
    ptr = a.data_ptr()
    pool.release(a)
    b = pool.acquire(500, torch.int64)  # 4000 B: same class, so the same memory
    assert b.data_ptr() == ptr and b.dtype == torch.int64 and b.numel() == 500
    stats = pool.stats()
    assert (stats.allocations, stats.reuses, stats.buffers_in_use) == (2, 1, 2)
    assert pool.bytes_reserved == 4096 + 16384
    with pool.borrow(10) as c:
        assert c.numel() == 10 and c.data_ptr() != ptr
    assert pool.stats().buffers_in_use == 2


@pytest.mark.parametrize("numel", [0, 1000])
def test_a_tensor_acquired_under_inference_mode_can_be_written_after_it(numel):
    """A view taken under inference mode is an inference tensor, which no in-place update may
    touch outside it: chunks moved to the host during an evaluation under inference_mode could not
    be zeroed by ``zero_grad(set_to_none=False)`` nor loaded by ``load_state_dict`` afterwards."""
    pool = PinnedHostPool()
    recycled = pool.acquire(1000, torch.float32)
    pool.release(recycled)  # the next one comes from a buffer made outside inference mode
    with torch.inference_mode():
        tensor = pool.acquire(numel, torch.float32)
    assert not tensor.is_inference()
    tensor.zero_()


def test_release_of_foreign_or_released_tensor_raises():
    pool = PinnedHostPool()
    a = pool.acquire(100)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(a[1:])
    pool.release(a)
    with pytest.raises(ValueError, match="already released"):
        pool.release(a)
    with pytest.raises(ValueError, match="numel=-1"):
        pool.acquire(-1)


def test_empty_tensors_take_no_buffer_and_release_cleanly():
    """A ZeRO rank's part of a small chunk may be empty: two empty tensors at once used to share
    the key data_ptr 0, and the second release raised (one buffer leaked)."""
    pool = PinnedHostPool()
    a, b = pool.acquire(0, torch.float32), pool.acquire(0, torch.float32)
    assert a.numel() == b.numel() == 0 and a.dtype == torch.float32
    assert pool.bytes_in_use == 0 and pool.stats().buffers_in_use == 0
    pool.release(a)
    pool.release(b)
    assert pool.bytes_in_use == 0 and pool.bytes_reserved == 0


def test_limit_names_the_numbers_and_idle_buffers_are_trimmed_first():
    reserved = []  # what the pool tells a ledger: every change of its reserved bytes
    pool = PinnedHostPool(limit_bytes="3MiB", on_reserve=reserved.append)
    a = pool.acquire(2 << 20)
    with pytest.raises(MemoryError) as info:
        pool.acquire(1 << 20 | 1)  # needs a 2 MiB buffer: 4 MiB > 3 MiB
    message = str(info.value)
    assert "3145728" in message and "2097152" in message and "1048576 bytes short" in message
    small = pool.acquire(1000)
    pool.release(small)
    pool.release(a)
    assert sum(reserved) == pool.bytes_reserved == (2 << 20) + 4096
    c = pool.acquire(3 << 20)  # fits only once both idle buffers are freed
    assert c.numel() == 3 << 20 and pool.bytes_reserved == 3 << 20
    assert sum(reserved) == 3 << 20
    pool.release(c)
    assert pool.trim() == 3 << 20 and sum(reserved) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_only_build_hands_out_plain_buffers():
    assert not PinnedHostPool().pinned
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        PinnedHostPool(pin_memory=True)


def test_threads_never_share_a_buffer():
    pool = PinnedHostPool()
    errors = []

    def worker(tag):
        for _ in range(200):
            t = pool.acquire(4096, torch.uint8)
            t.fill_(tag)
            if not bool((t == tag).all()):
                errors.append(tag)
            pool.release(t)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and pool.bytes_in_use == 0 and pool.stats().buffers_total <= 4


def test_large_buffers_are_huge_page_aligned_and_small_ones_page_aligned():
    from offload.aligned import HUGE_PAGE_BYTES, aligned_empty

    small = aligned_empty(10_000)
    assert small.numel() == 10_000 and small.data_ptr() % 4096 == 0
    large = aligned_empty(3 * HUGE_PAGE_BYTES + 5)
    assert large.numel() == 3 * HUGE_PAGE_BYTES + 5 and large.data_ptr() % 4096 == 0
    if hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        assert large.data_ptr() % HUGE_PAGE_BYTES == 0
    large.fill_(7)  # the memory is usable end to end
    assert int(large[-1]) == 7 and int(large[0]) == 7


@pytest.mark.cuda
def test_cuda_pool_pins_once_and_reuses():
    pool = PinnedHostPool()
    a = pool.acquire(1 << 20, torch.float16)
    assert pool.pinned and a.is_pinned()
    ptr = a.data_ptr()
    pool.release(a)
    assert pool.acquire(1 << 20, torch.float16).data_ptr() == ptr
