"""Chunk state machine, byte accounting, layout, and the chunk-size search."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from chunks import Chunk, ChunkKind, ChunkManager, ChunkState, ChunkStorage, TensorSlot, Tier, plan_layout, search_chunk_size
from chunks.layout import slot_offsets
from chunks.search import default_search_range, waste_for
import gemini


def _chunk(storage, capacity=16, dtype=torch.float32):
    slots = (TensorSlot(0, 0, 6, torch.Size([2, 3]), "a"), TensorSlot(1, 6, 4, torch.Size([4]), "b"))
    return Chunk(index=0, kind=ChunkKind.PARAM, capacity=capacity, dtype=dtype, storage=storage, slots=slots)


def test_moves_copy_real_bytes_and_count_them():
    storage = ChunkStorage(torch.device("cpu"))
    c = _chunk(storage)
    assert c.state is ChunkState.RELEASED and storage.ledger.bytes_on(Tier.HOST) == 0
    c.allocate(Tier.HOST)
    c.payload(Tier.HOST)[:10] = torch.arange(10.0)
    assert storage.ledger.bytes_on(Tier.HOST) == 64 and c.nbytes == 64
    c.fetch(keep_host=True)
    assert c.state is ChunkState.HOST_AND_DEVICE
    host, dev = c.payload(Tier.HOST), c.payload(Tier.DEVICE)
    assert host.data_ptr() != dev.data_ptr()  # a real second buffer, even on the CPU stand-in
    assert torch.equal(host, dev)
    assert storage.ledger.bytes_on(Tier.DEVICE) == 64 and storage.ledger.transfers.h2d_bytes == 64
    c.drop_device_copy()  # clean copy: no bytes move back
    assert c.state is ChunkState.HOST and storage.ledger.transfers.d2h_bytes == 0 and storage.ledger.bytes_on(Tier.DEVICE) == 0
    c.move_to(Tier.DEVICE)
    assert c.state is ChunkState.DEVICE and storage.ledger.bytes_on(Tier.HOST) == 0
    c.payload(Tier.DEVICE)[0] = 42.0  # written on the device...
    c.offload()  # ...so it must be copied back
    assert c.state is ChunkState.HOST and storage.ledger.transfers.d2h_bytes == 64
    assert c.view(c.slots[0])[0, 0].item() == 42.0
    assert torch.equal(c.view(c.slots[1]), torch.arange(6.0, 10.0))
    assert storage.ledger.peak_bytes(Tier.DEVICE) == 64 and storage.ledger.peak_bytes(Tier.HOST) == 64
    c.release()
    assert c.state is ChunkState.RELEASED and storage.ledger.bytes_on(Tier.HOST) == 0


def test_invalid_transitions_raise_with_state():
    storage = ChunkStorage(torch.device("cpu"))
    c = _chunk(storage)
    with pytest.raises(RuntimeError, match=r"is ChunkState.RELEASED, expected one of \['HOST'\]"):
        c.fetch(keep_host=True)
    c.allocate(Tier.HOST)
    with pytest.raises(RuntimeError, match="expected one of"):
        c.allocate(Tier.DEVICE)
    with pytest.raises(RuntimeError, match="expected one of"):
        c.drop_device_copy()
    with pytest.raises(RuntimeError, match="no device copy"):
        c.payload(Tier.DEVICE)


def test_write_keeps_both_copies_identical():
    storage = ChunkStorage(torch.device("cpu"))
    c = _chunk(storage)
    c.allocate(Tier.HOST)
    c.fetch(keep_host=True)
    c.write(c.slots[1], torch.full((4,), 7.0))
    assert torch.equal(c.view(c.slots[1], Tier.HOST), c.view(c.slots[1], Tier.DEVICE))


def test_manager_params_are_views_and_follow_moves():
    storage = ChunkStorage(torch.device("cpu"))
    lin = nn.Linear(3, 4)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    mgr = ChunkManager(storage, chunk_size=100)
    mgr.register([[("weight", lin.weight), ("bias", lin.bias)]], [], initial_tier=lambda kind: Tier.HOST)
    (group,) = mgr.groups
    assert torch.equal(lin.weight, w0) and torch.equal(lin.bias, b0)
    assert lin.weight.data_ptr() == group.param.payload(Tier.HOST).data_ptr()
    group.param.fetch(keep_host=True)
    assert lin.weight.data_ptr() == group.param.payload(Tier.DEVICE).data_ptr()
    group.param.drop_device_copy()
    assert lin.bias.data_ptr() == group.param.payload(Tier.HOST).data_ptr() + 16 * 4  # an aligned slot
    # Each flavour of the chunk is counted once on its tier: param 100, m 100, v 100 floats.
    assert storage.ledger.bytes_on(Tier.HOST) == 3 * 100 * 4
    assert mgr.bytes_by_kind(Tier.HOST)[ChunkKind.PARAM] == 400


def test_plan_layout_next_fit_and_oversized():
    # Slots begin at multiples of 16 elements ([Note: aligned slots]): a 3-element tensor takes
    # room up to the next 16 when another follows it in the chunk.
    assert plan_layout([16, 16, 16, 100, 8, 20], 48) == [[0, 1, 2], [3], [4, 5]]
    assert plan_layout([3, 3], 19) == [[0, 1]] and plan_layout([3, 3], 18) == [[0], [1]]
    assert plan_layout([48, 48], 48) == [[0], [1]]
    assert plan_layout([0, 2, 0, 6], 6) == [[0, 1, 2], [3]]  # an empty tensor first: no chunk before it
    assert slot_offsets([3, 0, 16, 1, 5]) == [0, 3, 16, 32, 48]  # an empty tensor sits where the last ends
    with pytest.raises(ValueError, match="chunk_size"):
        plan_layout([1], 0)


def test_slots_are_aligned_and_gaps_read_zero():
    """Every parameter view begins 16 elements apart at least (64 bytes of fp32, so aligned for
    any kernel as the allocator's own tensors), and the gaps between slots are zeros in the
    parameter chunk and in a gradient chunk the backward wrote, so whole-chunk norms equal the
    parameters' own."""
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7))  # 15, 5, 35, 7 elements: three gaps
    want = [p.detach().clone() for p in model.parameters()]
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=4096))
    (group,) = opt._rt.manager.groups
    assert group.param.has_gaps and [s.offset for s in group.slots] == [0, 16, 32, 80]
    for p in gmodel.parameters():
        assert p.data_ptr() % 64 == 0
    opt.backward(gmodel(torch.randn(4, 3)).square().sum())
    grad_tier = Tier.DEVICE if group.grad.is_on(Tier.DEVICE) else Tier.HOST
    grad = group.grad.used(grad_tier)
    grads = [p.grad.detach().clone() for p in gmodel.parameters()]
    # (equal up to the order of the sum: zeros in between change how a vectorised norm pairs terms)
    torch.testing.assert_close(torch.linalg.vector_norm(grad),
                               torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])), rtol=1e-6, atol=0)
    for chunk, got in ((group.param, want), (group.grad, grads)):
        payload = chunk.used(Tier.HOST if chunk is group.param else grad_tier)
        gaps = torch.ones(payload.numel(), dtype=torch.bool)
        for s, t in zip(group.slots, got):
            gaps[s.offset : s.end] = False
            assert torch.equal(payload[s.offset : s.end].view(s.shape), t)
        assert payload[gaps].eq(0).all() and gaps.sum() == 80 + 7 - (15 + 5 + 35 + 7)


