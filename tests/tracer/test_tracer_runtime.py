import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint

from tracer import (
    CudaAllocatorMonitor,
    PeriodHooks,
    Phase,
    RuntimeTracer,
    TensorAccountingMonitor,
    TracerState,
)

KiB = 1024
VOCAB, WIDTH, HEADS, SEQ = 256, 128, 4, 64


# ---- a tiny GPT --------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        att = (q @ k.transpose(-2, -1)) * (d // HEADS) ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.ln_f(x))


def _batch(batch_size, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return idx.to(device), torch.randint(0, VOCAB, (batch_size, SEQ), generator=g).to(device)


def _step(model, idx, tgt):
    logits = model(idx)
    F.cross_entropy(logits.flatten(0, 1), tgt.flatten()).backward()


def _param_bytes(model):
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def _model(checkpointed=False):
    torch.manual_seed(0)
    return TinyGPT(checkpointed=checkpointed)


def _traced(model, batch_size, monitor=None, **kwargs):
    model.zero_grad(set_to_none=True)
    param_bytes = _param_bytes(model)
    tracer = RuntimeTracer(
        model, monitor or TensorAccountingMonitor("cpu"), model_bytes_fn=lambda: param_bytes, **kwargs
    )
    idx, tgt = _batch(batch_size)
    with tracer.trace():
        _step(model, idx, tgt)
    return tracer


# ---- independent references ----------------------------------------------------------


def _allocator_peaks_per_period(model, idx, tgt):
    """Per-period peaks of net bytes allocated since the start, from the CPU allocator's own
    event stream (the profiler's memory events), cut at the same hook boundaries."""
    keys = []

    def mark(boundary):
        keys.append((boundary.phase, boundary.module_name))
        with record_function("ref::boundary"):
            pass

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with PeriodHooks(model, mark):
            _step(model, idx, tgt)
    events = prof.profiler.kineto_results.events()
    marks = sorted(e.start_ns() for e in events if e.name() == "ref::boundary")
    allocs = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    assert len(marks) == len(keys) and allocs
    peaks = [0] * len(marks)
    live = period = 0
    for ts, nbytes in allocs:
        while period + 1 < len(marks) and ts >= marks[period + 1]:
            period += 1
            peaks[period] = live
        live += nbytes
        peaks[period] = max(peaks[period], live)
    for p in range(period + 1, len(marks)):  # periods without any allocation event
        peaks[p] = live
    return keys, peaks


def _accounting_non_model_per_period(model, idx, tgt):
    """A fresh accounting monitor read and reset at each boundary of a second iteration."""
    model.zero_grad(set_to_none=True)
    param_bytes = _param_bytes(model)
    mon = TensorAccountingMonitor("cpu")
    mon.track(list(model.parameters()))
    peaks, keys = [], []

    def cut(boundary):
        if keys:
            peaks.append(mon.peak_bytes() - param_bytes)
        keys.append((boundary.phase, boundary.module_name))
        mon.reset_peak()

    with mon, PeriodHooks(model, cut):
        _step(model, idx, tgt)
        peaks.append(mon.peak_bytes() - param_bytes)
    return keys, peaks


# ---- acceptance ----------------------------------------------------------------------


def test_per_period_non_model_peaks_match_independent_measurements():
    model = _model()
    tracer = _traced(model, batch_size=4)
    periods = tracer.periods
    idx, tgt = _batch(4)
    input_bytes = idx.untyped_storage().nbytes() + tgt.untyped_storage().nbytes()

    acc_keys, acc_peaks = _accounting_non_model_per_period(model, idx, tgt)
    ref_keys, ref_peaks = _allocator_peaks_per_period(model, idx, tgt)
    assert [p.key for p in periods] == acc_keys == ref_keys
    assert {p.phase for p in periods} == {Phase.FORWARD, Phase.BACKWARD}

    compared = 0
    for period, acc, ref in zip(periods, acc_peaks, ref_peaks):
        # The allocator counts from the profile's start; the inputs existed before it.
        ref += input_bytes
        if ref <= 64 * KiB:
            continue
        compared += 1
        assert period.non_model_peak_bytes == pytest.approx(acc, rel=0.10), period
        assert period.non_model_peak_bytes == pytest.approx(ref, rel=0.10), (period, ref)
    assert compared >= 0.8 * len(periods)
    # Activations pile up through the forward and are released through the backward.
    fwd = [p.non_model_peak_bytes for p in periods if p.phase is Phase.FORWARD]
    assert fwd[-1] > 10 * fwd[1]
    assert periods[-1].non_model_peak_bytes < max(fwd)


def test_monitor_peak_over_a_whole_iteration_matches_the_allocator():
    model = _model()
    idx, tgt = _batch(4)
    model.zero_grad(set_to_none=True)
    mon = TensorAccountingMonitor("cpu")
    mon.track([*model.parameters(), idx, tgt])
    with mon:
        start = mon.current_bytes()
        _step(model, idx, tgt)
        measured = mon.peak_bytes() - start
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, idx, tgt)
    live = peak = 0
    events = prof.profiler.kineto_results.events()
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    assert measured == pytest.approx(peak, rel=0.10)


