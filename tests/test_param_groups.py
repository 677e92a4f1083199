"""optimizer.param_groups after initialize: hyperparameters change as in torch (schedulers
included); the parameters of each group, and flags asking for math gemini's Adam lacks, are
refused with a clear error before anything changes (see [Note: param groups are fixed at
initialize] in gemini/optim/param_groups.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gemini
from gemini.optim.param_groups import UNSUPPORTED_FLAGS
from gemini.tools.gpt import GPT
from helpers import DEVICE, STATE_CUDA_ATOL, TINY, assert_params_close, batches, clone_pair, cpu_copy, tolerance


def _groups(model: nn.Module):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "lr": 3e-3}]


def _gemini(model: nn.Module, placement: str = "cpu"):
    cfg = gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=3000)
    return gemini.initialize(model, cfg, lr=1e-2, param_groups=_groups(model))


def _step(model, opt, batch):
    x, y = batch
    GPT.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _snapshot(gmodel, opt):
    """The parameters and the optimizer state (hyperparameters included), on the CPU."""
    sd = opt.state_dict()
    return gmodel.state_dict(), sd["state"], [{k: v for k, v in g.items()} for g in sd["param_groups"]]


def _assert_unchanged(gmodel, opt, before):
    params, state, groups = _snapshot(gmodel, opt)
    assert_params_close(params, before[0], rtol=0, atol=0)
    assert state.keys() == before[1].keys()
    for i in state:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[i][name], before[1][i][name]), (i, name)
    assert groups == before[2]


@pytest.mark.parametrize("placement", ["cuda", "cpu"])
def test_schedulers_and_resume_drive_hyperparameters_like_torch(placement):
    """OneCycleLR edits lr and betas every step; the groups then carry its keys (initial_lr,
    max_lr, ...), which load_state_dict takes back: both as torch.optim.AdamW does."""
    data = batches(TINY, 6)
    base, ref = clone_pair()
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.0, fused=True)
    gmodel, opt = _gemini(base, placement)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[2e-2, 5e-3], total_steps=len(data))
              for o in (ref_opt, opt)]
    for step, batch in enumerate(data):
        for model, o, sched in ((ref, ref_opt, scheds[0]), (gmodel, opt, scheds[1])):
            _step(model, o, batch)
            sched.step()
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
        assert_params_close(gmodel.state_dict(), ref.state_dict(), step=step)
        if step == 2:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the scheduler's keys load back
    assert len(opt.param_groups) == 2 and "max_lr" in opt.param_groups[0]


def test_groups_with_keys_of_their_own_train_like_torch_and_keep_them():
    """A group's name, a layer-decay recipe's "lr_scale" read by the user's own schedule, and
    torch's flags at their defaults (a group copied from a torch optimizer): torch keeps such keys;
    initialize refused them ("unknown keys") while the same keys set afterwards were kept. See
    [Note: the keys of a param group] in gemini/initialize.py."""
    def groups(model):
        decay, rest = _groups(model)
        return [{**decay, "name": "decay", "lr_scale": 0.5, "amsgrad": False, "foreach": None},
                {**rest, "name": "no_decay", "lr_scale": 1.0, "decoupled_weight_decay": True}]

    data = batches(TINY, 3)
    base, ref = clone_pair()
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.0, fused=True)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=3000),
                                    lr=1e-2, param_groups=groups(base))
    for step, batch in enumerate(data):
        for model, o in ((ref, ref_opt), (gmodel, opt)):
            for g in o.param_groups:  # the user's schedule: a base lr scaled per group
                g["lr"] = 1e-2 * g["lr_scale"] / (step + 1)
            _step(model, o, batch)
        assert_params_close(gmodel.state_dict(), ref.state_dict(), step=step)
    saved = opt.state_dict()["param_groups"]
    assert [g["name"] for g in saved] == ["decay", "no_decay"] and [g["lr_scale"] for g in saved] == [0.5, 1.0]


def test_add_param_group_is_refused():
    gmodel, opt = _gemini(clone_pair()[0])
    data = batches(TINY, 2)
    _step(gmodel, opt, data[0])
    before = _snapshot(gmodel, opt)
    outside = nn.Parameter(torch.ones(4, device=DEVICE))  # e.g. a temperature kept outside the model
    with pytest.raises(ValueError, match=r"add_param_group\(a group of 1 parameter of shapes \[\(4,\)\]\) is not "
                                         r"supported.*gemini.initialize\(model, \.\.\., param_groups="):
        opt.add_param_group({"params": [outside], "lr": 0.1})
    assert len(opt.param_groups) == 2
    _assert_unchanged(gmodel, opt, before)
    _step(gmodel, opt, data[1])  # training goes on


def _remove_first(opt):
    opt.param_groups[0]["params"] = opt.param_groups[0]["params"][1:]


def _append_outside(opt):
    opt.param_groups[0]["params"].append(nn.Parameter(torch.ones(3, device=DEVICE)))


def _reverse(opt):
    opt.param_groups[0]["params"] = opt.param_groups[0]["params"][::-1]


EDITS = {
    "removed (new list)": (_remove_first, r"param_groups\[0\]\['params'\] was changed.*1 parameter removed"),
    "popped (same list)": (lambda o: o.param_groups[1]["params"].pop(), r"param_groups\[1\]\['params'\] was changed"),
    "appended": (_append_outside, r"param_groups\[0\]\['params'\] was changed.*1 parameter added, of shapes \[\(3,\)\]"),
    "reordered": (_reverse, r"param_groups\[0\]\['params'\] was reordered"),
    "group deleted": (lambda o: o.param_groups.pop(0), r"has 1 group, gemini.initialize made 2 \(param_groups\[0\] no"),
    "group added": (lambda o: o.param_groups.append({"params": [], "lr": 1.0}), r"has 3 groups, gemini.initialize made 2"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_changing_a_groups_parameters_is_refused_before_anything_changes(edit):
    do, message = EDITS[edit]
    gmodel, opt = _gemini(clone_pair()[0])
    data = batches(TINY, 3)
    _step(gmodel, opt, data[0])
    saved = [list(g["params"]) for g in opt.param_groups], list(opt.param_groups)
    before = _snapshot(gmodel, opt)
    x, y = data[1]
    GPT.loss(gmodel(x), y).backward()
    do(opt)
    with pytest.raises(ValueError, match=message + r".*only hyperparameters \(lr, betas, eps, weight_decay\)"):
        opt.step()
    opt.param_groups[:] = saved[1]
    for g, params in zip(opt.param_groups, saved[0]):
        g["params"][:] = params
    _assert_unchanged(gmodel, opt, before)
    opt.step()  # put back, the same step goes on
    assert float(opt.state_dict()["state"][0]["step"]) == 2


def test_equal_groups_put_in_place_and_hyperparameter_edits_train_like_torch():
    data = batches(TINY, 3)
    base, ref = clone_pair()
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.0, fused=True)
    gmodel, opt = _gemini(base)
    for step, batch in enumerate(data):
        for model, o in ((ref, ref_opt), (gmodel, opt)):
            _step(model, o, batch)
            o.param_groups[0] = {**o.param_groups[0], "params": list(o.param_groups[0]["params"])}
            o.param_groups[1].update(lr=1e-3 * (step + 1), betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)
        assert_params_close(gmodel.state_dict(), ref.state_dict(), step=step)


@pytest.mark.parametrize("key", UNSUPPORTED_FLAGS)
def test_step_refuses_unsupported_flags_set_by_hand(key):
    gmodel, opt = _gemini(clone_pair()[0])
    data = batches(TINY, 2)
    _step(gmodel, opt, data[0])
    before = _snapshot(gmodel, opt)
    x, y = data[1]
    GPT.loss(gmodel(x), y).backward()
    opt.param_groups[1][key] = True
    with pytest.raises(ValueError, match=rf"optimizer.param_groups\[1\]\['{key}'\] = True is not supported.*"
                                         r"set it back to False"):
        opt.step()
    opt.param_groups[1][key] = False
    _assert_unchanged(gmodel, opt, before)
    opt.step()


def _torch_state(**flags):
    """torch.optim.AdamW's state_dict after 2 steps with ``flags``."""
    model = clone_pair()[1].to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **flags)
    for batch in batches(TINY, 2):
        _step(model, opt, batch)
    return model.state_dict(), opt.state_dict()


