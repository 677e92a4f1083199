"""Under auto, inputs that take turns and do not cover each other (a multi-task model called with
the task's name, micro-batches of one step that differ so, batches cut to a token budget) are
traced once each and come back to their own plans ([Note: plans kept per input signature] in
tracer/signature.py); they were traced at every turn, each such iteration a warm-up."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import gemini
from gemini.engine.iteration_state import IterationState
from helpers import DEVICE, assert_params_close, roomy_budget

STANDIN = pytest.mark.standin  # budgets in bytes of the CPU stand-in (see tests/test_auto.py)
STEPS = 6


class TwoTasks(torch.nn.Module):
    """A shared trunk and a head per task, of different sizes: each task's iteration has its own
    periods and activations, so its own plan."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(64, 128)
        self.a = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        self.b = torch.nn.Linear(128, 64)

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return getattr(self, task)(torch.relu(self.trunk(x)))


def _schedule(accumulate: bool) -> list[list[tuple[int, str]]]:
    """Per step, its micro-batches as (rows, task): one task per step in turn, or both in each step."""
    if accumulate:
        return [[(32, "a"), (32, "b")] for _ in range(STEPS)]
    return [[(32, "a" if step % 2 == 0 else "b")] for step in range(STEPS)]


def _inputs(schedule, *, token_budget: bool):
    """Per step, its micro-batches as (input, task), made as they are asked for (inputs the
    loop keeps alive are device memory to the stand-in's monitor, as a GPU's would be); with
    ``token_budget`` 32 x 1 rows or 16 x 2 in turn (neither shape covers the other)."""
    g = torch.Generator().manual_seed(1)
    for step, micro in enumerate(schedule):
        shape = lambda rows: ((16, 2, 64) if step % 2 else (32, 1, 64)) if token_budget else (rows, 64)
        yield [(torch.randn(*shape(rows), generator=g).to(DEVICE), task) for rows, task in micro]


def _train(config: gemini.GeminiConfig, schedule, *, token_budget: bool = False):
    """Per step: gemini's parameters, its report and the engine's state after each micro-batch's
    forward; and plain fused AdamW's parameters (trained first: the stand-in's monitor counts
    every CPU tensor in an iteration's window)."""
    torch.manual_seed(0)
    base = TwoTasks()
    ref = copy.deepcopy(base).to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    want = []
    for micro in _inputs(schedule, token_budget=token_budget):
        for x, task in micro:
            ref(x, task).square().mean().div(len(micro)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append({k: v.detach().cpu().clone() for k, v in ref.state_dict().items()})
    del ref, ref_opt
    model, opt = gemini.initialize(base, config, lr=1e-2, weight_decay=0.1)
    got, reports, states = [], [], []
    for micro in _inputs(schedule, token_budget=token_budget):
        for x, task in micro:
            out = model(x, task)
            states.append(opt._rt.state)
            opt.backward(out.square().mean().div(len(micro)))
        del micro, x, out
        opt.step()
        opt.zero_grad()
        got.append({k: v.cpu() for k, v in model.state_dict().items()})
        reports.append(opt.report)
    opt.close()
    return got, want, reports, states


def _config(budget, **kwargs) -> gemini.GeminiConfig:
    return gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=16384, device_memory=budget, **kwargs)


def _check(got, want, reports, budget):
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_params_close(g, w, step=step)
    if isinstance(budget, int):
        assert all(r.device_peak_bytes <= budget for r in reports), [r.device_peak_bytes for r in reports]


@pytest.mark.parametrize("accumulate", [False, True], ids=["task-per-step", "tasks-per-step"])
def test_tasks_that_take_turns_are_traced_once_each(accumulate):
    """Each task's inputs are traced once; from then on every forward runs on its task's plan (no
    warm-up in any later step's report); training equals AdamW."""
    budget = roomy_budget(800_000)
    got, want, reports, states = _train(_config(budget), _schedule(accumulate))
    _check(got, want, reports, budget)
    traced = [s is IterationState.TRACING for s in states]
    assert sum(traced) == 2 and traced[0] and traced[1], states  # a's first forward, then b's
    assert [r.timeline is not None for r in reports][2:] == [False] * (STEPS - 2)


@STANDIN
@pytest.mark.parametrize("accumulate", [False, True], ids=["task-per-step", "tasks-per-step"])
def test_plans_that_evict_are_switched_within_the_budget(accumulate, caplog):
    """Under a budget that evicts (parameters and gradients do not fit beside the peaks), the
    kept plans differ; switching between them keeps every step under the budget, follows each
    task's traced periods (no divergence from the plan), equals AdamW, and once both are traced
    each step of a task moves what that task's first planned step moved."""
    budget = 600_000
    with caplog.at_level(logging.WARNING, logger="gemini"):
        got, want, reports, states = _train(_config(budget), _schedule(accumulate))
    assert not [r for r in caplog.records if "diverged" in r.getMessage()]
    _check(got, want, reports, budget)
    assert [s is IterationState.TRACING for s in states].count(True) == 2
    period = 1 if accumulate else 2
    for step in range(2 + period, STEPS):
        same = reports[step - period]
        assert (reports[step].h2d_bytes, reports[step].d2h_bytes) == (same.h2d_bytes, same.d2h_bytes), step


