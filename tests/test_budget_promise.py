"""The device budget is a promise on every step: exact at the byte, checked before any update,
and kept by the auto policy at the least traffic its traced order allows.

Tests marked standin set budgets at measured peaks to the byte, or at a few KiB: the CPU
stand-in counts exactly the tensors alive; on CUDA the caching allocator reserves whole
segments, and the budget caps what it reserves. Refusals at initialize (the chunks a placement
keeps on the device, counted before anything runs) hold on every device.
"""

from __future__ import annotations

import functools
import itertools
import math
import re

import pytest
import torch
from torch import nn

import gemini
from gemini.tools.gpt import GPT, GPTConfig
from gemini.engine.memory import DeviceBudgetError
from helpers import DEVICE, FakeCudaAllocator, assert_params_close, batches, clone_pair

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
CHUNK = 8192
# Every placement that measures the device when given a budget; static with a mix of groups
# pinned on the device and groups offloaded.
MEASURED = {
    "cpu": {},
    "static": dict(static_param_device_fraction=0.5, static_optimizer_offload_fraction=0.5),
    "cuda": {},
    "auto": {},
}


def _config(placement: str, budget) -> gemini.GeminiConfig:
    return gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=CHUNK, device_memory=budget,
                               **MEASURED[placement])


def _one_step(budget, placement: str = "cpu"):
    base, _ = clone_pair(CFG)
    gmodel, opt = gemini.initialize(base, _config(placement, budget), lr=1e-2)
    x, y = batches(CFG, 1, batch=2, seq=16)[0]
    opt.backward(GPT.loss(gmodel(x), y))
    opt.step()
    return opt.report


def _peak_of_one_step(budget, placement: str = "cpu") -> int:
    return _one_step(budget, placement).device_peak_bytes


def _missing_bytes(err: Exception) -> int:
    """The missing bytes an error names (a ValueError carries them only in its message)."""
    named = [int(n) for n in re.findall(r"(\d+) bytes are missing", str(err))]
    assert len(named) == 1 and "device_memory" in str(err), str(err)
    if isinstance(err, DeviceBudgetError):
        assert err.missing_bytes == named[0], str(err)
    assert named[0] > 0
    return named[0]


def _optimizer_state(opt) -> list[torch.Tensor]:
    """Step counts, Adam's m and v, read from the chunks themselves (``state_dict`` omits
    parameters that never stepped, so it could not tell a first update from none)."""
    out = []
    for g in opt._rt.manager.trainable_groups:
        out += [g.steps.clone(), g.exp_avg.payload().clone(), g.exp_avg_sq.payload().clone()]
    return out


def _refused(placement: str, budget) -> tuple[str, Exception]:
    """Initialize and one step at ``budget``, which must be refused: at initialize, or in the
    first iteration before anything is updated. Returns where ("initialize" or "iteration") and
    the error."""
    base, _ = clone_pair(CFG)
    values = {k: v.clone() for k, v in base.state_dict().items()}
    try:
        gmodel, opt = gemini.initialize(base, _config(placement, budget), lr=1e-2)
    except (DeviceBudgetError, ValueError) as err:
        # Refused up front: the module keeps its values (chunks may already hold them).
        assert_params_close(base.state_dict(), values, rtol=0, atol=0)
        _missing_bytes(err)
        return "initialize", err
    params = gmodel.state_dict()
    state = _optimizer_state(opt)
    x, y = batches(CFG, 1, batch=2, seq=16)[0]
    with pytest.raises(DeviceBudgetError, match="Nothing was updated") as err:
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
    _missing_bytes(err.value)
    assert_params_close(gmodel.state_dict(), params, rtol=0, atol=0)
    after = _optimizer_state(opt)
    assert all(torch.equal(a, b) for a, b in zip(after, state, strict=True))
    assert opt.report is None and opt.reports_made == 0  # no step was counted either
    return "iteration", err.value


@pytest.mark.standin
@pytest.mark.parametrize("placement", list(MEASURED))
def test_a_peak_exactly_at_the_budget_passes_and_one_byte_less_is_refused(placement):
    """`<` for `<=` in a budget check refuses a step that fits to the byte; `<= budget + 1`
    lets one through that does not fit. Under auto the warm-up's peak is checked with the
    safety reserve on top: the boundary is where the refusal at the bare peak says it is."""
    peak = _peak_of_one_step(2**40, placement)  # measured (a budget turns the monitor on), never binding
    if placement == "auto":
        with pytest.raises(DeviceBudgetError, match="safety reserve") as err:
            _one_step(peak, placement)
        boundary = peak + err.value.missing_bytes
    else:
        boundary = peak
    # The same step, the same bytes: exactly at the budget is within it.
    assert _peak_of_one_step(boundary, placement) == peak
    where, err = _refused(placement, boundary - 1)
    assert where == "iteration" and _missing_bytes(err) == 1


