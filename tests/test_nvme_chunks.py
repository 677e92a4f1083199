"""Chunks on NVMe: the two-phase state machine, bytes read back from disk, the host pool, and the
choice of which groups go to NVMe."""

from __future__ import annotations

import os
import time

import pytest
import torch

from chunks import Chunk, ChunkKind, ChunkState, ChunkStorage, Tier
from gemini.policies.nvme_choice import choose_nvme_groups
from gemini.policies.footprint import static_choice
from offload import NvmeCorruptionError, NvmeStore


@pytest.fixture
def storage(tmp_path):
    s = ChunkStorage(torch.device("cpu"))
    s.nvme = NvmeStore(tmp_path)
    yield s
    s.close_nvme()


def _chunk(storage, capacity=5000, dtype=torch.float32, index=0) -> Chunk:
    return Chunk(index=index, kind=ChunkKind.EXP_AVG, capacity=capacity, dtype=dtype, storage=storage)


@pytest.mark.parametrize("capacity,dtype", [(1, torch.float32), (1023, torch.bfloat16), (300_001, torch.float32)])
def test_spill_and_load_round_trip_counts_every_byte(storage, capacity, dtype):
    c = _chunk(storage, capacity, dtype)
    c.allocate(Tier.HOST)
    want = torch.randn(capacity).to(dtype)
    c.payload(Tier.HOST).copy_(want)
    c.start_spill()
    assert c.state is ChunkState.HOST and c.io_pending  # unchanged until the write is confirmed
    c.finish_spill()
    assert c.state is ChunkState.NVME and storage.ledger.bytes_on(Tier.HOST) == 0
    assert storage.ledger.bytes_on(Tier.NVME) == c.nbytes and storage.ledger.transfers.nvme_write_bytes == c.nbytes
    # The file holds the bytes: read them back from disk independently of the store.
    with open(storage.nvme.path_of(c.key), "rb") as f:
        raw = f.read(c.nbytes)
    assert raw == want.view(torch.uint8).numpy().tobytes()
    c.start_load()
    assert c.state is ChunkState.NVME
    c.finish_load()
    assert c.state is ChunkState.HOST_AND_NVME and torch.equal(c.payload(Tier.HOST), want)
    assert storage.ledger.transfers.nvme_read_bytes == c.nbytes
    c.drop_host_copy()  # the file is current: nothing is written
    assert c.state is ChunkState.NVME and storage.ledger.transfers.nvme_write_bytes == c.nbytes
    c.release()
    assert c.state is ChunkState.RELEASED and storage.ledger.bytes_on(Tier.NVME) == 0 and len(storage.nvme) == 0


def test_invalid_moves_raise_with_the_state(storage):
    c = _chunk(storage)
    c.allocate(Tier.HOST)
    with pytest.raises(RuntimeError, match="expected one of"):
        c.start_load()  # nothing on NVMe yet
    c.start_spill()
    with pytest.raises(RuntimeError, match="write in flight"):
        c.fetch(keep_host=False)
    with pytest.raises(RuntimeError, match="no NVMe read in flight"):
        c.finish_load()
    c.finish_spill(keep_host=True)
    assert c.state is ChunkState.HOST_AND_NVME
    with pytest.raises(RuntimeError, match="expected one of"):
        c.fetch(keep_host=False)  # only host copies of chunks without a current file go to the device
    c.drop_nvme_copy()
    assert c.state is ChunkState.HOST


def test_a_corrupted_file_is_an_error_and_the_chunk_stays_in_its_file(storage):
    c = _chunk(storage, 300_000)
    c.allocate(Tier.HOST)
    c.payload(Tier.HOST).copy_(torch.arange(300_000, dtype=torch.float32))
    c.start_spill()
    c.finish_spill()
    path = storage.nvme.path_of(c.key)
    with open(path, "r+b") as f:
        f.seek(1_100_000)
        byte = f.read(1)
        f.seek(1_100_000)
        f.write(bytes([byte[0] ^ 0x10]))
    c.start_load()
    with pytest.raises(NvmeCorruptionError, match="checksum") as err:
        c.finish_load()
    assert path in str(err.value) and "offset" in str(err.value)
    assert c.state is ChunkState.NVME and storage.ledger.bytes_on(Tier.HOST) == 0  # the buffer was freed


