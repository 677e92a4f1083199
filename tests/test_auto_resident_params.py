"""Under auto, where the plan evicts nothing, parameters updated on the host come back to the
device inside the step and stay there ([Note: parameters stay where nothing is evicted] in
gemini/policies/auto.py): ZeRO-Offload's and torchao's placement, at no more traffic."""

from __future__ import annotations

import pytest
import torch

import gemini
from chunks import ChunkState
from gemini.tools.gpt import GPT, GPTConfig
from helpers import (DEVICE, assert_params_close, batches, clone_pair, placement_configs, roomy_budget,
                     train_reference)

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=64)
STEPS = 3


def _train(config: gemini.GeminiConfig, *, check_step=None):
    """Each step's parameters (on the CPU) and report."""
    base, _ = clone_pair(CFG)
    model, opt = gemini.initialize(base, config, lr=1e-2, weight_decay=0.1)
    states, reports = [], []
    for step, (x, y) in enumerate(batches(CFG, STEPS, batch=2, seq=16, device=DEVICE)):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
        states.append({k: v.cpu() for k, v in model.state_dict().items()})
        reports.append(opt.report)
        if check_step is not None:
            check_step(step, opt)
    opt.close()
    return states, reports


def _reference():
    """Plain fused AdamW's parameters at each step."""
    _, ref = clone_pair(CFG)
    _, want, _ = train_reference(ref, batches(CFG, STEPS, batch=2, seq=16, device=DEVICE), lr=1e-2, weight_decay=0.1)
    return [{k: v.cpu() for k, v in w.items()} for w in want]


def _assert_trained_like(states, want):
    for step, (got, w) in enumerate(zip(states, want, strict=True)):
        assert_params_close(got, w, step=step)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameters_come_back_in_the_step_where_nothing_is_evicted(precision):
    """From the first step on, every parameter chunk ends the step on the device (its host copy
    kept for the next update), and each step moves each parameter byte once to the device and
    each gradient byte once to the host, as before; every step under the budget, equal to AdamW
    (bf16: to placement cpu's)."""
    budget = roomy_budget("64MiB")
    config = gemini.GeminiConfig(device=DEVICE, placement="auto", gpu_margin_mem_ratio=0.0, chunk_size=8192,
                                 precision=precision, device_memory=budget)
    cpu_states, cpu_reports = _train(gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=8192,
                                                         precision=precision))

    def check(step, opt):
        rt, report = opt._rt, opt.report
        assert not rt.placement.track_periods and report.os_chunks_on_device == 0
        groups = rt.manager.groups
        assert [g.param.state for g in groups] == [ChunkState.HOST_AND_DEVICE] * len(groups), step
        param_bytes = sum(g.param.nbytes for g in groups)
        assert report.model_bytes_by_tier["device"]["param"] == param_bytes
        if step == 0:  # the warm-up's, fetching and releasing as placement cpu, then the parameters once
            assert report.h2d_bytes == cpu_reports[0].h2d_bytes + param_bytes
        else:
            # bf16: the masters' cast goes into both copies, the used elements only.
            used = sum(g.param.used_numel * g.param.dtype.itemsize for g in groups)
            assert report.h2d_bytes == (param_bytes if precision == "fp32" else used)
            assert report.d2h_bytes == sum(g.grad.nbytes for g in groups if g.grad is not None)
        if DEVICE == "cpu":
            assert report.device_peak_bytes <= gemini.GeminiConfig(device_memory=budget).device_memory

    states, _ = _train(config, check_step=check)
    # bf16: against placement cpu's, the host's Adam too
    _assert_trained_like(states, cpu_states if precision == "bf16" else _reference())


@pytest.mark.standin  # a budget sized for the stand-in's exact counting
def test_parameters_leave_the_device_where_the_plan_evicts():
    """Under a budget that makes auto evict, the step does not bring the parameters back (the
    next forward fetches what its periods need, as the plan schedules)."""
    fields = placement_configs(16 * CFG.num_params())["auto-evicting"]
    config = gemini.GeminiConfig(device=DEVICE, **fields)

    def check(step, opt):
        rt, report = opt._rt, opt.report
        assert rt.placement.track_periods and rt.placement.resident_params() == set()
        assert report.model_bytes_by_tier["device"]["param"] < sum(g.param.nbytes for g in rt.manager.groups)
        assert report.device_peak_bytes <= config.device_memory

    _assert_trained_like(_train(config, check_step=check)[0], _reference())