def _real_waste(groups, size):
    """Independent reference: build real chunks with a ChunkManager and count the room each
    leaves free of ``size`` (chunks are allocated for their content, but the search scores how
    well tensors fill chunks of the size it tries)."""
    storage = ChunkStorage(torch.device("cpu"))
    mgr = ChunkManager(storage, chunk_size=size)
    named = [[(f"g{gi}p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(g)] for gi, g in enumerate(groups)]
    mgr.register(named, [], initial_tier=lambda kind: Tier.HOST)
    return sum(max(size, g.param.used_numel) - sum(s.numel for s in g.param.slots) for g in mgr.groups)


@pytest.mark.parametrize("seed", range(6))
def test_search_finds_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    groups = [[rng.randint(1, 40) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 3))]
    lo, hi = max(max(g) for g in groups), max(max(g) for g in groups) + 60
    brute = {size: _real_waste(groups, size) for size in range(lo, hi + 1)}
    best = min(brute.values())
    found = search_chunk_size(groups, min_size=lo, max_size=hi, step=1)
    assert found.waste == best == brute[found.chunk_size]
    assert found.chunk_size == min(s for s, w in brute.items() if w == best)  # ties: the smallest size
    assert found.candidates == hi - lo + 1


def test_waste_counts_oversized_tensors_as_exact():
    assert waste_for([[10]], 4) == (0, 1)
    assert waste_for([[3, 10, 3]], 4) == (2, 3)
    assert waste_for([[3, 3]], 20) == (20 - 6, 1)  # the gap before the aligned second slot is room too


def test_default_range_sets_outliers_aside_and_keeps_several_chunks():
    sizes = [[1000] * 64 + [10_000_000]]
    lo, hi = default_search_range(sizes)
    assert lo == 1024  # the 10M embedding is an outlier: it gets its own chunk
    assert hi >= lo
    found = search_chunk_size(sizes)
    assert lo <= found.chunk_size <= hi


def test_a_model_of_empty_tensors_still_gets_a_chunk_size_and_trains():
    """Only zero-size parameters: the search range was [0, 0] ("chunk size range [0, 0] is empty or not positive",
    naming nothing); torch steps such a model, so does gemini."""
    import gemini

    assert default_search_range([[0, 0]]) == (1024, 1024)
    net = nn.Linear(0, 4, bias=False)
    gmodel, opt = gemini.initialize(net, gemini.GeminiConfig(device="cpu", placement="cpu"))
    gmodel(torch.randn(2, 0)).sum().backward()
    opt.step()
    assert net.weight.shape == (4, 0)


def test_a_nearly_empty_chunk_costs_its_content_not_a_full_chunk():
    """Next-fit packing closes a chunk holding only a LayerNorm (200 elements) because the
    next Linear does not fit, and one holding only a bias after an oversized weight: such
    chunks are allocated, and cross to the device, for what they hold (see [Note: chunks
    sized to their content]), measured by the bytes copied in a step."""
    import gemini

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(90, 100), nn.LayerNorm(100), nn.Linear(100, 95))
    chunk = 9_150
    gmodel, opt = gemini.initialize(net, gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=chunk))
    used = [g.param.used_numel for g in opt._rt.manager.groups]
    assert used == [9008 + 100, 112 + 100, 100 * 95, 95]  # each bias at the next multiple of 16
    gmodel(torch.randn(4, 90)).sum().backward()
    opt.step()
    # Each parameter chunk is fetched for forward and for backward, 4 bytes an element; no
    # chunk holds more than 4 KiB of room past its content.
    h2d = opt.report.h2d_bytes
    assert 2 * 4 * sum(used) <= h2d <= 2 * 4 * (sum(used) + 4 * 1024)
    assert h2d < 2 * 4 * (3 * chunk + used[2]) - 2 * 4 * chunk  # full-size chunks: 2 x 4 x (3 chunks + the weight)