def test_host_payloads_come_from_the_pool_and_are_reused(storage):
    a = _chunk(storage, 300_000, index=0)
    b = _chunk(storage, 300_000, index=1)
    a.allocate(Tier.HOST)
    first = a.payload(Tier.HOST).data_ptr()
    assert first % 4096 == 0  # aligned: the store does direct I/O on it without staging
    a.release()
    b.allocate(Tier.HOST, zero=True)
    assert b.payload(Tier.HOST).data_ptr() == first and not b.payload(Tier.HOST).any()
    assert storage.pool.stats().reuses == 1


def _sizes(*bytes_per_group):
    return [(i, b) for i, b in enumerate(bytes_per_group)]


def test_choice_keeps_the_first_groups_in_memory_and_budgets_the_pipeline():
    groups = _sizes(100, 100, 100, 100, 100)
    # Everything fits: nothing streams, no staging.
    fit = choose_nvme_groups(groups, cpu_memory=500, fraction=0.0, depth=1, nvme_available=True)
    assert fit.nvme_groups == frozenset() and fit.host_bytes == 500 and fit.staging_bytes == 0
    # 450 bytes: 3 groups of staging (depth 1) leave room for one group in memory.
    tight = choose_nvme_groups(groups, cpu_memory=450, fraction=0.0, depth=1, nvme_available=True)
    assert tight.nvme_groups == {1, 2, 3, 4} and tight.staging_bytes == 300 and tight.host_bytes == 100
    # The fraction always takes the last groups; the budget then decides the others.
    forced = choose_nvme_groups(groups, cpu_memory=None, fraction=0.4, depth=1, nvme_available=True)
    assert forced.nvme_groups == {3, 4}
    both = choose_nvme_groups(groups, cpu_memory=500, fraction=0.2, depth=1, nvme_available=True)
    assert both.nvme_groups == {2, 3, 4}
    # Whole groups, the nearest count, halves up: Python's round() sent 0.5 of one group and 0.25
    # of two to none, and 0.75 of two to both.
    for sizes, fraction, want in [((100,), 0.5, {0}), ((100, 100), 0.25, {1}), ((100, 100), 0.75, {0, 1}),
                                  ((100, 100), 0.2, set()), ((100,) * 4, 0.5, {2, 3}), ((100,) * 3, 0.5, {1, 2})]:
        got = choose_nvme_groups(_sizes(*sizes), cpu_memory=None, fraction=fraction, depth=1, nvme_available=True)
        assert got.nvme_groups == want, (sizes, fraction)


def test_static_fractions_round_as_the_nvme_share():
    """static's two fractions count whole groups as nvme_offload_fraction does (halves up): Python's round() kept
    none of one group at static_param_device_fraction=0.5 and offloaded none at static_optimizer_offload_fraction=0.5,
    and rounded 0.5 of five groups to two (halves to even)."""
    for n, fraction, kept, offloaded in [(1, 0.5, 1, 1), (2, 0.5, 1, 1), (3, 0.5, 2, 2), (5, 0.5, 3, 3),
                                         (4, 0.3, 1, 1), (4, 0.0, 0, 0), (4, 1.0, 4, 4), (3, 0.1, 0, 0)]:
        groups = list(range(n))
        on_device, states_on_device = static_choice(groups, groups, param_device_fraction=fraction,
                                                    optimizer_offload_fraction=fraction)
        assert on_device == set(range(kept)), (n, fraction)  # the first groups stay
        assert states_on_device == set(range(n - offloaded)), (n, fraction)  # the last ones go to the host


