"""Autograd graph tasks besides the iteration's backward: input-gradient penalties (WGAN-GP,
R1) through ``torch.autograd.grad(..., create_graph=True)``, ``torch.autograd.grad`` without it
before the real backward (a saliency map), and ``backward(create_graph=True)`` through the
parameters, which gemini refuses clearly (see [Note: a graph task that accumulates no parameter
gradient] in gemini/engine/hooks.py and [Note: parameters a create_graph pass saved] in
gemini/engine/residency.py).

Each training test runs the same loop on plain PyTorch (torch.optim.AdamW, fused) and through
gemini, and compares parameters after every step (fp32, 1e-6).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemini
from gemini.engine.memory import DeviceBudgetError
from helpers import DEVICE, assert_params_close, tolerance

WIDTH = 256
STEPS = 3
# The stand-in's bytes for the budgets below (see test_torch_idioms.STANDIN): the critic's
# model data (fp32 params, grads, m, v) is 4.48 MB.
MODEL_DATA_BYTES = 4_481_040
CONFIGS = {
    "cuda": dict(placement="cuda"),
    "cpu": dict(placement="cpu"),
    "static": dict(placement="static", static_param_device_fraction=0.5, static_optimizer_offload_fraction=0.5),
    "auto": dict(placement="auto"),
    # Below the model data, so optimizer states stay on the host and chunks move. A penalty's
    # backward holds every parameter on its path at once: the loop's own budget.
    "auto-budget": dict(placement="auto"),
}
BUDGETS = {"wgan_gp": 4_200_000, "r1": 3_200_000, "saliency": 2_000_000}  # saliency's evicts
STANDIN = {"auto-budget"}


def _names(names):
    return [pytest.param(n, marks=pytest.mark.standin) if n in STANDIN else n for n in names]


class Critic(nn.Module):
    """A conditional critic: the penalties differentiate with respect to ``x`` only, so the
    condition's branch is no part of their graph."""

    def __init__(self) -> None:
        super().__init__()
        self.x_net = nn.Sequential(nn.Linear(32, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.c_net = nn.Sequential(nn.Linear(32, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(2 * WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

    def forward(self, x, c):
        return self.head(torch.cat([self.x_net(x), self.c_net(c)], dim=1))


def _data(n: int = STEPS, batch: int = 8):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        real, fake, c = (torch.randn(batch, 32, generator=g) for _ in range(3))
        out.append(tuple(t.to(DEVICE) for t in (real + 1, fake, c, torch.rand(batch, 1, generator=g))))
    return out


def wgan_gp(model, batch):
    """The critic's WGAN-GP loss: the penalty on the input gradient at interpolates."""
    real, fake, c, alpha = batch
    x = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    g, = torch.autograd.grad(model(x, c).sum(), x, create_graph=True)
    penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
    (model(fake, c).mean() - model(real, c).mean() + 10 * penalty).backward()
    return g.detach()


def r1(model, batch):
    """StyleGAN2's critic step: the main loss's backward, then the R1 penalty's forward and
    backward (two backward passes into the same gradients)."""
    real, fake, c, _ = batch
    F.softplus(model(fake, c)).mean().backward()
    real = real.clone().requires_grad_(True)
    out = model(real, c)
    g, = torch.autograd.grad(out.sum(), real, create_graph=True)
    (F.softplus(-out).mean() + 5.0 * g.pow(2).sum(dim=1).mean()).backward()
    return g.detach()


def saliency(model, batch):
    """The input gradient of the loss (no create_graph), then the loss's backward."""
    real, _, c, _ = batch
    x = real.clone().requires_grad_(True)
    loss = model(x, c).pow(2).mean()
    s, = torch.autograd.grad(loss, x, retain_graph=True)
    loss.backward()
    return s


LOOPS = {"wgan_gp": wgan_gp, "r1": r1, "saliency": saliency}


def _pair(name: str, loop: str = "wgan_gp", **extra):
    torch.manual_seed(0)
    base = Critic()
    ref = copy.deepcopy(base).to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    config = dict(CONFIGS[name], chunk_size=66_000, **extra)
    if name == "auto-budget":
        config["device_memory"] = BUDGETS[loop]
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, **config), lr=1e-2, weight_decay=0.1)
    return (ref, ref_opt), (model, opt)


def _train(model, opt, loop, data, peaks=None):
    """``loop`` per batch, then step and zero_grad: what the loop returned, parameters per step
    (and into ``peaks`` each step's measured device peak)."""
    outs, snapshots = [], []
    for batch in data:
        outs.append(loop(model, batch).cpu())
        opt.step()
        if peaks is not None:
            peaks.append(opt.report.device_peak_bytes)
        opt.zero_grad()
        snapshots.append({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
    return outs, snapshots


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("name", _names(CONFIGS))
def test_input_gradients_train_like_torch(name, loop):
    """Before the fix a graph task of torch.autograd.grad was taken for the iteration's backward:
    its end dropped the parameters the penalty's graph saved ("setStorage: ... storage of size
    0" under cpu and auto), and under cuda p.grad was armed for a pass that accumulates none."""
    (ref, ref_opt), (model, opt) = _pair(name, loop)
    data = _data()
    want_outs, want = _train(ref, ref_opt, LOOPS[loop], data)
    peaks = []
    got_outs, got = _train(model, opt, LOOPS[loop], data, peaks)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    for step, (g, w) in enumerate(zip(got_outs, want_outs)):
        torch.testing.assert_close(g, w, **tolerance(1e-6, 1e-7), msg=lambda m: f"step {step}: {m}")
    rt = opt._rt
    assert rt.hooks.backward_passes == STEPS * (2 if loop == "r1" else 1)  # torch.autograd.grad is none
    assert not rt.residency._held and not any(rt.residency._compute_refs.values())  # released by the step
    if name == "auto-budget":
        assert max(peaks) <= BUDGETS[loop] < MODEL_DATA_BYTES
        if loop == "saliency":
            assert rt.residency.evictions > 0
    opt.close()


def test_input_gradients_under_fp16_are_no_unscaled_backward():
    """fp16 checks every backward pass went through optimizer.backward (scaled): a
    torch.autograd.grad before it is no backward pass, or every step refused to run."""
    torch.manual_seed(0)
    model, opt = gemini.initialize(Critic(), gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=66_000,
                                                                 precision="fp16"), lr=1e-3)
    for real, _, c, _ in _data():
        x = real.half().requires_grad_(True)
        loss = model(x, c.half()).float().pow(2).mean()
        torch.autograd.grad(loss, x, retain_graph=True)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    assert opt._rt.hooks.backward_passes == STEPS
    opt.close()


@pytest.mark.standin  # budgets in the stand-in's bytes
def test_a_budget_too_small_for_a_penalty_is_a_device_budget_error():
    """A penalty's backward holds every parameter on its path: a budget that trains the
    saliency loop (evicting) cannot hold it, which is a DeviceBudgetError, not a torch error;
    the engine goes on with a loop the budget holds, like torch."""
    (ref, ref_opt), (model, opt) = _pair("auto-budget", "saliency")
    data = _data()
    with pytest.raises(DeviceBudgetError):
        wgan_gp(model, data[0])
        opt.step()
    opt.zero_grad()
    want_outs, want = _train(ref, ref_opt, saliency, data)
    got_outs, got = _train(model, opt, saliency, data)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    assert not opt._rt.residency._held
    opt.close()


def _higher_order(model, batch):
    """A gradient-norm regulariser: second order through the parameters."""
    real, _, c, _ = batch
    loss = model(real, c).pow(2).mean()
    loss.backward(create_graph=True)
    norm = sum(p.grad.pow(2).sum() for p in model.parameters())
    for p in model.parameters():
        p.grad = None
    (loss + 0.1 * norm).backward()


def _plain(model, batch):
    real, _, c, _ = batch
    loss = model(real, c).pow(2).mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("name", ["cuda", "cpu", "static", "auto"])
def test_create_graph_through_parameters_is_refused_clearly_and_training_goes_on(name):
    """backward(create_graph=True) makes p.grad part of a graph, which gradient chunks cannot
    hold: a RuntimeError naming the feature and what works instead, at the first such gradient
    (before: a no-grad-view error under cuda, setStorage under cpu/auto, a second backward
    through a freed graph under static). Then zero_grad and training on, as after any backward
    that raised ([Note: a backward pass that raised])."""
    (ref, ref_opt), (model, opt) = _pair(name)
    data = _data(STEPS + 1)
    _train(ref, ref_opt, _plain, data[:1])
    _train(model, opt, _plain, data[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning about create_graph's reference cycle
        with pytest.raises(RuntimeError, match=r"higher-order gradients through parameters are not supported"
                                               r"[\s\S]*torch\.autograd\.grad\(outputs, inputs="):
            _higher_order(model, data[1])
    assert all(p.grad is None or not p.grad.requires_grad for p in model.parameters())
    opt.zero_grad()
    _, want = _train(ref, ref_opt, _plain, data[1:])
    _, got = _train(model, opt, _plain, data[1:])
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    assert not opt._rt.residency._held and not any(opt._rt.residency._compute_refs.values())
    opt.close()


def test_a_call_is_done_once_per_graph_task_when_its_own_inputs_gradients_are_in():
    """[Note: several graph tasks through one forward]: counted across graph tasks, a first task
    computing one input's gradient left the count at one, and the second task reported the call
    done at its first input's gradient, while its nodes toward the other still read the weight."""
    from gemini.engine.backward_uses import hook_all_grads_of

    w = torch.randn(4, 4, requires_grad=True)
    a, b = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    computed, done = [], []  # inputs whose gradient is in, in this task; what was in when done
    for name, t in (("a", a), ("b", b)):
        t.register_hook(lambda g, name=name: computed.append(name))  # before the counting hooks
    assert hook_all_grads_of((a, b), lambda: done.append(sorted(computed)))
    out = (a @ w).sum() + (b @ w).sum()
    for _ in range(2):  # b's gradient not computed: not done, in either task
        computed.clear()
        torch.autograd.grad(out, a, retain_graph=True)
    assert done == []
    computed.clear()
    out.backward()
    assert done == [["a", "b"]]  # once, with both its inputs' gradients in


@pytest.mark.standin  # budgets in the stand-in's bytes
@pytest.mark.parametrize("budget,message", [
    # The second round, traced on its own (its input needs a gradient, the first's did not:
    # [Note: plans kept per input signature] in tracer/signature.py), refused at the step.
    (2_500_000, "the warm-up iteration .*needed"),
    # Raised in the warm-up's backward, whose non-model bytes are not measured yet: a floor.
    (1_000_000, r"cannot hold this period: at least \d+ bytes are missing"),
])
def test_a_warm_up_step_over_the_budget_is_refused_at_that_step(budget, message):
    """R1 runs two forward and backward rounds per step; under auto the warm-up traced the
    first, and the step after the second round was not checked: a peak over the budget there
    was stepped and refused one step later (now the second round is traced too, and its
    warm-up's peak refused at the step). A budget error inside the warm-up's backward then
    crashed zero_grad() (its trace's monitor was stopped): the trace is given up instead."""
    BUDGETS["r1_small"] = budget
    (_, _), (model, opt) = _pair("auto-budget", "r1_small")
    before = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    with pytest.raises(DeviceBudgetError, match=message):
        r1(model, _data()[0])
        opt.step()
    opt.zero_grad()
    assert_params_close({k: v.detach() for k, v in model.state_dict().items()}, before, rtol=0, atol=0)
    assert opt._rt.state.name in ("UNTRACED", "PLANNED", "UNPLANNED")
    opt.close()


class _SquaredSum(torch.autograd.Function):
    """``p.pow(2).sum()`` whose backward checks that the saved parameter is the tensor its forward
    read: on a GPU, a parameter pointed at another copy between the two (see [Note: a pass begun
    inside its graph] in gemini/engine/grad_views.py) changed device under autograd."""

    @staticmethod
    def forward(ctx, p):
        ctx.save_for_backward(p)
        ctx.read = (p.device, p.data_ptr())
        return p.pow(2).sum()

    @staticmethod
    def backward(ctx, grad):
        p, = ctx.saved_tensors
        assert (p.device, p.data_ptr()) == ctx.read, f"the penalty read {ctx.read}, its backward {p.data_ptr()}"
        return 2 * grad * p


def _l2(model):
    return 1e-3 * sum(_SquaredSum.apply(p) for p in model.parameters())


def penalty_after(model, batch):
    """The loss's backward, then an L2 penalty over the parameters backpropagated on its own: a
    graph that reaches no module's output (EWC, a regulariser kept apart for logging)."""
    real, _, c, _ = batch
    model(real, c).pow(2).mean().backward()
    _l2(model).backward()


def penalty_between(model, batch):
    """Gradient accumulation with the penalty's backward between two micro-batches."""
    real, fake, c, _ = batch
    model(real, c).pow(2).mean().backward()
    _l2(model).backward()
    model(fake, c).pow(2).mean().backward()


def penalty_first(model, batch):
    """The penalty's backward before the forward (after zero_grad(set_to_none=False): zeros are out)."""
    real, _, c, _ = batch
    _l2(model).backward()
    model(real, c).pow(2).mean().backward()


PENALTIES = {"after": (penalty_after, 2), "between": (penalty_between, 3), "first": (penalty_first, 2)}


@pytest.mark.parametrize("when", list(PENALTIES))
@pytest.mark.parametrize("name", ["cuda", "cpu", "static", "auto"])
def test_a_backward_over_the_parameters_alone_accumulates_like_torch(name, when):
    """A backward reaching the parameters through no module's output began no pass: autograd
    accumulated into the p.grad views the previous backward exposed, the hook copied the slot
    onto itself and the view was then taken for p.grad = None: the gradients were dropped (the
    step after penalty_after changed nothing; penalty_between kept the last micro-batch's only).
    Now each parameter's gradient hook, run before autograd accumulates, begins the pass."""
    loop, passes = PENALTIES[when]
    (ref, ref_opt), (model, opt) = _pair(name)
    data = _data()
    grads = []
    for m, o in ((ref, ref_opt), (model, opt)):
        snapshots = []
        for batch in data:
            o.zero_grad(set_to_none=False)
            loop(m, batch)
            grads.append({n: p.grad.detach().to("cpu", copy=True) for n, p in m.named_parameters()})
            o.step()
            snapshots.append({k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()})
        if m is ref:
            want = snapshots
    for step, (g, w) in enumerate(zip(snapshots, want)):
        assert_params_close(g, w, step=step)
    for step, (g, w) in enumerate(zip(grads[STEPS:], grads[:STEPS])):
        assert_params_close(g, w, step=step)
    assert opt._rt.hooks.backward_passes == STEPS * passes
    opt.close()


@pytest.mark.parametrize("name", ["cuda", "cpu", "static", "auto"])
def test_a_graph_kept_across_a_step_is_refused_as_torch_refuses_it(name):
    """backward(retain_graph=True), step, then the kept graph's backward again: torch refuses (the
    step changed saved weights in place); gemini's step writes the chunks, not through the
    parameters, so their version counters stayed and the second backward mixed old activations with
    new weights. The step now bumps the versions of the parameters it updated. (Torch's error comes
    from its default AdamW: the fused one bumps no version, so it does not refuse.)"""
    (ref, ref_opt), (model, opt) = _pair(name)
    plain = copy.deepcopy(ref)
    data = _data(STEPS + 1)
    real, _, c, _ = data[0]
    errors = []
    for m, o in ((plain, torch.optim.AdamW(plain.parameters(), lr=1e-2)), (model, opt)):
        loss = m(real, c).pow(2).mean()
        loss.backward(retain_graph=True)
        o.step()
        o.zero_grad()
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as e:
            loss.backward()
        errors.append(str(e.value).split(";")[0])
    assert errors[0] == errors[1]
    opt.zero_grad()
    _, want = _train(ref, ref_opt, _plain, data)  # and training goes on as torch's
    _, got = _train(model, opt, _plain, data[1:])
    for step, (g, w) in enumerate(zip(got, want[1:])):
        assert_params_close(g, w, step=step)
    opt.close()
