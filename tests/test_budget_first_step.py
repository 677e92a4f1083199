"""The first step is the budget's check: it holds on the device whatever every later step holds.

``device_memory`` is a promise that ``initialize`` or the first step keeps or refuses; a budget
that passes the first step and fails the second would end a long run at step 2. So under every
placement that keeps its chunks where it put them (cuda, cpu, static), the first step's measured
peak is at least every later step's (see [Note: what every step keeps is there from the first]
in gemini/engine/residency.py), and a budget just under the later steps' peak is refused at
``initialize`` or the first step, naming the bytes missing. (Under auto the warm-up's step plans
the later ones, which cache chunks in what the budget leaves free: its promise is the plan's,
tested in test_budget_promise.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemini
from gemini.engine.memory import DeviceBudgetError
from helpers import DEVICE, assert_params_close, roomy_budget

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(100, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64),
                         nn.Linear(64, 100))


def _data():
    """One batch, every step: on the CPU stand-in a batch counts from its first use on (the
    monitor cannot see a tensor before an operator does), so distinct batches kept alive would
    add to each later step what a GPU would have held from the start."""
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 100, (4, 32), generator=g).to(DEVICE) for _ in range(2))
    return [(x, y)] * STEPS


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def _config(placement: str, budget, precision: str, offload: bool) -> gemini.GeminiConfig:
    # chunk_size: several groups, so that gradients arrive chunk by chunk in backward.
    return gemini.GeminiConfig(device=DEVICE, placement=placement, precision=precision, device_memory=budget,
                               chunk_size=20000, offload_activations=offload, activation_offload_min_bytes=4096)


def _train(model: nn.Module, config: gemini.GeminiConfig, data):
    """Per step: the measured device peak and the parameters after it."""
    gmodel, opt = gemini.initialize(model, config, lr=1e-2, weight_decay=0.1)
    peaks, states = [], []
    for x, y in data:
        opt.backward(_loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        peaks.append(opt.report.device_peak_bytes)
        states.append(gmodel.state_dict())
    return peaks, states


def _reference(model: nn.Module, data) -> list[dict]:
    model = model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    states = []
    for x, y in data:
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        states.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
    return states


@pytest.mark.parametrize("offload", [False, True], ids=["", "offload_activations"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("placement", ["cuda", "cpu", "static"])
def test_the_first_steps_peak_is_every_later_steps_ceiling(placement, precision, offload):
    """static kept its gradient chunks on the device after the first step (zero_grad keeps the
    storage), so every later forward held them and the first one did not: 1,132,808 bytes at
    the first step, 1,296,684 at every later one. Every placement's first step now holds what
    later ones hold; fp32 training still equals AdamW step by step."""
    base, data = _model(), _data()
    peaks, states = _train(copy.deepcopy(base), _config(placement, roomy_budget("1GiB"), precision, offload), data)
    assert max(peaks[1:]) <= peaks[0], peaks
    if precision == "fp32":
        for step, (got, want) in enumerate(zip(states, _reference(copy.deepcopy(base), data))):
            assert_params_close(got, want, step=step)


@pytest.mark.standin  # budgets at measured peaks, to the byte
@pytest.mark.parametrize("offload", [False, True], ids=["", "offload_activations"])
@pytest.mark.parametrize("placement", ["cuda", "cpu", "static"])
def test_a_budget_under_the_later_steps_peak_is_refused_at_the_first_step(placement, offload):
    """A budget one byte under what the later steps need is refused by ``initialize`` or the
    first step (before any update), one byte missing; never by a later step."""
    base, data = _model(), _data()
    peaks, _ = _train(copy.deepcopy(base), _config(placement, 2**40, "fp32", offload), data)
    needed = max(peaks)
    try:
        gmodel, opt = gemini.initialize(copy.deepcopy(base), _config(placement, needed - 1, "fp32", offload))
    except DeviceBudgetError as err:
        assert err.missing_bytes >= 1
        return
    x, y = data[0]
    with pytest.raises(DeviceBudgetError, match="the first iteration") as err:
        opt.backward(_loss(gmodel(x), y))
        opt.step()
    assert err.value.missing_bytes == 1
    assert opt.reports_made == 0