def test_choice_errors_name_the_field():
    groups = _sizes(100, 100)
    with pytest.raises(ValueError, match=r"cpu_memory=150 .*nvme_dir is None"):
        choose_nvme_groups(groups, cpu_memory=150, fraction=0.0, depth=1, nvme_available=False)
    # 150 bytes: no room for depth 1's three groups; depth 0 streams one group at a time.
    shallow = choose_nvme_groups(groups, cpu_memory=150, fraction=0.0, depth=2, nvme_available=True)
    assert shallow.depth == 0 and shallow.staging_bytes == 100 and shallow.nvme_groups == {0, 1}
    five = _sizes(100, 100, 100, 100, 100)
    assert choose_nvme_groups(five, cpu_memory=320, fraction=0.0, depth=2, nvme_available=True).depth == 1
    with pytest.raises(ValueError, match=r"cpu_memory=99 .*too small.*at least one chunk group.*at least 100"):
        choose_nvme_groups(groups, cpu_memory=99, fraction=0.0, depth=1, nvme_available=True)


def _on_disk(storage, key, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``key``'s file, read independently of the store."""
    with open(storage.nvme.path_of(key), "rb") as f:
        raw = f.read(like.numel() * like.element_size())
    return torch.frombuffer(bytearray(raw), dtype=like.dtype)


def _updated_in_step(c: Chunk, new: torch.Tensor) -> None:
    """What the NVMe step pipeline does to a chunk: read, update in memory, write back."""
    c.start_load()
    c.finish_load()
    c.drop_nvme_copy()
    c.payload(Tier.HOST).copy_(new)
    c.start_spill()
    c.finish_spill()


def _in_file(storage, values: torch.Tensor) -> Chunk:
    """A chunk holding ``values`` in its file (NVME)."""
    c = _chunk(storage, values.numel())
    c.allocate(Tier.HOST)
    c.payload(Tier.HOST).copy_(values)
    c.start_spill()
    c.finish_spill()
    return c


def test_a_held_file_survives_the_write_and_comes_back_on_restore(storage):
    old, new = torch.randn(3000), torch.randn(3000)
    c = _in_file(storage, old)
    held_key = c.key
    c.hold_file()
    _updated_in_step(c, new)
    assert c.key != held_key and c.state is ChunkState.NVME
    assert torch.equal(_on_disk(storage, held_key, old), old)  # the old file is untouched on disk
    assert torch.equal(_on_disk(storage, c.key, new), new)
    assert storage.ledger.bytes_on(Tier.NVME) == 2 * c.nbytes  # both files are counted while both exist
    c.restore_held_file()  # the step failed
    assert c.key == held_key and c.state is ChunkState.NVME and len(storage.nvme) == 1
    assert storage.ledger.bytes_on(Tier.NVME) == c.nbytes and storage.ledger.bytes_on(Tier.HOST) == 0
    c.start_load()
    c.finish_load()
    assert torch.equal(c.payload(Tier.HOST), old)


def test_a_restore_after_a_failed_write_drops_the_updated_host_copy(storage):
    old = torch.randn(3000)
    c = _in_file(storage, old)
    c.hold_file()
    c.start_load()
    c.finish_load()
    c.drop_nvme_copy()
    c.payload(Tier.HOST).add_(1.0)  # updated; its write then fails, so it stays HOST
    assert c.state is ChunkState.HOST
    c.restore_held_file()
    assert c.state is ChunkState.NVME and storage.ledger.bytes_on(Tier.HOST) == 0
    c.start_load()
    c.finish_load()
    assert torch.equal(c.payload(Tier.HOST), old)


def test_a_released_hold_deletes_the_old_file_and_keeps_the_new(storage):
    new = torch.randn(3000)
    c = _in_file(storage, torch.zeros(3000))
    old_path = storage.nvme.path_of(c.key)
    c.hold_file()
    _updated_in_step(c, new)
    c.release_held_file()  # the step succeeded
    assert storage.ledger.bytes_on(Tier.NVME) == c.nbytes
    deadline = time.monotonic() + 10  # the old file is removed behind the caller
    while os.path.exists(old_path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(old_path) and len(storage.nvme) == 1
    assert torch.equal(_on_disk(storage, c.key, new), new)
    # Outside a step a write replaces the file under the same name.
    key = c.key
    _updated_in_step(c, new + 1)
    assert c.key == key and len(storage.nvme) == 1 and torch.equal(_on_disk(storage, key, new), new + 1)
    c.release()
    assert len(storage.nvme) == 0 and storage.ledger.bytes_on(Tier.NVME) == 0