@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_a_torch_adam_state_resumes_only_under_its_weight_decay(weight_decay):
    """torch.optim.Adam's groups say decoupled_weight_decay=False (L2): refused by AdamW where
    that changes the math, resumed exactly with adamw_mode=False."""
    model = clone_pair()[1].to(DEVICE)
    ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=weight_decay, fused=True)
    data = batches(TINY, 4)
    for batch in data[:2]:
        _step(model, ref_opt, batch)
    saved = copy.deepcopy(ref_opt.state_dict())

    def resumed(adamw_mode: bool):
        base = clone_pair()[0]
        base.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        return gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="cpu"), adamw_mode=adamw_mode)

    gmodel, opt = resumed(adamw_mode=True)
    if weight_decay:
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['decoupled_weight_decay'\] = False with weight_"
                                             r"decay 0.1 asks for Adam's L2.*initialize with adamw_mode=False"):
            opt.load_state_dict(saved)
        assert opt.state_dict()["state"] == {}
        gmodel, opt = resumed(adamw_mode=False)
    opt.load_state_dict(saved)
    for step, batch in enumerate(data[2:]):
        _step(model, ref_opt, batch)
        _step(gmodel, opt, batch)
        assert_params_close(gmodel.state_dict(), model.state_dict(), step=step)


def test_weight_decay_of_the_other_kind_is_refused_by_step_and_load():
    gmodel, opt = _gemini(clone_pair()[0])
    data = batches(TINY, 2)
    _step(gmodel, opt, data[0])
    adam = gemini.initialize(clone_pair()[0], gemini.GeminiConfig(device=DEVICE, placement="cpu"),
                             weight_decay=0.1, adamw_mode=False)[1]
    saved = opt.state_dict()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['decoupled_weight_decay'\] = True with weight_decay "
                                         r"0.1 asks for AdamW's decoupled weight decay"):
        adam.load_state_dict(saved)
    for group in saved["param_groups"]:  # as states saved before the groups had torch's flag keys
        del group["decoupled_weight_decay"]
    with pytest.raises(ValueError, match=r"param_groups\[0\] \(saved with adamw_mode=True\) with weight_decay "
                                         r"0.1 asks for AdamW's decoupled weight decay"):
        adam.load_state_dict(saved)
    before = _snapshot(gmodel, opt)
    x, y = data[1]
    GPT.loss(gmodel(x), y).backward()
    opt.param_groups[0]["decoupled_weight_decay"] = False
    with pytest.raises(ValueError, match=r"optimizer.param_groups\[0\]\['decoupled_weight_decay'\] = False.*set "
                                         r"it to True or delete it"):
        opt.step()
    opt.param_groups[0]["decoupled_weight_decay"] = True  # as torch.optim.AdamW writes it
    _assert_unchanged(gmodel, opt, before)
    opt.param_groups[1]["decoupled_weight_decay"] = False  # no weight decay: the same math
    opt.step()