@pytest.mark.standin
@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_state_dicts_taken_inside_a_step_are_host_memory(placement):
    """model.state_dict(), optimizer.state_dict() and sharded_state_dict() are copies on the CPU:
    host memory beside a GPU. On the stand-in, taken between backward and step (inside the
    measured window) and kept, they add nothing to the steps' measured peaks."""
    def peaks(take: bool) -> list[int]:
        base, _ = clone_pair(CFG)
        gmodel, opt = gemini.initialize(base, _config(placement, 2**40), lr=1e-2)  # a budget: measured
        kept, out = [], []
        for x, y in batches(CFG, 3, batch=2, seq=16):
            opt.backward(GPT.loss(gmodel(x), y))
            if take:
                kept += [gmodel.state_dict(), opt.state_dict(), opt.sharded_state_dict()]
            opt.step()
            opt.zero_grad()
            out.append(opt.report.device_peak_bytes)
        assert not take or kept[-2]["state"]  # the optimizer's state was there to copy
        return out

    assert peaks(take=True) == peaks(take=False)


@pytest.mark.parametrize("placement", ["cuda", "static"])
def test_the_chunks_kept_on_the_device_fit_the_budget_to_the_byte(placement):
    """cuda and static check at initialize that the chunks they keep on the device fit: a
    refusal's missing bytes lead to a budget that fits exactly, and one byte less is refused."""
    where, err = _refused(placement, 1)
    assert where == "initialize"
    boundary = 1 + _missing_bytes(err)
    gemini.initialize(clone_pair(CFG)[0], _config(placement, boundary))
    with pytest.raises((DeviceBudgetError, ValueError)) as err:
        gemini.initialize(clone_pair(CFG)[0], _config(placement, boundary - 1))
    assert _missing_bytes(err.value) == 1


@pytest.mark.parametrize("placement, budget, refused_at", [
    ("cuda", 1, "initialize"),  # the chunks alone do not fit
    # the chunks fit exactly, the first iteration's activations do not
    pytest.param("cuda", "chunks", "iteration", marks=pytest.mark.standin),
    ("static", 1, "initialize"),
    pytest.param("static", "chunks", "iteration", marks=pytest.mark.standin),
    # a module's parameters and activations do not fit
    pytest.param("cpu", 64 * 1024, "iteration", marks=pytest.mark.standin),
    # refused in the warm-up's forward or backward
    pytest.param("auto", 64 * 1024, "iteration", marks=pytest.mark.standin),
])
def test_every_placement_refuses_a_budget_it_cannot_meet_before_updating_anything(placement, budget, refused_at):
    """A first step whose check is skipped would update parameters and Adam's states (and
    count a step) at a budget the iteration overran; every placement refuses it instead."""
    if budget == "chunks":
        budget = 1 + _missing_bytes(_refused(placement, 1)[1])
    where, _ = _refused(placement, budget)
    assert where == refused_at