def test_non_model_peaks_scale_with_batch_and_retrace_updates_them():
    model = _model()
    tracer = _traced(model, batch_size=4)
    small = tracer.periods
    idx4, _ = _batch(4)
    idx8, tgt8 = _batch(8)
    assert not tracer.needs_retrace((idx4,))
    assert tracer.needs_retrace((idx8,))
    assert tracer.needs_retrace((idx4,), {"flag": True})

    model.zero_grad(set_to_none=True)
    with tracer.trace():
        _step(model, idx8, tgt8)
    large = tracer.periods
    assert not tracer.needs_retrace((idx8,))
    assert [p.key for p in large] == [p.key for p in small]

    def fwd_max(periods):
        return max(p.non_model_peak_bytes for p in periods if p.phase is Phase.FORWARD)

    assert fwd_max(large) / fwd_max(small) == pytest.approx(2.0, rel=0.10)
    assert tracer.max_non_model_peak_bytes == max(p.non_model_peak_bytes for p in large)
    big_enough = [(s, l) for s, l in zip(small, large) if s.non_model_peak_bytes > 64 * KiB]
    assert all(l.non_model_peak_bytes > 1.5 * s.non_model_peak_bytes for s, l in big_enough if s.phase is Phase.FORWARD)


def test_activation_checkpointing_records_recompute_periods_and_saves_memory():
    plain = _traced(_model(), batch_size=4)
    ckpt = _traced(_model(checkpointed=True), batch_size=4)
    forward_keys = [p.key for p in plain.periods if p.phase is Phase.FORWARD]
    assert [p.key for p in ckpt.periods if p.phase is Phase.FORWARD] == forward_keys
    recomputed = [p.module_name for p in ckpt.periods if p.phase is Phase.RECOMPUTE]
    block_modules = [n for _, n in forward_keys if n.startswith("blocks.")]
    assert sorted(recomputed) == sorted(block_modules)
    # Each block is re-run inside the backward: after its own backward boundary.
    for i in range(2):
        first_recompute = next(p.index for p in ckpt.periods if p.key == (Phase.RECOMPUTE, f"blocks.{i}"))
        block_backward = next(p.index for p in ckpt.periods if p.key == (Phase.BACKWARD, f"blocks.{i}"))
        assert block_backward < first_recompute
    recompute_peak = max(p.non_model_peak_bytes for p in ckpt.periods if p.phase is Phase.RECOMPUTE)
    assert recompute_peak > 64 * KiB

    def fwd_max(tracer):
        return max(p.non_model_peak_bytes for p in tracer.periods if p.phase is Phase.FORWARD)

    assert fwd_max(ckpt) < 0.6 * fwd_max(plain)