def test_move_to_device_from_both_copies_leaves_no_stale_host_copy():
    """HOST_AND_DEVICE -> move_to(DEVICE) must drop the host copy: the device copy is about to
    be written, and a host copy kept would be trusted (not copied back) by a later offload."""
    storage = ChunkStorage(torch.device("cpu"))
    c = _chunk(storage)
    c.allocate(Tier.HOST)
    c.payload(Tier.HOST)[:10] = torch.arange(10.0)
    c.fetch(keep_host=True)
    c.move_to(Tier.DEVICE)
    assert c.state is ChunkState.DEVICE and c.tiers == (Tier.DEVICE,)
    assert storage.ledger.bytes_on(Tier.HOST) == 0 and storage.ledger.bytes_on(Tier.DEVICE) == c.nbytes
    c.payload(Tier.DEVICE)[:10] += 100.0  # the optimizer writes the device copy
    d2h = storage.ledger.transfers.d2h_bytes
    c.move_to(Tier.HOST)
    assert storage.ledger.transfers.d2h_bytes == d2h + c.nbytes  # really copied back
    assert torch.equal(c.payload(Tier.HOST)[:10], torch.arange(10.0) + 100.0)


def test_a_host_copy_pending_is_waited_for_before_the_host_copy_is_touched():
    """``Chunk.host_copy_pending``: a copy into (or out of) the host copy issued outside the
    chunk's own moves (ZeRO's reduced gradient shard, a low-precision cast of the masters) is
    waited for at the next use of the host copy, once; a synchronous copy (None) waits for nothing."""
    chunk = _chunk(ChunkStorage(torch.device("cpu")))
    chunk.allocate(Tier.HOST, zero=True)

    class Event:
        waits = 0

        def synchronize(self):
            Event.waits += 1

    chunk.host_copy_pending(None)
    chunk.payload(Tier.HOST)
    assert Event.waits == 0
    chunk.host_copy_pending(Event())
    assert Event.waits == 0  # not at once
    chunk.payload(Tier.HOST)
    chunk.payload(Tier.HOST)
    assert Event.waits == 1