@pytest.mark.parametrize("key", ["amsgrad", "maximize"])
def test_loading_a_torch_state_with_unsupported_flags_is_refused(key):
    _, saved = _torch_state(**{key: True})
    gmodel, opt = gemini.initialize(clone_pair()[0], gemini.GeminiConfig(device=DEVICE, placement="cpu"), lr=1e-3)
    _step(gmodel, opt, batches(TINY, 1, seed=5)[0])
    before = _snapshot(gmodel, opt)
    with pytest.raises(ValueError, match=rf"the optimizer state's param_groups\[0\]\['{key}'\] = True is not "
                                         r"supported.*nothing was loaded"):
        opt.load_state_dict(saved)
    _assert_unchanged(gmodel, opt, before)
    sharded = opt.sharded_state_dict()
    sharded["param_groups"][0][key] = True
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['{key}'\] = True"):
        opt.load_sharded_state_dict(sharded)
    _assert_unchanged(gmodel, opt, before)


def test_a_torch_fused_state_with_its_false_flags_resumes_exactly():
    """torch writes amsgrad/maximize/capturable/differentiable False and fused True: all loadable."""
    model_state, saved = _torch_state(fused=True, weight_decay=0.1)
    assert saved["param_groups"][0]["fused"] is True and saved["param_groups"][0]["amsgrad"] is False
    ref = clone_pair()[1].to(DEVICE)
    ref.load_state_dict(model_state)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref_opt.load_state_dict(saved)
    base = clone_pair()[0]
    base.load_state_dict({k: v.cpu() for k, v in model_state.items()})
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="cpu"), lr=1e-3)
    opt.load_state_dict(saved)
    for step, batch in enumerate(batches(TINY, 2, seed=7)):
        _step(ref, ref_opt, batch)
        _step(gmodel, opt, batch)
        assert_params_close(gmodel.state_dict(), ref.state_dict(), rtol=0, atol=0, step=step)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_defaults_and_groups_have_torchs_keys_before_and_after_a_load(adamw_mode):
    """Code reading optimizer.defaults or a group's flags (e.g. ``group["fused"]``,
    ``group["decoupled_weight_decay"]``) finds torch.optim.AdamW's / Adam's keys, also after
    loading a state saved without them, as torch's own __setstate__ puts them back."""
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = ref_cls(clone_pair()[1].parameters(), lr=1e-2)
    gmodel, opt = gemini.initialize(clone_pair()[0], gemini.GeminiConfig(device=DEVICE, placement="cpu"),
                                    lr=1e-2, weight_decay=0.0, adamw_mode=adamw_mode)
    assert opt.defaults.keys() == ref_opt.defaults.keys()
    assert opt.defaults["decoupled_weight_decay"] is adamw_mode
    assert opt.param_groups[0].keys() == ref_opt.param_groups[0].keys()
    _step(gmodel, opt, batches(TINY, 1)[0])
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        for key in ("amsgrad", "fused", "foreach", "decoupled_weight_decay"):
            del group[key]
    opt.load_state_dict(saved)
    ref_opt.load_state_dict(saved)
    assert opt.param_groups[0].keys() == ref_opt.param_groups[0].keys()
    assert opt.param_groups[0]["decoupled_weight_decay"] is adamw_mode
    assert {k: opt.param_groups[0][k] for k in ("amsgrad", "foreach")} == \
        {k: ref_opt.param_groups[0][k] for k in ("amsgrad", "foreach")}
    assert opt.param_groups[0]["fused"] is True  # gemini's update is the fused kernel's: see TORCH_FLAGS