@pytest.mark.standin
def test_every_step_is_checked_before_anything_is_updated():
    """A tensor the caller keeps alive on the device in a later step pushes that step over the
    budget: the step raises before any update, and a retry without it gives the uninterrupted
    result."""
    peak = _peak_of_one_step(2**40)
    budget = peak + 4096
    data = batches(CFG, 3, batch=2, seq=16)

    def run(extra_at: int | None):
        base, _ = clone_pair(CFG)
        gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=CHUNK,
                                                                  device_memory=budget), lr=1e-2)
        for step, (x, y) in enumerate(data):
            kept = None
            loss = GPT.loss(gmodel(x), y)
            if step == extra_at:  # say, activations kept for logging, alive through backward
                kept = torch.ones(16384, dtype=torch.uint8)
            opt.backward(loss)
            if kept is not None:
                with opt._rt.memory.quiet():  # the test's own snapshots are not the device's memory
                    before = gmodel.state_dict()
                    state = opt.state_dict()
                with pytest.raises(DeviceBudgetError, match="this iteration.*Nothing was updated"):
                    opt.step()
                assert_params_close(gmodel.state_dict(), before, rtol=0, atol=0)
                after = opt.state_dict()["state"]
                assert state["state"] and after.keys() == state["state"].keys()
                for i, entry in state["state"].items():
                    for k, v in entry.items():
                        assert torch.equal(after[i][k], v), (i, k)
                del kept, loss, before, state, after
                opt.zero_grad()  # retry the same batch, within budget
                opt.backward(GPT.loss(gmodel(x), y))
            opt.step()
            opt.zero_grad()
        return gmodel.state_dict()

    assert_params_close(run(extra_at=1), run(extra_at=None), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# Steady-state eviction under auto follows the traced order. The reference below replays one
# iteration of the policy's schedule from the warm-up's timeline and finds, by brute force over
# every choice of victims, the fewest parameter fetches that schedule allows; the engine's
# measured traffic must be exactly that.

WIDTH = 64
GROUP_BYTES = 4 * WIDTH * WIDTH  # one Linear(WIDTH, WIDTH, bias=False) in fp32: one chunk group each
CALLS = (0, 1, 2, 3, 4, 0)


class _Chain(nn.Module):
    """Five equal layers called 0, 1, 2, 3, 4, 0. Equal groups: a size-only rule (largest first)
    takes its victims in group order, blind to when each is needed next. The reused layer's
    group is used twice per pass, and its gradient arrives once, after both uses."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(max(CALLS) + 1))

    def forward(self, x):
        # A tanh after each layer: no module returns another's output as its own (as
        # nn.Sequential does, which puts the last layer's backward fetch ahead of its period's
        # boundary; see [Note: shared outputs] in tracer/hooks.py).
        for i in CALLS:
            x = torch.tanh(self.layers[i](x))
        return x.square().mean()


def _chain_run(budget, steps: int):
    torch.manual_seed(0)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=WIDTH * WIDTH, device_memory=budget)
    gmodel, opt = gemini.initialize(_Chain(), gcfg, lr=1e-2)
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(1))
    reports = []
    for _ in range(steps):
        opt.backward(gmodel(x))
        opt.step()
        opt.zero_grad()
        reports.append(opt.report)
    return reports, opt


def _moments(timeline):
    """One steady-state iteration of the auto policy (see [Note: auto placement]), as the moments
    at which the resident parameter groups must fit. Period p's room is the budget less the
    reserve, the buffers and p's measured non-model peak. The iteration begins with no group on
    the device (the step, Adam on the host, left none there). In period p:

    1. at its boundary, the resident groups fit p's room; p's own groups are never evicted;
    2. the next period's groups are prefetched when they fit under both rooms without evicting;
    3. p's missing groups are fetched, evicting to make room for them;
    4. in a group's last backward period (autograd hands over a parameter's gradient once, summed
       over its uses) its gradient chunk, a group's size, needs room next to it; it then leaves
       for the host, as these groups' optimizer states live there.

    Yields ("fit", p, room, keep, new, extra): make room for ``extra`` bytes and the groups of
    ``new`` not resident, evicting none of ``keep``; then ``new`` is resident. And
    ("prefetch", p, room, groups).
    """
    periods = timeline.periods
    rooms = [timeline.budget_bytes - timeline.reserve_bytes - timeline.fixed_bytes - p.non_model_bytes
             for p in periods]
    access = [frozenset(p.chunk_groups) for p in periods]
    last_backward = {g: i for i, p in enumerate(periods) if p.phase == "backward" for g in p.chunk_groups}
    for p, groups in enumerate(access):
        yield "fit", p, rooms[p], groups, frozenset(), 0
        if p + 1 < len(access):
            yield "prefetch", p, min(rooms[p], rooms[p + 1]), access[p + 1]
        yield "fit", p, rooms[p], groups, groups, 0
        for g in sorted(groups):
            if last_backward.get(g) == p:
                yield "fit", p, rooms[p], frozenset({g}), frozenset(), GROUP_BYTES


def _evictions_needed(resident: frozenset, new: frozenset, extra: int, room: int) -> int:
    over = GROUP_BYTES * len(resident | new) + extra - room
    return max(0, math.ceil(over / GROUP_BYTES))


def _fewest_fetches(timeline) -> int:
    """Brute force: the fewest fetches over every choice of victims at every moment (no policy)."""
    moments = list(_moments(timeline))

    @functools.cache
    def best(i: int, resident: frozenset) -> float:
        if i == len(moments):
            return 0
        kind, _, room, groups, *rest = moments[i]
        if kind == "prefetch":
            new = groups - resident
            if new and GROUP_BYTES * len(resident | new) <= room:
                return len(new) + best(i + 1, resident | new)
            return best(i + 1, resident)
        new, extra = rest
        candidates = sorted(resident - groups)
        k = _evictions_needed(resident, new, extra, room)
        if k > len(candidates):
            return math.inf
        return len(new - resident) + min(
            best(i + 1, (resident - frozenset(victims)) | new) for victims in itertools.combinations(candidates, k)
        )

    return best(0, frozenset())


def _fetches(timeline, victim) -> int:
    """Fetches when each eviction takes ``victim(candidates, period, access)``, one at a time."""
    access = [set(p.chunk_groups) for p in timeline.periods]
    resident, fetched = set(), 0
    for kind, p, room, groups, *rest in _moments(timeline):
        if kind == "prefetch":
            new = groups - resident
            if new and GROUP_BYTES * len(resident | new) <= room:
                resident |= new
                fetched += len(new)
            continue
        new, extra = rest
        for _ in range(_evictions_needed(frozenset(resident), new, extra, room)):
            resident.remove(victim(resident - groups, p, access))
        fetched += len(new - resident)
        resident |= new
    return fetched


def _furthest_next_use(candidates, p, access):
    def next_use(g):
        return next((q for q in range(p + 1, len(access)) if g in access[q]), math.inf)
    return max(sorted(candidates), key=next_use)


def _in_group_order(candidates, p, access):
    return min(candidates)  # what largest-first does among equal groups (a stable sort)


@pytest.mark.standin
def test_steady_state_traffic_is_the_fewest_fetches_the_traced_order_allows():
    """Evicting the largest group (among equal ones, the first in group order) instead of the one
    needed furthest ahead evicts groups about to be used (here, in the backward, the group just
    prefetched for the next period rather than one never used again) and fetches them again:
    more host-to-device traffic per step at the same budget. Each steady-state step must move
    exactly the optimum's bytes."""
    # The budget: the reserve, the largest non-model peak and three and a quarter groups. Every
    # period fits what it needs at once (a group and its gradient at most); the backward's
    # periods cannot also keep every group fetched before.
    _, probe = _chain_run(None, steps=1)
    traced = probe.timeline
    budget = traced.reserve_bytes + traced.fixed_bytes + traced.max_non_model_bytes + 3 * GROUP_BYTES + GROUP_BYTES // 4
    reports, opt = _chain_run(budget, steps=3)
    timeline = opt.timeline
    groups = opt._rt.manager.groups
    assert len(groups) == 5 and all(g.param.nbytes == GROUP_BYTES for g in groups)
    assert [p.chunk_groups for p in timeline.periods] == [p.chunk_groups for p in traced.periods]

    fewest = _fewest_fetches(timeline)
    assert fewest > len(groups)  # the budget forces groups to be fetched again
    assert _fetches(timeline, _furthest_next_use) == fewest  # Belady is optimal for equal sizes
    assert _fetches(timeline, _in_group_order) > fewest  # and order-blind eviction is not
    for r in reports[1:]:  # the first step is the warm-up
        assert r.device_peak_bytes <= budget
        assert r.h2d_bytes == fewest * GROUP_BYTES, (r.step, r.h2d_bytes // GROUP_BYTES, fewest)
        # Each gradient chunk leaves once; an evicted parameter chunk has its host copy (no copy back).
        assert r.d2h_bytes == len(groups) * GROUP_BYTES


_OOM = "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 79.19 GiB"


@pytest.mark.parametrize("budgeted", [True, False])
def test_out_of_memory_in_forward_or_backward_is_the_budgets_error(budgeted):
    """On CUDA the budget caps the allocator, so a forward or backward that needs more than it
    fails inside an operator: that error comes out as DeviceBudgetError with the missing bytes
    (the operator's request counted), nothing updated, and the engine trains on as if the
    failed pass had not been. Without a budget torch's own error passes through. The
    allocator's refusal is stood in for by a hook raising torch's error."""
    from helpers import TINY, roomy_budget, train_reference

    base, ref = clone_pair()
    data = batches(TINY, 4)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    cfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=2000,
                              device_memory=roomy_budget("64MiB") if budgeted else None)
    model, opt = gemini.initialize(base, cfg, lr=1e-2, weight_decay=0.1)
    linear = next(m for m in model.module.modules() if isinstance(m, nn.Linear))
    refuse = {"forward": False, "backward": False}

    def refuse_forward(module, args):
        if refuse["forward"]:
            raise torch.OutOfMemoryError(_OOM)

    def refuse_backward(module, grad_output):
        if refuse["backward"]:
            raise torch.OutOfMemoryError(_OOM)

    linear.register_forward_pre_hook(refuse_forward)
    linear.register_full_backward_pre_hook(refuse_backward)
    expected = DeviceBudgetError if budgeted else torch.OutOfMemoryError
    for step, (x, y) in enumerate(data):
        if step in (1, 2):
            phase = "forward" if step == 1 else "backward"
            refuse[phase] = True
            with pytest.raises(expected) as caught:
                opt.backward(GPT.loss(model(x), y))
            refuse[phase] = False
            if budgeted:
                assert f"the {phase} pass ran out of the device budget" in str(caught.value)
                assert "asked for 2097152 bytes" in str(caught.value)
                assert caught.value.missing_bytes >= 1
                assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
            else:
                assert str(caught.value) == _OOM
            assert opt.reports_made == step  # nothing stepped
            opt.zero_grad()  # a backward that failed part-way leaves some gradients, as in plain PyTorch
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
        assert_params_close(model.state_dict(), want[step], step=step)


