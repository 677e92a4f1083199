"""The host's Adam in runs of groups: each run waits for its own gradients' copies and sends its
parameters back before the next run's CPU work ([Note: host groups updated as their gradients
land] in gemini/optim/adam_batches.py)."""

from __future__ import annotations

import pytest
import torch

import gemini
from chunks import ChunkState, ChunkStorage, Tier
from gemini.engine.grad_views import PendingGrad
from gemini.optim import adam_batches, hybrid_adam
from gemini.tools.gpt import GPT
from helpers import DEVICE, TINY, assert_params_close, batches, clone_pair, roomy_budget, train_gemini, train_reference

STEPS = 3


def _spy_runs(monkeypatch) -> list[tuple[Tier, list[int], dict[int, ChunkState]]]:
    """Each Adam batch as it runs: its tier, its groups, and every group's parameter chunk state."""
    seen: list[tuple[Tier, list[int], dict[int, ChunkState]]] = []
    real = hybrid_adam.run_batch

    def spy(rt, batch, clock):
        states = {g.index: g.param.state for g in rt.manager.trainable_groups}
        seen.append((batch.tier, [g.index for g in batch.members], states))
        real(rt, batch, clock)

    monkeypatch.setattr(hybrid_adam, "run_batch", spy)
    return seen


def _config(precision: str = "fp32", clip: float = 0.0, placement: str = "auto") -> gemini.GeminiConfig:
    # auto with the whole model in the budget and no margin: every optimizer state on the host
    # (the gpu_peers.md setting of "gemini auto (ratio 0)"), parameters kept on the device since
    # nothing is evicted ([Note: parameters stay where nothing is evicted] in
    # gemini/policies/auto.py); static: the same by its fields (ZeRO-Offload's placement).
    extra = dict(gpu_margin_mem_ratio=0.0) if placement == "auto" else dict(static_optimizer_offload_fraction=1.0)
    return gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=4096, precision=precision,
                               clip_grad_norm=clip, device_memory=roomy_budget("64MiB"), **extra)


@pytest.mark.parametrize("placement", ["auto", "static"])
def test_runs_of_one_group_equal_adamw_last_group_first(monkeypatch, placement):
    monkeypatch.setattr(adam_batches, "HOST_BATCH_ELEMENTS", 1)  # every group a run of its own
    seen = _spy_runs(monkeypatch)
    base, ref = clone_pair(TINY)
    data = batches(TINY, STEPS, device=DEVICE)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    _, got, _, opt = train_gemini(base, data, _config(placement=placement), lr=1e-2, weight_decay=0.1)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, {k: v.cpu() for k, v in w.items()}, step=step)
    order = [g.index for g in opt._rt.manager.trainable_groups][::-1]  # the order a backward ends them
    last = seen[-len(order):]
    # The last step: one run per group, last group first, all on the host. When a run starts the
    # parameters of the groups not updated yet are only on the host, where the step put them;
    # those of the runs before it are back on the device already (their host copy kept), under
    # both policies (auto's plan evicts nothing here).
    assert [(tier, members) for tier, members, _ in last] == [(Tier.HOST, [i]) for i in order]
    back = ChunkState.HOST_AND_DEVICE
    for k, (_, _, states) in enumerate(last):
        assert [states[i] for i in order[:k]] == [back] * k, states
        assert [states[i] for i in order[k:]] == [ChunkState.HOST] * (len(order) - k), states


