"""Gradients as torch code around the model sees them: a tensor put in ``p.grad`` before
backward, the user's own post-accumulate-grad hooks, ``torch.func.vmap`` over the model, and
parameters that get no gradient in a pass beside ones that do.

Each test runs the same loop on plain PyTorch (a deepcopy, torch.optim.AdamW) and through gemini
under each placement, and compares what the loop reads (``p.grad``, what the hooks saw, torch's
clip_grad_norm_) and the parameters after every step (fp32, 1e-6).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemini
from gemini.tools.gpt import GPT
from helpers import DEVICE, TINY, assert_params_close, batches, clone_pair

STEPS = 3


class Net(nn.Module):
    """Three layers, and one the forward skips, registered between the first two: with chunks of
    2048 elements it shares a chunk group with the first, so every pass leaves that group
    without gradients in part."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.skipped = nn.Linear(32, 32)
        self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


CONFIGS = {
    "cuda": dict(placement="cuda"),
    "cpu": dict(placement="cpu"),
    "static": dict(placement="static", static_param_device_fraction=0.5, static_optimizer_offload_fraction=0.5),
    "auto": dict(placement="auto"),
    "auto-margin": dict(placement="auto", gpu_margin_mem_ratio=0.5),
}
NAMES = list(CONFIGS)


def _pair(name: str):
    torch.manual_seed(0)
    base = Net()
    ref = copy.deepcopy(base).to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, chunk_size=2048, **CONFIGS[name]),
                                   lr=1e-2, weight_decay=0.1)
    assert [len(g.params) for g in opt._rt.manager.groups] == [4, 4]  # a and skipped; b and c
    return ref, ref_opt, model, opt


def _data(shape=(6, 8)):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=g).to(DEVICE), torch.randn(*shape[:-1], 4, generator=g).to(DEVICE))
            for _ in range(STEPS)]


def _grads(model) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def _assert_same_grads(got: dict, want: dict, step: int) -> None:
    assert {n for n, g in got.items() if g is not None} == {n for n, g in want.items() if g is not None}, step
    for n, g in got.items():
        if g is not None:
            torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step}, {n}: {m}")


def _run(name: str, iteration, *, setup=lambda ref, model: None):
    """``setup(ref, model)``, then ``iteration(model, opt, x, y, step)`` on both; checks p.grad
    after each iteration and the parameters after each step."""
    ref, ref_opt, model, opt = _pair(name)
    setup(ref, model)
    for step, (x, y) in enumerate(_data()):
        for m, o in ((ref, ref_opt), (model, opt)):
            iteration(m, o, x, y, step)
        _assert_same_grads(_grads(model), _grads(ref), step)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        assert_params_close(model.state_dict(), ref.state_dict(), step=step)
    opt.close()


@pytest.mark.parametrize("name", NAMES)
def test_a_gradient_put_in_p_grad_before_backward_is_added_onto(name):
    """Before the fix placement "cuda" (autograd accumulating straight into the chunks) replaced
    such a tensor with the chunk's view: the backward's gradient alone was stepped."""

    def iteration(model, opt, x, y, step):
        for i, p in enumerate(model.parameters()):
            if i % 2 == 0:
                p.grad = torch.full_like(p, 0.01 * (step + 1))
        F.mse_loss(model(x), y).backward()

    _run(name, iteration)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_post_accumulate_grad_hooks_registered_after_initialize_see_the_gradient(name, micro_batches):
    """A hook the user registers on each parameter after initialize sees ``p.grad`` as torch's
    does, and scaling it in place counts once. Before the fix the engine's own hook (registered
    at initialize, so run first) had moved the gradient into its chunk: every hook found None
    under "cpu", "static" and "auto"; and with micro-batches a later pass's hook saw that pass's
    gradient alone, not the step's so far (its scaling left the earlier ones unscaled)."""
    seen = {"torch": [], "gemini": []}

    def setup(ref, model) -> None:
        for who, m in (("torch", ref), ("gemini", model)):
            for p in m.parameters():
                p.register_post_accumulate_grad_hook(lambda p, who=who: scale(p, who))

    def scale(p: nn.Parameter, who: str) -> None:
        seen[who].append(p.grad.norm().item())
        p.grad.mul_(0.5)

    def iteration(model, opt, x, y, step):
        for part in range(micro_batches):
            F.mse_loss(model(x[part::micro_batches]), y[part::micro_batches]).backward()

    _run(name, iteration, setup=setup)
    torch.testing.assert_close(seen["gemini"], seen["torch"], rtol=1e-6, atol=1e-7)
    assert len(seen["gemini"]) == STEPS * 6 * micro_batches  # a, b and c's weight and bias, each pass