def test_a_plan_adopted_between_micro_batches_brings_the_parameters_at_once():
    """Under gradient accumulation the warm-up ends when the second forward begins (it traced the
    first forward and backward): no step follows there, so the plan's adoption fetches the
    parameters it keeps then, before the forward's first module runs."""
    config = gemini.GeminiConfig(device=DEVICE, placement="auto", gpu_margin_mem_ratio=0.0, chunk_size=8192,
                                 device_memory=roomy_budget("64MiB"))
    base, ref = clone_pair(CFG)
    data = batches(CFG, 3, batch=2, seq=16, device=DEVICE)
    _, want, _ = train_reference(ref, data, micro_batches=3, lr=1e-2, weight_decay=0.1)
    model, opt = gemini.initialize(base, config, lr=1e-2, weight_decay=0.1)
    groups = opt._rt.manager.groups
    at_forward: list[list[ChunkState]] = []
    model.wte.register_forward_pre_hook(lambda m, args: at_forward.append([g.param.state for g in groups]))
    for x, y in data:
        opt.backward(GPT.loss(model(x), y) / 3)
    opt.step()
    opt.zero_grad()
    assert_params_close(model.state_dict(), {k: v.cpu() for k, v in want[0].items()})
    assert at_forward[1] == at_forward[2] == [ChunkState.HOST_AND_DEVICE] * len(groups)
    opt.close()


MICRO = 3  # micro-batches a step


