"""The device budget is a promise on every step: exact at the byte, and checked before any update."""

from __future__ import annotations

import pytest
import torch

import gemini
from gemini.gpt import GPT, GPTConfig
from gemini.memory import DeviceBudgetError
from helpers import assert_params_close, batches, clone_pair

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
CHUNK = 8192


def _peak_of_one_step(budget: int | None) -> tuple[int, object]:
    base, _ = clone_pair(CFG)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=CHUNK,
                                                              device_memory=budget), lr=1e-2)
    x, y = batches(CFG, 1, batch=2, seq=16)[0]
    opt.backward(GPT.loss(gmodel(x), y))
    opt.step()
    return opt.report.device_peak_bytes, gmodel


def test_a_peak_exactly_at_the_budget_passes_and_one_byte_over_is_refused():
    peak, _ = _peak_of_one_step(2**40)  # measured (a budget turns the monitor on), never binding
    got, _ = _peak_of_one_step(peak)
    assert got == peak  # the same step, the same bytes: exactly at the budget is within it
    with pytest.raises(DeviceBudgetError, match="1 bytes are missing") as err:
        _peak_of_one_step(peak - 1)
    assert err.value.missing_bytes == 1


def test_every_step_is_checked_before_anything_is_updated():
    """A tensor the caller keeps alive on the device in a later step pushes that step over the
    budget: the step raises before any update, and a retry without it gives the uninterrupted
    result."""
    peak, _ = _peak_of_one_step(2**40)
    budget = peak + 4096
    data = batches(CFG, 3, batch=2, seq=16)

    def run(extra_at: int | None):
        base, _ = clone_pair(CFG)
        gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=CHUNK,
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