@pytest.mark.parametrize("precision, clip", [("fp32", 0.5), ("bf16", 0.0), ("bf16", 0.5)])
def test_cutting_the_host_update_into_runs_changes_no_bit(monkeypatch, precision, clip):
    """One fused call per param group against one per group: the same bits, parameters and
    states (bf16 gradients through the one shared fp32 scratch)."""
    results = []
    for elements in (adam_batches.HOST_BATCH_ELEMENTS, 1):
        monkeypatch.setattr(adam_batches, "HOST_BATCH_ELEMENTS", elements)
        base, _ = clone_pair(TINY)
        _, got, _, opt = train_gemini(base, batches(TINY, STEPS, device=DEVICE), _config(precision, clip),
                                      lr=1e-2, weight_decay=0.1)
        states = [s for st in opt.state_dict()["state"].values() for s in (st["exp_avg"], st["exp_avg_sq"])]
        results.append((got, states))
    (got_one, states_one), (got_runs, states_runs) = results
    for a, b in zip(got_one, got_runs):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a, b) for a, b in zip(states_one, states_runs))


def test_host_runs_hold_the_size_they_are_given():
    """Consecutive groups until a run holds the size; the rest in the last run."""

    class G:
        def __init__(self, n):
            self.os_numel = n

    groups = [G(n) for n in (3, 3, 5, 1, 1, 1, 7)]
    runs = adam_batches._host_runs(groups, 6)
    assert [[g.os_numel for g in r] for r in runs] == [[3, 3], [5, 1], [1, 1, 7]]
    assert adam_batches._host_runs(groups, 1 << 30) == [groups]


def test_a_step_loop_through_the_runs_trains_like_torch_gpt():
    """A plain GPT loop (loss.backward, step, zero_grad) with the default size: unchanged."""
    base, ref = clone_pair(TINY)
    data = batches(TINY, STEPS, device=DEVICE)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    gmodel, opt = gemini.initialize(base, _config(), lr=1e-2, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        GPT.loss(gmodel(x), y).backward()
        opt.step()
        opt.zero_grad()
        assert_params_close({k: v.cpu() for k, v in gmodel.state_dict().items()},
                            {k: v.cpu() for k, v in want[step].items()}, step=step)


def _copies_in_flight(monkeypatch) -> list:
    """Every copy to the host returns an event still "running" (a _CopyInFlight), each Adam run
    is logged as it starts, and every group is a run of its own: the log of waits and runs."""
    monkeypatch.setattr(adam_batches, "HOST_BATCH_ELEMENTS", 1)
    log: list = []
    copy_ = ChunkStorage.copy_

    def in_flight(self, out, payload, *, src, dst, defer_device_wait=False):
        event = copy_(self, out, payload, src=src, dst=dst, defer_device_wait=defer_device_wait)
        if dst is not Tier.HOST or src is Tier.HOST:
            return event
        if event is not None:  # on a GPU the real copy ends here; the stand-in event is what is waited for
            event.synchronize()
        return _CopyInFlight(log)

    monkeypatch.setattr(ChunkStorage, "copy_", in_flight)
    real = hybrid_adam.run_batch

    def spy(rt, batch, clock):
        log.append(("run", [g.index for g in batch.members]))
        real(rt, batch, clock)

    monkeypatch.setattr(hybrid_adam, "run_batch", spy)
    return log


def _in_flight_run(monkeypatch, *, steps: int, clip: float = 0.0):
    """Copies to the host in flight (``_copies_in_flight``'s log), the data, the reference's
    parameters per step (AdamW, clipped at ``clip``), and gemini's model and optimizer."""
    log = _copies_in_flight(monkeypatch)
    base, ref = clone_pair(TINY)
    data = batches(TINY, steps, device=DEVICE)
    _, want, _ = train_reference(ref, data, clip=clip, lr=1e-2, weight_decay=0.1)
    gmodel, opt = gemini.initialize(base, _config(), lr=1e-2, weight_decay=0.1)
    return log, data, want, gmodel, opt


class _CopyInFlight:
    """Stands in for the CUDA event of a copy to the host still running: records when something
    first waits for it."""

    def __init__(self, log: list):
        self.log, self.name = log, "a copy"

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))