def test_chunk_access_order_from_callback_and_record_access():
    model = _model()
    owners = [m for m in model.modules() if list(m.parameters(recurse=False))]
    chunk_of = {id(m): i for i, m in enumerate(owners)}
    chunk_of[id(model.head)] = chunk_of[id(model.wte)]  # tied weights share a chunk
    tracer = RuntimeTracer(
        model,
        TensorAccountingMonitor("cpu"),
        model_bytes_fn=lambda: _param_bytes(model),
        chunks_of=lambda m: [chunk_of[id(m)]] if id(m) in chunk_of else [],
    )
    # An engine hook registered before tracing: the tracer's boundary still comes first,
    # so the access lands in mlp.0's own period.
    engine_hook = model.blocks[1].mlp[0].register_forward_pre_hook(lambda m, a: tracer.record_access(1099))
    idx, tgt = _batch(2)
    tracer.record_access(1007)  # outside trace(): ignored
    with tracer.trace():
        tracer.record_access(1005)  # before the first boundary: joins the first period
        _step(model, idx, tgt)
    engine_hook.remove()

    order = tracer.access_order
    assert len(order) == len(tracer.periods)
    assert order[0] == [1005]
    by_key = {p.key: list(p.chunk_ids) for p in tracer.periods}
    assert by_key[(Phase.FORWARD, "blocks.1.mlp.0")] == [chunk_of[id(model.blocks[1].mlp[0])], 1099]
    assert by_key[(Phase.FORWARD, "head")] == by_key[(Phase.FORWARD, "wte")] == [chunk_of[id(model.wte)]]
    fwd_chunks = [c for p in tracer.periods if p.phase is Phase.FORWARD for c in p.chunk_ids if c < 1000]
    bwd_chunks = [c for p in tracer.periods if p.phase is Phase.BACKWARD for c in p.chunk_ids]
    assert fwd_chunks == [chunk_of[id(m)] for m in owners]  # modules() is forward order here
    # Backward runs the modules in reverse, except that the two embeddings' backwards run
    # in whatever order autograd picks for the two inputs of their sum.
    assert bwd_chunks[:-2] == list(reversed(fwd_chunks))[:-2]
    assert sorted(bwd_chunks[-2:]) == sorted(fwd_chunks[:2])


class _FakeEngine:
    """Makes a 1 MiB 'chunk' resident on the device before each Linear runs, frees it after."""

    CHUNK_NUMEL = 256 * KiB

    def __init__(self, model, tracer_ref, *, announce_moves):
        self.resident_bytes = 0
        self.announce_moves = announce_moves
        self.tracer_ref = tracer_ref
        self.payloads = {}
        self.handles = []
        for m in model.modules():
            if isinstance(m, nn.Linear):
                self.handles.append(m.register_forward_pre_hook(self.load))
                self.handles.append(m.register_forward_hook(self.release))

    def _move(self):
        tracer = self.tracer_ref[0]
        return tracer.model_data_move() if self.announce_moves else _null()

    def load(self, module, args):
        with self._move():
            self.payloads[id(module)] = torch.empty(self.CHUNK_NUMEL)
            self.resident_bytes += self.CHUNK_NUMEL * 4

    def release(self, module, args, out):
        with self._move():
            del self.payloads[id(module)]
            self.resident_bytes -= self.CHUNK_NUMEL * 4


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return None


def _trace_with_engine(announce_moves):
    model = _model()
    param_bytes = _param_bytes(model)
    ref = [None]
    engine = _FakeEngine(model, ref, announce_moves=announce_moves)
    tracer = RuntimeTracer(
        model, TensorAccountingMonitor("cpu"), model_bytes_fn=lambda: param_bytes + engine.resident_bytes
    )
    ref[0] = tracer
    idx, tgt = _batch(4)
    with tracer.trace():
        _step(model, idx, tgt)
    return tracer