@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_gemini_state_continues_in_a_torch_fused_adamw_bit_for_bit(placement):
    """gemini's optimizer state loaded into torch.optim.AdamW(fused=True) goes on exactly as the
    uninterrupted fused run: its groups said fused=None, which torch's load_state_dict took over
    the optimizer's own True, and the run went on with the foreach kernel (1.3e-4 off after two
    steps, 2.4e-4 after three)."""
    base, ref = clone_pair()
    ref.to(DEVICE)
    data = batches(TINY, 5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement=placement), lr=1e-2,
                                    weight_decay=0.1)
    for batch in data[:2]:
        _step(ref, ref_opt, batch)
        _step(gmodel, opt, batch)
    model = clone_pair()[1].to(DEVICE)
    model.load_state_dict(gmodel.state_dict())
    back = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    back.load_state_dict(opt.state_dict())
    assert all(group["fused"] for group in back.param_groups)
    for step, batch in enumerate(data[2:]):
        _step(ref, ref_opt, batch)
        _step(model, back, batch)
        assert_params_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, step=step)


def test_a_trainable_only_optimizers_state_crosses_both_ways():
    """LoRA recipes build AdamW over the trainable parameters only. gemini added a group of the
    frozen ones to param_groups=[trainable], so neither optimizer loaded the other's state
    ("1 param group(s), this optimizer 2"); now the frozen ones are in no group, as in torch. The
    default (every parameter in one group) says what to give initialize."""
    def frozen_first(model):
        for p in model.wpe.parameters():
            p.requires_grad_(False)
        return model

    base, ref = (frozen_first(m) for m in clone_pair())
    ref.to(DEVICE)
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    ref_opt = torch.optim.AdamW(trainable(ref), lr=1e-2, weight_decay=0.1, fused=True)
    data = batches(TINY, 4)
    for batch in data[:2]:
        _step(ref, ref_opt, batch)
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=3000)
    gmodel, opt = gemini.initialize(base, cfg, lr=1e-2, weight_decay=0.1, param_groups=[{"params": trainable(base)}])
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == trainable(base)
    gmodel.load_state_dict(cpu_copy(ref.state_dict()))
    opt.load_state_dict(ref_opt.state_dict())
    for step, batch in enumerate(data[2:]):
        _step(ref, ref_opt, batch)
        _step(gmodel, opt, batch)
        assert_params_close(gmodel.state_dict(), cpu_copy(ref.state_dict()), step=step)
    back = torch.optim.AdamW(trainable(ref), lr=1e-2, weight_decay=0.1, fused=True)
    back.load_state_dict(opt.state_dict())  # and the other way
    for p in trainable(ref):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(back.state[p][key], ref_opt.state[p][key], **tolerance(1e-6, 1e-9, cuda_atol=STATE_CUDA_ATOL))
    everything = gemini.initialize(frozen_first(clone_pair()[0]), cfg, lr=1e-2)[1]
    with pytest.raises(ValueError, match=r"param group 0: the state has \d+ parameters, this optimizer \d+ \(\d+ of "
                                         r"them train.*param_groups=\[\{'params': \[p for p in model.parameters\(\)"):
        everything.load_state_dict(ref_opt.state_dict())
