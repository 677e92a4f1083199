"""state_dicts: original keys, torch AdamW's format, and resume == uninterrupted."""

from __future__ import annotations

import copy

import pytest
import torch

import gemini
from gemini.gpt import GPT
from helpers import TINY, assert_params_close, batches, clone_pair, make_gpt, train_reference


def _run(gmodel, opt, data):
    for x, y in data:
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("placement", ["cuda", "cpu"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_save_reload_continue_equals_uninterrupted(placement, precision, tmp_path):
    data = batches(TINY, 8)
    cfg = lambda: gemini.GeminiConfig(device="cpu", placement=placement, precision=precision, chunk_size=3000,
                                      initial_scale=2.0**10, growth_interval=2)
    groups = lambda m: [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                        {"params": [p for p in m.parameters() if p.dim() < 2], "lr": 5e-3}]
    m = make_gpt()
    full_model, full_opt = gemini.initialize(m, cfg(), lr=1e-2, param_groups=groups(m))
    _run(full_model, full_opt, data)

    m = make_gpt()
    first, first_opt = gemini.initialize(m, cfg(), lr=1e-2, param_groups=groups(m))
    _run(first, first_opt, data[:4])
    torch.save({"model": first.state_dict(), "optim": first_opt.state_dict()}, tmp_path / "ckpt.pt")
    del first, first_opt

    ckpt = torch.load(tmp_path / "ckpt.pt")
    fresh = make_gpt(seed=123)  # different initial values: everything must come from the file
    fresh.load_state_dict(ckpt["model"])  # a plain module loads it
    resumed, resumed_opt = gemini.initialize(fresh, cfg(), lr=1e-2, param_groups=groups(fresh))
    resumed_opt.load_state_dict(ckpt["optim"])
    _run(resumed, resumed_opt, data[4:])
    assert_params_close(resumed.state_dict(), full_model.state_dict(), rtol=0, atol=0)
    assert resumed_opt.loss_scale == full_opt.loss_scale
    sd_a, sd_b = resumed_opt.state_dict(), full_opt.state_dict()
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for k in sd_b["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd_a["state"][k][name], sd_b["state"][k][name])


def test_load_into_wrapped_model_after_initialize():
    data = batches(TINY, 2)
    src, src_opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=3000))
    _run(src, src_opt, data)
    dst, _ = gemini.initialize(make_gpt(seed=7), gemini.GeminiConfig(device="cpu", placement="cuda", chunk_size=5000))
    dst.load_state_dict(src.state_dict())
    assert_params_close(dst.state_dict(), src.state_dict(), rtol=0, atol=0)
    x, _ = data[0]
    with torch.no_grad():
        torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="missing keys"):
        dst.load_state_dict({"wte.weight": torch.zeros(256, 32)})


def test_state_dicts_match_plain_pytorch():
    """The model keys/values and the optimizer state equal torch's own after the same training."""
    data = batches(TINY, 4)
    ref = make_gpt()
    _, _, ref_opt = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    gmodel, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=3000),
                                    lr=1e-2, weight_decay=0.1)
    _run(gmodel, opt, data)
    ours, theirs = gmodel.state_dict(), ref.state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in theirs)
    assert_params_close(ours, theirs)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i in ref_sd["state"]:
        assert float(sd["state"][i]["step"]) == float(ref_sd["state"][i]["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][i][name], ref_sd["state"][i][name], rtol=1e-6, atol=1e-9)
    # The plain model loads gemini's state_dict and computes the same thing.
    plain = make_gpt(seed=99)
    plain.load_state_dict(ours)
    x, _ = data[0]
    with torch.no_grad():
        torch.testing.assert_close(plain(x), gmodel(x))


@pytest.mark.parametrize("placement", ["cpu", "cuda"])
def test_load_state_lacking_parameters_resets_them_like_torch(placement):
    """A state_dict without some parameters' entries: torch's AdamW drops those parameters' old
    state (they start again at step 0), so gemini, which had trained them, must too."""
    data = batches(TINY, 5)
    ref, base = clone_pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)  # our arithmetic
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device="cpu", placement=placement, chunk_size=3000),
                                    lr=1e-2, weight_decay=0.1)

    def both_step(x, y):
        GPT.loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _run(gmodel, opt, [(x, y)])

    both_step(*data[0])
    saved = copy.deepcopy(ref_opt.state_dict())  # after 1 step; both optimizers go on to step 3
    n = len(saved["param_groups"][0]["params"])
    missing = {i for i in range(n) if i % 3 == 1}
    for i in missing:
        del saved["state"][i]
    for x, y in data[1:3]:
        both_step(x, y)
    ref_opt.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict(copy.deepcopy(saved))

    def assert_same_state():
        ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        assert sorted(ours) == sorted(theirs)
        for i in theirs:
            assert float(ours[i]["step"]) == float(theirs[i]["step"]), i
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours[i][name], theirs[i][name], rtol=1e-6, atol=1e-9,
                                           msg=lambda m: f"param {i} {name}: {m}")

    assert_same_state()
    assert missing.isdisjoint(opt.state_dict()["state"])  # no stale step / m / v survived the load
    for step, (x, y) in enumerate(data[3:], start=3):
        both_step(x, y)
        assert_params_close(gmodel.state_dict(), ref.state_dict(), rtol=1e-6, atol=1e-7, step=step)
    assert_same_state()
    assert {float(opt.state_dict()["state"][i]["step"]) for i in missing} == {2.0}  # fresh at the load