def test_announced_model_data_moves_are_not_counted_as_non_model():
    plain = _traced(_model(), batch_size=4)
    announced = _trace_with_engine(announce_moves=True)
    unannounced = _trace_with_engine(announce_moves=False)
    assert [p.key for p in announced.periods] == [p.key for p in plain.periods]
    chunk_bytes = _FakeEngine.CHUNK_NUMEL * 4
    param_bytes = _param_bytes(_model())
    for p, a, u in zip(plain.periods, announced.periods, unannounced.periods):
        assert a.non_model_peak_bytes == p.non_model_peak_bytes, (p, a)
        # Unannounced moves can only make the estimate larger: the safe side.
        assert u.non_model_peak_bytes >= p.non_model_peak_bytes
    # Where a period's peak came while its chunk was resident, the chunk was subtracted...
    assert any(a.model_bytes == param_bytes + chunk_bytes for a in announced.periods)
    # ...which, unannounced, the tracer could not do.
    overstated = [
        u
        for p, u in zip(plain.periods, unannounced.periods)
        if u.non_model_peak_bytes >= p.non_model_peak_bytes + chunk_bytes
    ]
    assert len(overstated) >= 3


def test_unseen_model_data_is_clamped_with_a_warning(caplog):
    model = _model()
    # The monitor is not told about the parameters: it sees less than model_bytes_fn says.
    with caplog.at_level(logging.WARNING, logger="tracer.runtime"):
        tracer = _traced(model, batch_size=2, track_module_tensors=False)
    assert tracer.periods[0].non_model_peak_bytes == 0
    assert "is all resident model data tracked by the monitor" in caplog.text


def test_state_errors_and_cleanup():
    model = _model()
    tracer = RuntimeTracer(model, TensorAccountingMonitor("cpu"), model_bytes_fn=lambda: 0)
    assert tracer.state is TracerState.IDLE and tracer.needs_retrace((torch.zeros(1),))
    with pytest.raises(RuntimeError, match="needs a finished trace"):
        tracer.max_non_model_peak_bytes
    with pytest.raises(RuntimeError, match="saw no forward"):
        with tracer.trace():
            pass
    assert tracer.state is TracerState.IDLE
    assert not tracer.monitor.running

    idx, tgt = _batch(2)
    with pytest.raises(ZeroDivisionError):
        with tracer.trace():
            model(idx)
            1 / 0
    assert tracer.state is TracerState.IDLE and tracer.periods == ()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())

    with tracer.trace():
        assert tracer.is_tracing
        with pytest.raises(RuntimeError, match="already running"):
            with tracer.trace():
                pass
        with pytest.raises(RuntimeError, match="inside trace"):
            tracer.reset()
        with pytest.raises(TypeError, match="chunk_id"):
            tracer.record_access("3")
        _step(model, idx, tgt)
    assert tracer.state is TracerState.TRACED
    with pytest.raises(ValueError, match=r"period=999 is out of range"):
        tracer.non_model_peak_for(999)
    assert tracer.non_model_peak_for(3) == tracer.periods[3].non_model_peak_bytes
    tracer.reset()
    assert tracer.state is TracerState.IDLE and tracer.access_order == []


def test_bad_constructor_arguments_and_callback_values():
    model = _model()
    mon = TensorAccountingMonitor("cpu")
    with pytest.raises(TypeError, match="module"):
        RuntimeTracer(object(), mon, model_bytes_fn=lambda: 0)
    with pytest.raises(TypeError, match="monitor"):
        RuntimeTracer(model, object(), model_bytes_fn=lambda: 0)
    with pytest.raises(TypeError, match="model_bytes_fn"):
        RuntimeTracer(model, mon, model_bytes_fn=3)
    with pytest.raises(TypeError, match="chunks_of"):
        RuntimeTracer(model, mon, model_bytes_fn=lambda: 0, chunks_of=[1])
    tracer = RuntimeTracer(model, mon, model_bytes_fn=lambda: -5)
    with pytest.raises(ValueError, match="model_bytes_fn returned -5"):
        with tracer.trace():
            pass
    assert not mon.running


def test_a_running_monitor_is_borrowed_and_left_running():
    model = _model()
    mon = TensorAccountingMonitor("cpu")
    mon.track(list(model.parameters()))
    param_bytes = _param_bytes(model)
    tracer = RuntimeTracer(model, mon, model_bytes_fn=lambda: param_bytes, track_module_tensors=False)
    idx, tgt = _batch(2)
    with mon:
        with tracer.trace():
            _step(model, idx, tgt)
        assert mon.running
    assert tracer.max_non_model_peak_bytes > 64 * KiB