def test_the_allocators_slack_is_its_reserved_peak_less_the_warmups_peak(monkeypatch):
    """[Note: the safety reserve] counts the CUDA allocator's slack at the warm-up's peak. torch
    resets the reserved peak with the allocated one, and each period's cut resets them: read
    at the end, reserved less allocated was the cache of everything the backward freed (about
    the activations), which counted the non-model memory twice. The monitor keeps the
    reserved peak across resets. The allocator is stood in for (tests/test_cuda.py has it real)."""
    from gemini.engine import memory
    from tracer import CudaAllocatorMonitor

    MiB = 2**20
    use = FakeCudaAllocator(monkeypatch).use
    monkeypatch.setattr(memory, "_device_total_bytes", lambda device: 80 * 2**30)
    budget = memory.DeviceMemory(torch.device("cuda", 0), None, measure=True)
    assert isinstance(budget.monitor, CudaAllocatorMonitor)
    use(10 * MiB, 12 * MiB)  # the model's chunks, before the warm-up
    budget.restart_slack()
    budget.monitor.start()
    use(80 * MiB, 100 * MiB)  # the forward's peak: 20 MiB of rounding and fragmentation
    budget.monitor.reset_peak()  # a period's cut
    use(20 * MiB, 100 * MiB)  # the backward freed the activations; the allocator caches them
    budget.monitor.reset_peak()
    assert budget.allocator_slack_bytes(80 * MiB) == 20 * MiB
    assert budget.reserve_bytes(60 * MiB, 80 * MiB) == 20 * MiB + memory.planned_reserve_bytes(60 * MiB, budget.device)
    use(20 * MiB, 30 * MiB)  # the cache given back (empty_cache): the peak before it still counts
    budget.monitor.reset_peak()
    assert budget.allocator_slack_bytes(80 * MiB) == 20 * MiB
    budget.restart_slack()  # a later warm-up (new shapes) counts from its own start
    budget.monitor.reset_peak()
    use(30 * MiB, 40 * MiB)
    assert budget.allocator_slack_bytes(30 * MiB) == 10 * MiB


