"""torch.distributed.checkpoint.state_dict's helpers (``get_state_dict`` / ``set_state_dict``
and their model / optimizer halves) on gemini's model and optimizer, against the same calls on
plain torch: in one process, without a process group, as single-GPU scripts written for DCP call
them.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

import gemini
from gemini.tools.gpt import GPT, GPTConfig
from helpers import DEVICE, assert_params_close, batches, clone_pair, cpu_copy, placement_configs

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
CONFIGS = placement_configs(16 * CFG.num_params())


def _train(model, opt, data) -> None:
    for x, y in data:
        GPT.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _torch(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def _gemini(model, name):
    return gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, **CONFIGS[name]), lr=1e-2, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own warnings (no process group, deprecated options)
        yield


@pytest.mark.parametrize("name", ["cpu", pytest.param("auto-evicting", marks=pytest.mark.standin)])
def test_get_state_dict_leaves_a_trained_optimizer_as_it_was(name):
    """get_state_dict initialises an optimizer whose ``state`` is false with a step on zero
    gradients: gemini's (its states in chunks, ``state`` empty) was stepped once more (step 4 ->
    5, m and v decayed) and the run went 5% off torch's."""
    data = batches(CFG, 6, batch=2, seq=16)
    base, ref = clone_pair(CFG)
    ref.to(DEVICE)
    ref_opt = _torch(ref)
    model, opt = _gemini(base, name)
    _train(ref, ref_opt, data[:3])
    _train(model, opt, data[:3])
    before = opt.state_dict()
    assert opt.state  # true, as a trained torch optimizer's state is
    _, saved = get_state_dict(model, opt)
    _, ref_saved = get_state_dict(ref, ref_opt)
    after = opt.state_dict()
    for i, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["state"][i][key], value), (i, key)
    assert saved["state"].keys() == ref_saved["state"].keys()  # keyed by the same names
    for key, entry in ref_saved["state"].items():
        assert float(saved["state"][key]["step"]) == float(entry["step"]) == 3.0
    _train(ref, ref_opt, data[3:])
    _train(model, opt, data[3:])
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()))


@pytest.mark.parametrize("name", ["cpu", pytest.param("auto-evicting", marks=pytest.mark.standin)])
def test_set_state_dict_from_torch_into_gemini_resumes_like_torch(name):
    """A plain run's get_state_dict loaded by set_state_dict into gemini's model and optimizer
    (it looked for "module.<name>" and failed, or with strict=False loaded nothing), then both
    trained on: as torch's own set_state_dict into a fresh AdamW."""
    data = batches(CFG, 6, batch=2, seq=16)
    base, ref = clone_pair(CFG)
    ref.to(DEVICE)
    ref_opt = _torch(ref)
    _train(ref, ref_opt, data[:3])
    model_sd, optim_sd = (copy.deepcopy(sd) for sd in get_state_dict(ref, ref_opt))
    model, opt = _gemini(base, name)  # its own initial values, overwritten by the load
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=copy.deepcopy(optim_sd))
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()), rtol=0, atol=0)
    assert {float(s["step"]) for s in opt.state_dict()["state"].values()} == {3.0}
    _train(ref, ref_opt, data[3:])
    _train(model, opt, data[3:])
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()))

    # The optimizer half alone, non-strict, into another fresh gemini optimizer: every state loads.
    other, other_opt = _gemini(clone_pair(CFG)[0], name)
    set_optimizer_state_dict(other, other_opt, copy.deepcopy(optim_sd), options=StateDictOptions(strict=False))
    assert len(other_opt.state_dict()["state"]) == len(optim_sd["state"])


def test_a_fresh_optimizer_is_initialised_as_torchs_is():
    """Before any step both optimizers are false, and get_optimizer_state_dict initialises both
    the same way (a step on zero gradients at lr 0: step 1, m and v zero, parameters unchanged)."""
    base, ref = clone_pair(CFG)
    ref.to(DEVICE)
    ref_opt = _torch(ref)
    model, opt = _gemini(base, "cpu")
    assert not opt.state and not ref_opt.state
    saved, ref_saved = get_optimizer_state_dict(model, opt), get_optimizer_state_dict(ref, ref_opt)
    assert saved["state"].keys() == ref_saved["state"].keys()
    for key, entry in ref_saved["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(saved["state"][key][name].cpu().float(), value.cpu().float(), rtol=0, atol=0)
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()), rtol=0, atol=0)