def test_no_wait_in_backward_and_each_run_waits_for_its_own_copies_just_before_it(monkeypatch):
    """As on a GPU, every copy to the host returns at once with an event (the stand-in copies
    synchronously, so the events are stood in for). The backward waits for none of the gradients
    it sends to the host, so it can return while a GPU still computes; the step waits for a
    group's gradients right before the run that updates it, and for no later group's before an
    earlier run: the CPU's Adam of the last groups overlaps the copies of the first."""
    log, data, want, gmodel, opt = _in_flight_run(monkeypatch, steps=3)
    for step, (x, y) in enumerate(data):
        loss = GPT.loss(gmodel(x), y)
        log.clear()
        opt.backward(loss)
        groups = opt._rt.manager.trainable_groups
        if step > 0:  # the warm-up's own moves aside
            assert not [e for e in log if e[0] == "wait"], log
            assert all(g.grad.state is ChunkState.HOST for g in groups)  # sent as each group's backward ended
            assert all(type(p.grad) is PendingGrad for p in gmodel.parameters())
            for g in groups:
                g.grad._host_event.name = g.index  # the copy of group g's gradients
        log.clear()
        opt.step()
        opt.zero_grad()
        if step > 0:
            order = [g.index for g in groups][::-1]
            assert log == [entry for i in order for entry in (("run", [i]), ("wait", i))], log
        assert_params_close({k: v.cpu() for k, v in gmodel.state_dict().items()},
                            {k: v.cpu() for k, v in want[step].items()}, step=step)


def test_reading_p_grad_before_the_step_waits_for_its_copy_first(monkeypatch):
    """torch's clip_grad_norm_ and a gradient read between backward and step, with the copies
    to the host in flight: each p.grad waits for its group's copy before torch reads it (all
    before the step's first run), and training equals torch's clipped AdamW."""
    log, data, want, gmodel, opt = _in_flight_run(monkeypatch, steps=3, clip=0.05)
    for step, (x, y) in enumerate(data):
        opt.backward(GPT.loss(gmodel(x), y))
        log.clear()
        groups = opt._rt.manager.trainable_groups
        for g in groups:
            if g.grad._host_event is not None:
                g.grad._host_event.name = g.index
        torch.nn.utils.clip_grad_norm_(gmodel.parameters(), 0.05)
        if step > 0:
            assert sorted(e[1] for e in log) == [g.index for g in groups] and all(e[0] == "wait" for e in log), log
            assert type(gmodel.wte.weight.grad) is PendingGrad and gmodel.wte.weight.grad._chunk is None
        opt.step()
        opt.zero_grad()
        assert_params_close({k: v.cpu() for k, v in gmodel.state_dict().items()},
                            {k: v.cpu() for k, v in want[step].items()}, step=step)


def test_reading_p_grad_metadata_waits_for_no_copy(monkeypatch):
    """Shape, dtype, device, size and the like of a p.grad whose copy is in flight answer without
    waiting (a loop that logs shapes or checks ``p.grad.numel()`` keeps the overlap); its values
    still wait."""
    log, data, want, gmodel, opt = _in_flight_run(monkeypatch, steps=2)
    for step, (x, y) in enumerate(data):
        opt.backward(GPT.loss(gmodel(x), y))
        log.clear()
        for p in gmodel.parameters():
            g = p.grad
            assert (g.shape, g.dtype, g.device.type, g.size(), g.dim(), g.numel(), g.ndim, len(g)) == (
                p.shape, p.dtype, p.device.type, p.size(), p.dim(), p.numel(), p.ndim, len(p))
            assert g.stride() == p.stride() and g.is_contiguous() and not g.requires_grad
        if step > 0:
            assert log == [], log
            head = gmodel.ln_f.weight.grad
            assert type(head) is PendingGrad and head._chunk is not None
            head.sum()  # a read of its values waits for its group's copy
            assert [e[0] for e in log] == ["wait"] and head._chunk is None
        opt.step()
        opt.zero_grad()
        assert_params_close({k: v.cpu() for k, v in gmodel.state_dict().items()},
                            {k: v.cpu() for k, v in want[step].items()}, step=step)