def _micro_batches(model, data, backward, step, *, between=None, before_step=None, after_backward=None):
    """MICRO micro-batches of ``data`` a step through ``backward(loss)`` and ``step()``, the
    edits of ``p.grad``: ``between(model)`` after each backward but the last, ``before_step(model)``;
    yields after each step."""
    for s in range(len(data) // MICRO):
        for i in range(MICRO):
            x, y = data[s * MICRO + i]
            backward(GPT.loss(model(x), y) / MICRO)
            del x, y
            if after_backward is not None:
                after_backward()
            if i < MICRO - 1 and between is not None:
                between(model)
        if before_step is not None:
            before_step(model)
        step()
        yield s


def _accumulate(config: gemini.GeminiConfig, *, steps: int = STEPS, **edits):
    """Each step's parameters and report, the gradient chunks' states after each backward, and
    the data (:func:`_micro_batches`)."""
    base, _ = clone_pair(CFG)
    model, opt = gemini.initialize(base, config, lr=1e-2, weight_decay=0.1)
    data = batches(CFG, steps * MICRO, batch=2, seq=16, device=DEVICE)
    states, reports, grads = [], [], []
    record = lambda: grads.append([g.grad.state for g in opt._rt.manager.trainable_groups])  # noqa: E731
    for _ in _micro_batches(model, data, opt.backward, lambda: (opt.step(), opt.zero_grad()),
                            after_backward=record, **edits):
        states.append({k: v.cpu() for k, v in model.state_dict().items()})
        reports.append(opt.report)
    opt.close()
    return states, reports, grads, data


def _reference_accumulating(data, **edits):
    """Plain fused AdamW over the same micro-batches, with the same edits of ``p.grad``."""
    _, ref = clone_pair(CFG)
    ref.to(DEVICE)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return [{k: v.detach().cpu().clone() for k, v in ref.state_dict().items()}
            for _ in _micro_batches(ref, data, torch.Tensor.backward, lambda: (opt.step(), opt.zero_grad()), **edits)]


def _roomy_ratio0() -> gemini.GeminiConfig:
    return gemini.GeminiConfig(device=DEVICE, placement="auto", gpu_margin_mem_ratio=0.0, chunk_size=8192,
                               device_memory=roomy_budget("64MiB"))


def test_accumulated_gradients_stay_on_the_device_between_backward_passes():
    """[Note: accumulated gradients stay on the device]: once a backward has added onto
    gradients sent to the host (the first step's second micro-batch), the gradients stay on the
    device until the step, which sends them once: every later step moves the parameters to the
    device once and the gradients to the host once (it moved each micro-batch's gradients both
    ways), under the budget, equal to AdamW; one backward a step sends them after it as before
    and holds nothing longer."""
    config = _roomy_ratio0()
    states, reports, grads, data = _accumulate(config)
    _assert_trained_like(states, _reference_accumulating(data))
    _, probe = gemini.initialize(clone_pair(CFG)[0], config)
    param_bytes = sum(g.param.nbytes for g in probe._rt.manager.groups)
    grad_bytes = sum(g.grad.nbytes for g in probe._rt.manager.trainable_groups)
    probe.close()
    for step, r in enumerate(reports[1:], start=1):
        assert (r.h2d_bytes, r.d2h_bytes) == (param_bytes, grad_bytes), step
        if DEVICE == "cpu":
            assert r.device_peak_bytes <= config.device_memory
    on_device = [ChunkState.DEVICE] * len(grads[0])
    assert grads[0] == [ChunkState.HOST] * len(grads[0])  # the warm-up's first backward sent them
    assert grads[1:] == [on_device] * (len(grads) - 1)
    _, single = _train(config)
    assert all(r.d2h_bytes == grad_bytes for r in single[1:])
    base, _ = clone_pair(CFG)
    model, opt = gemini.initialize(base, config, lr=1e-2)
    for x, y in batches(CFG, 2, batch=2, seq=16, device=DEVICE):
        opt.backward(GPT.loss(model(x), y))
        assert {g.grad.state for g in opt._rt.manager.trainable_groups} == {ChunkState.HOST}
        opt.step()
        opt.zero_grad()
    opt.close()


@pytest.mark.parametrize("edit", ["p.grad.mul_", "clip_grad_norm_", "model.clip_grad_norm_", "p.grad = None"])
def test_gradients_edited_between_backward_passes_are_what_the_next_one_adds_onto(edit):
    """torch code that writes ``p.grad`` between two backward passes (and clipping before the
    step) writes the gradients the device keeps; the next backward adds onto them as plain
    PyTorch adds onto the edited ``.grad``, and the step reads them."""

    def between(model):
        params = [p for p in model.parameters() if p.grad is not None]
        if edit == "p.grad.mul_":
            for p in params:
                p.grad.mul_(0.5)
        elif edit == "clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(params, 0.05)
        elif edit == "model.clip_grad_norm_" and hasattr(model, "clip_grad_norm_"):
            model.clip_grad_norm_(0.05)
        elif edit == "model.clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(params, 0.05)
        else:
            params[0].grad = None

    def before_step(model):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)

    config = _roomy_ratio0()
    states, reports, grads, data = _accumulate(config, between=between, before_step=before_step)
    _assert_trained_like(states, _reference_accumulating(data, between=between, before_step=before_step))
    assert ChunkState.DEVICE in grads[-2]  # edited where they stay


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_accumulated_low_precision_gradients_stay_and_train_as_placement_cpu(precision):
    """bf16 / fp16 (its loss scaler reading the gradients the step brings to the host): the
    accumulated gradients stay on the device and go to the host once a step, and training equals
    placement cpu's (whose host Adam is the same) bit for bit."""
    auto = gemini.GeminiConfig(device=DEVICE, placement="auto", gpu_margin_mem_ratio=0.0, chunk_size=8192,
                               precision=precision, device_memory=roomy_budget("64MiB"))
    cpu = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=8192, precision=precision)
    states, reports, grads, _ = _accumulate(auto)
    want, _, _, _ = _accumulate(cpu)
    for step, (got, w) in enumerate(zip(states, want, strict=True)):
        assert_params_close(got, w, rtol=0, atol=0, step=step)
    grad_bytes = reports[-1].model_bytes_by_tier["host"]["grad"]
    assert grad_bytes > 0 and all(r.d2h_bytes == grad_bytes for r in reports[1:])
    assert set(grads[-1]) == {ChunkState.DEVICE}