def test_the_allocators_slack_counts_from_the_warm_up_not_from_before_it(monkeypatch):
    """An evaluation of a larger batch before initialize (in the same process) left the allocator's
    reserved peak and its cache high; the warm-up's first period cut folded that peak in, and on an
    H200 the reserve came to 264 MB beside a 148 MB warm-up, refusing a budget the run fits
    (tests/test_evaluation_margin.py's CUDA test). The warm-up counts from its own start, the cache
    before it given back."""
    from gemini.engine import memory

    MiB = 2**20
    use = FakeCudaAllocator(monkeypatch).use
    monkeypatch.setattr(memory, "_device_total_bytes", lambda device: 80 * 2**30)
    budget = memory.DeviceMemory(torch.device("cuda", 0), None, measure=True)
    use(10 * MiB, 12 * MiB)  # the model's chunks
    use(410 * MiB, 420 * MiB)  # an evaluation of a large batch
    use(10 * MiB)  # its activations freed, their blocks cached
    budget.restart_slack()
    budget.monitor.start()
    use(80 * MiB, 90 * MiB)  # the warm-up forward's peak: 10 MiB of rounding
    budget.monitor.reset_peak()  # a period's cut
    use(20 * MiB)
    budget.monitor.reset_peak()
    assert budget.allocator_slack_bytes(80 * MiB) == 10 * MiB