class _RequestedBytesMonitor(CudaAllocatorMonitor):
    """The bytes tensors asked the CUDA allocator for (``requested_bytes``), before it rounds
    them to blocks: what the accounting monitor counts, storage by storage."""

    def _current_bytes(self) -> int:
        return torch.cuda.memory_stats(self.device)["requested_bytes.all.current"]

    def _peak_bytes(self) -> int:
        return max(self._folded_peak_bytes, torch.cuda.memory_stats(self.device)["requested_bytes.all.peak"])


@pytest.mark.cuda
def test_cuda_tracer_agrees_with_the_accounting_monitor():
    """Per period, the accounting monitor's non-model peak is what tensors asked the allocator
    for; the allocator's own figure (what the budget is measured by) is at least that. Two H200
    runs found the accounting 4,177,936 bytes short in one backward period at batch 16: the bias
    gradient's sum over 1024 rows ran CUDA's reduction split over thread blocks, whose fp32
    staging (4 MiB) comes from the allocator inside the kernel, unseen by a dispatch mode (see
    [Note: what the accounting monitor sees]). At batch 15 (960 rows) no such sum splits, but the
    next H200 run (session 28) found the accounting 967,680 bytes short in one period again
    (blocks.1.attn.proj's backward: 16,501,768 against 17,469,448, twice to the byte), and a probe
    found 258,048 short at batch 4 and 675,856 at batch 16, each in a Linear's backward: scratch a
    kernel takes from the allocator, not a tensor. So up to 1 MiB may be missing; over that, the
    accounting misses tensors."""
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    idx, tgt = _batch(15, device="cuda")
    param_bytes = _param_bytes(model)
    _step(model, idx, tgt)  # creates cuBLAS's workspace before anything is measured
    results = []
    for monitor in (CudaAllocatorMonitor("cuda"), _RequestedBytesMonitor("cuda"), TensorAccountingMonitor("cuda")):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = monitor._current_bytes() - param_bytes if isinstance(monitor, CudaAllocatorMonitor) else 0
        tracer = RuntimeTracer(model, monitor, model_bytes_fn=lambda base=base: param_bytes + base)
        with tracer.trace():
            _step(model, idx, tgt)
            torch.cuda.synchronize()
        results.append(tracer.periods)
    alloc, requested, acc = results
    assert [p.key for p in alloc] == [p.key for p in requested] == [p.key for p in acc]
    for a, r, b in zip(alloc, requested, acc):
        if r.non_model_peak_bytes > 1 << 20:
            assert b.non_model_peak_bytes == pytest.approx(r.non_model_peak_bytes, rel=0.05, abs=1 << 20), (a, r, b)
            assert a.non_model_peak_bytes >= r.non_model_peak_bytes * 0.95, (a, r, b)


def test_marks_split_a_period_into_segments_with_their_own_peaks():
    """A decision point inside a period (``mark()``) starts a segment whose peak counts only what
    is live from there on: a large temporary freed before the mark raises the first segment's
    peak and the period's, not the second's (see [Note: segments of a period])."""
    model = nn.Sequential(nn.Linear(8, 8))
    tracer = RuntimeTracer(model, TensorAccountingMonitor("cpu"), model_bytes_fn=lambda: _param_bytes(model))

    def inside(module, args, out):
        big = torch.ones(256 * KiB)  # 1 MiB, freed before the mark
        del big
        tracer.mark()
        small = torch.ones(16 * KiB)  # 64 KiB, live after it
        del small

    model[0].register_forward_hook(inside)
    tracer.mark()  # outside trace(): nothing happens
    with tracer.trace():
        model(torch.randn(2, 8)).sum().backward()
    period = next(p for p in tracer.periods if p.key == (Phase.FORWARD, "0"))
    first, second = period.segment_non_model_peak_bytes
    assert first >= 1024 * KiB > second >= 64 * KiB
    assert period.non_model_peak_bytes == first
    assert len(period.segment_model_bytes) == 2
    unmarked = [p for p in tracer.periods if p is not period]
    assert all(len(p.segment_non_model_peak_bytes) == 1 for p in unmarked)