@STANDIN
def test_batches_cut_to_a_token_budget_are_traced_once_per_shape():
    """32 x 1 and 16 x 2 rows in turn: neither covers the other; each shape is traced once."""
    budget = 800_000
    got, want, reports, states = _train(_config(budget), _schedule(False), token_budget=True)
    _check(got, want, reports, budget)
    assert [s is IterationState.TRACING for s in states] == [True, True] + [False] * (STEPS - 2)


def test_a_kept_plan_brings_back_its_saved_activations_plan():
    """With activation offload, each task's plan carries its own saved tensors' sizes: switching
    back follows them (every saved tensor of the iteration matched, none offloaded for want of a
    trace), and training equals AdamW."""
    budget = roomy_budget(800_000)
    config = _config(budget, offload_activations=True, activation_offload_min_bytes=1024)
    torch.manual_seed(0)
    model, opt = gemini.initialize(TwoTasks(), config, lr=1e-2)
    sizes = {}
    for step in range(4):
        task = "a" if step % 2 == 0 else "b"
        opt.backward(model(torch.randn(32, 64, device=DEVICE), task).square().mean())
        following = opt._rt.activations._following
        opt.step()
        opt.zero_grad()
        plan = opt._rt.plan
        assert opt._rt.activations.traced_sizes == plan.saved_sizes
        sizes.setdefault(task, plan.saved_sizes)
        assert plan.saved_sizes == sizes[task], step
        assert following or step < 2, step  # the iteration matched its plan's trace to the end
    assert sizes["a"] != sizes["b"]
    opt.close()


class Unrolled(torch.nn.Module):
    """A GRU cell unrolled over the input's length: each parameter of the cell gets its gradient
    once, after its last use in backward (the first time step's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(16, 64)
        self.cell = torch.nn.GRUCell(64, 64)
        self.l2, self.l3, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 64, device=x.device)
        for t in range(x.shape[1]):
            h = self.cell(self.emb(x[:, t]), h)
        return self.head(self.l3(self.l2(h)))


def _unrolled_inputs(lengths):
    g = torch.Generator().manual_seed(1)
    for length in lengths:
        yield (torch.randn(8, length, 16, generator=g).to(DEVICE), torch.randint(0, 4, (8,), generator=g).to(DEVICE))


@STANDIN
@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_shorter_inputs_follow_the_longest_ones_plan(ratio, caplog):
    """Unrolled 6 steps first, then 3, 2, 5, 1, 6, 4: the shorter inputs run on the plan traced over
    6 (it covers them), skipping traced periods, and their gradients land in a cell backward
    that had no marks in the trace. Each continues at the next traced period of the same module
    ([Note: an iteration that skips traced periods] in gemini/policies/plan.py): no step leaves
    the plan, every step stays under the budget and equals AdamW. Before, each left the plan at
    its head; at ratio 1 (the margin's groups fill what the plan leaves) the first shorter input
    raised DeviceBudgetError (22,280 bytes missing) under the budget the longest trained in."""
    lengths = [6, 3, 2, 5, 1, 6, 4]
    loss = torch.nn.functional.cross_entropy
    torch.manual_seed(0)
    base = Unrolled()
    budget = 16 * sum(p.numel() for p in base.parameters())  # fp32 params, grads, m, v: 554,048 bytes
    ref = copy.deepcopy(base).to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    want = []
    for x, y in _unrolled_inputs(lengths):
        loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append({k: v.detach().cpu().clone() for k, v in ref.state_dict().items()})
    del ref, ref_opt
    config = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=4096, device_memory=budget,
                                 gpu_margin_mem_ratio=ratio)
    model, opt = gemini.initialize(base, config, lr=1e-2, weight_decay=0.1)
    got, reports, states = [], [], []
    with caplog.at_level(logging.WARNING, logger="gemini"):
        for x, y in _unrolled_inputs(lengths):
            out = model(x)
            states.append(opt._rt.state)
            opt.backward(loss(out, y))
            del x, y, out
            opt.step()
            opt.zero_grad()
            got.append({k: v.cpu() for k, v in model.state_dict().items()})
            reports.append(opt.report)
    opt.close()
    assert not [r for r in caplog.records if "diverged" in r.getMessage()]
    _check(got, want, reports, budget)
    assert [s is IterationState.TRACING for s in states] == [True] + [False] * (len(lengths) - 1)
    if ratio:
        assert all(r.os_chunks_on_device > 0 for r in reports[1:])  # the margin holds optimizer states