def test_a_cuda_budget_error_counts_the_allocators_segments_not_its_tensors(monkeypatch):
    """On CUDA the budget caps the caching allocator, which counts its segments: an operator can
    fail with the tensors well under the budget when the segments' free blocks are too split to
    serve it. On the GPU (gemini auto at torchao's peak, 2026-11-27) that read "about 1 bytes are
    missing" (tensors 8,137,029,632 + the request 824,180,736 < the budget 10,446,428,672); the
    error now counts what the allocator held and says so."""
    from gemini.engine.memory import DeviceMemory

    memory = DeviceMemory.__new__(DeviceMemory)  # the CUDA side without a GPU: only what budget_error reads
    memory.device, memory.budget_bytes, memory.budgeted, memory.monitor = torch.device("cuda"), 10_446_428_672, True, None
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 8_137_029_632)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10_200_000_000)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 786.00 MiB. GPU 0 has a total capacity")
    err = memory.budget_error(oom, what="the backward pass", chunk_bytes=760_315_904, advice="lower the ratio")
    assert err.missing_bytes == 10_200_000_000 + 786 * 2**20 - 10_446_428_672
    assert "the allocator held 10200000000 in segments, 2062970368 of them free blocks" in str(err)
    assert "expandable_segments:True" in str(err)
    # A request the allocator serves from a new segment larger than itself is owed that segment
    # ([Note: the allocator's new segment]): a 2 MiB request takes 20 MiB, one of 1 KiB 2 MiB.
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10_446_428_672 - 2**20)
    for asked, unit, segment in ((2.0, "MiB", 20 * 2**20), (1.0, "KiB", 2 * 2**20)):
        oom = torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {asked:.2f} {unit}. GPU 0 has")
        err = memory.budget_error(oom, what="the forward pass", chunk_bytes=0, advice="lower the ratio")
        assert err.missing_bytes == segment - 2**20
        assert f"(a new segment of {segment})" in str(err)
    # An engine still alive with a smaller budget caps the allocator below this one's (a retry
    # after a budget error, the failed engine not yet collected: the GPU run of 2026-11-27's test
    # retried three times under its first budget's cap); the error names it.
    from gemini.engine.memory import _CAPS

    memory.total_bytes = 4 * 10_446_428_672
    monkeypatch.setitem(_CAPS._held, torch.device("cuda"), {1: 0.25, 2: 0.2})
    err = memory.budget_error(oom, what="the forward pass", chunk_bytes=0, advice="lower the ratio")
    assert f"another engine still alive caps the allocator at {int(0.2 * 4 * 10_446_428_672)} bytes" in str(err)
    monkeypatch.setitem(_CAPS._held, torch.device("cuda"), {1: 0.25})  # this engine's own cap alone
    assert "another engine" not in str(memory.budget_error(oom, what="x", chunk_bytes=0, advice="y"))


def test_a_move_of_model_data_reads_the_allocators_counters_a_few_times(monkeypatch):
    """Each move onto or off the device cuts the step's peak twice ([Note: the step's non-model
    peak]); each cut read torch.cuda.memory_allocated's kin three times, each flattening every
    counter of the allocator: about 2,200 reads a step (355M GPT, auto), an estimated tenth of a
    second of host time on a GPU. Now one nested read per reading, two per cut ([Note:
    reading the allocator's counters]); the figures are the same."""
    from gemini.engine import memory

    allocator = FakeCudaAllocator(monkeypatch)  # torch.cuda.memory_stats raises
    monkeypatch.setattr(memory, "_device_total_bytes", lambda device: 80 * 2**30)
    budget = memory.DeviceMemory(torch.device("cuda", 0), None, measure=True)
    budget.monitor.start()
    budget.reset_peak()
    allocator.use(5000)  # activations
    allocator.use(1000)
    reads = allocator.reads
    with budget.model_data_move():
        allocator.use(1000 + 4096)  # a chunk arrives
    assert allocator.reads - reads == 4
    assert budget.peak_bytes() == 5096 and allocator.reads - reads == 5  # the peak: one read