@pytest.mark.parametrize("name", NAMES)
def test_backward_through_vmap_over_the_model_trains_like_torch(name):
    """``torch.func.vmap(model)(x)`` then backward: the calls' outputs inside vmap are batched
    wrappers without a graph of their own. Before the fix the engine's pre-backward hooks went on
    the wrappers and never ran: under placements that move chunks the backward read freed storage."""

    def iteration(model, opt, x, y, step):
        out = torch.func.vmap(model)(x.unsqueeze(1))
        F.mse_loss(out.squeeze(1), y).backward()

    _run(name, iteration)


@pytest.mark.parametrize("partial", ["skipped-module", "backward-inputs"])
@pytest.mark.parametrize("name", NAMES)
def test_p_grad_and_torch_clipping_where_a_group_got_gradients_in_part(name, partial):
    """A chunk group whose parameters got gradients in part (a submodule the forward skips; a
    backward limited with ``inputs=``): ``p.grad`` reads the gradient and torch's clip_grad_norm_
    equals torch's. Before the fix the group was never closed under "cpu" and "auto": its
    gradients stayed on the device, its parameters went to the host, and reading p.grad raised
    "not beside its parameter"."""
    norms = {}

    def iteration(model, opt, x, y, step):
        loss = F.mse_loss(model(x), y)
        if partial == "backward-inputs":
            inputs = [p for n, p in model.named_parameters() if n in ("a.weight", "c.weight")]
            (opt.backward(loss, inputs=inputs) if isinstance(opt, gemini.HybridAdam) else loss.backward(inputs=inputs))
        else:
            loss.backward()
        norms.setdefault(id(model), []).append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())

    _run(name, iteration)
    want, got = norms.values()  # torch's loop runs first
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.standin  # budgets in bytes the CPU stand-in counts exactly (on CUDA the allocator's cap)
@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_hooks_over_micro_batches_stay_under_an_auto_budget(ratio):
    """With the user's post-accumulate hooks, each later micro-batch copied the step's gradient
    so far out of the chunks into every ``p.grad`` as its backward began: a whole gradient the
    warm-up (the first micro-batch) never saw, so the second went over the budget the plan
    held to (with ratio 1 at every budget, the margin filling what the plan left). Now each copy
    is made as its parameter's gradient arrives and goes into the chunk after the hooks ([Note:
    the user's post-accumulate hooks]): every step under the budget, the hooks and parameters
    as torch's."""
    base, ref = clone_pair()
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    probe_model, probe = gemini.initialize(copy.deepcopy(base), gemini.GeminiConfig(device=DEVICE, placement="cuda",
                                                                                    chunk_size=8192))
    data = batches(TINY, 2 * STEPS, batch=2, seq=16)
    GPT.loss(probe_model(data[0][0]), data[0][1]).backward()
    probe.step()
    budget = probe.report.device_peak_bytes * 55 // 100  # about half of what placement cuda holds
    probe.close()
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=8192,
                                                             device_memory=budget, gpu_margin_mem_ratio=ratio),
                                   lr=1e-2, weight_decay=0.01)
    seen = {"torch": [], "gemini": []}
    for who, m in (("torch", ref), ("gemini", model)):
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(lambda p, who=who: seen[who].append(p.grad.norm().item()))
    for step in range(STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            for x, y in data[2 * step: 2 * step + 2]:
                (GPT.loss(m(x), y) / 2).backward()
            o.step()
            o.zero_grad()
        assert opt.report.device_peak_bytes <= budget, (step, opt.report.device_peak_bytes, budget)
        assert_params_close(model.state_dict(), ref.state_dict(), step=step)
    opt.close()
    torch.testing.assert_close(seen["gemini"], seen["torch"], rtol=1e-5, atol=1e-6)
