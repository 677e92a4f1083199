"""The memory ledger: every chunk byte counted per tier and kind as storage allocates, moves and
frees it; and ``missing_bytes`` / ``fits``, the one answer budget decisions get."""

from __future__ import annotations

import torch

from chunks import Chunk, ChunkKind, ChunkStorage, MemoryLedger, TensorSlot, Tier, fits, missing_bytes


def test_missing_bytes_is_the_overshoot_and_the_limit_itself_fits():
    assert missing_bytes(100, 60, 40) == 0 and fits(100, 60, 40)  # exactly at the limit fits
    assert missing_bytes(100, 60, 41) == 1 and not fits(100, 60, 41)
    assert missing_bytes(100) == 0 and missing_bytes(-5, 10) == 15  # a limit already used up
    assert missing_bytes(None, 10**15) == 0 and fits(None, 10**15)  # no limit: everything fits


def test_storage_counts_per_tier_and_kind_with_peaks_and_transfers():
    storage = ChunkStorage(torch.device("cpu"))
    ledger = storage.ledger
    slots = (TensorSlot(0, 0, 16, torch.Size([16]), "w"),)
    param = Chunk(index=0, kind=ChunkKind.PARAM, capacity=16, dtype=torch.float32, storage=storage, slots=slots)
    m = Chunk(index=0, kind=ChunkKind.EXP_AVG, capacity=16, dtype=torch.float32, storage=storage, slots=slots)
    param.allocate(Tier.HOST)
    m.allocate(Tier.HOST)
    param.fetch(keep_host=True)  # a second copy: counted on both tiers
    assert (ledger.kind_bytes(Tier.HOST, ChunkKind.PARAM), ledger.kind_bytes(Tier.DEVICE, ChunkKind.PARAM)) == (64, 64)
    assert ledger.bytes_on(Tier.HOST) == 128 and ledger.payloads(Tier.HOST) == 2
    assert ledger.transfers.h2d_bytes == 64
    param.drop_device_copy()
    m.move_to(Tier.DEVICE)
    assert ledger.bytes_on(Tier.DEVICE) == 64 and ledger.kind_bytes(Tier.DEVICE, ChunkKind.PARAM) == 0
    assert ledger.kind_peak_bytes(Tier.DEVICE, ChunkKind.PARAM) == 64 and ledger.peak_bytes(Tier.DEVICE) == 64
    ledger.reset_peaks(Tier.DEVICE)  # the device's peaks restart from now; the host's are kept
    assert ledger.kind_peak_bytes(Tier.DEVICE, ChunkKind.PARAM) == 0 and ledger.peak_bytes(Tier.HOST) == 128
    ledger.start_step()
    assert ledger.transfers.h2d_bytes == 0 and ledger.peak_bytes(Tier.HOST) == 64
    param.release()
    m.release()
    assert all(ledger.bytes_on(t) == 0 and ledger.payloads(t) == 0 for t in Tier)


def test_the_host_pool_reports_what_it_holds_to_the_ledger():
    storage = ChunkStorage(torch.device("cpu"))
    chunk = Chunk(index=0, kind=ChunkKind.GRAD, capacity=300_000, dtype=torch.float32, storage=storage)
    chunk.allocate(Tier.HOST)
    assert storage.ledger.host_pool_bytes == storage.pool.bytes_reserved >= chunk.nbytes
    chunk.release()  # the buffer stays in the pool for reuse, and in the gauge
    assert storage.ledger.bytes_on(Tier.HOST) == 0 and storage.ledger.host_pool_bytes == storage.pool.bytes_reserved
    storage.pool.trim()
    assert storage.ledger.host_pool_bytes == 0
    assert "host pool 0" in repr(MemoryLedger())
