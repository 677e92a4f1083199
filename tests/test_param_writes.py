"""Writes into the parameters themselves: in place inside forward (nn.Embedding(max_norm=...)),
in place between steps (``p.mul_``), ``p.data = t`` (vector_to_parameters), and under bf16/fp16.

Training tests run the same loop on plain PyTorch (torch.optim.AdamW, fused) and through gemini
and compare parameters after every step (fp32, 1e-6). See [Note: writes through the parameters]
in chunks/edits.py and [Note: parameters whose .data was assigned] in chunks/manager.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gemini
from gemini.tools.gpt import GPT, GPTConfig
from helpers import DEVICE, assert_params_close, batches, clone_pair, placement_configs

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
MODEL_DATA_BYTES = 16 * CFG.num_params()

CONFIGS = placement_configs(MODEL_DATA_BYTES)  # auto-evicting: see tests/test_torch_idioms.py
NAMES = [pytest.param(n, marks=pytest.mark.standin) if n == "auto-evicting" else n for n in CONFIGS]
STEPS = 3


def _pair(name, *, lr=1e-2, **extra):
    base, ref = clone_pair(CFG)
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1, fused=True)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, **CONFIGS[name], **extra),
                                    lr=lr, weight_decay=0.1)
    return (ref, ref_opt), (gmodel, opt)


def _train(pairs, data, between=lambda model, step: None):
    """The loop on each (model, optimizer), ``between(model, step)`` after each step; the
    parameters after every step, per model."""
    runs = []
    for model, opt in pairs:
        snapshots = []
        for i, (x, y) in enumerate(data):
            GPT.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            between(model, i)
            snapshots.append({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
        runs.append(snapshots)
    return runs


def _assert_same_run(got, want):
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)


@pytest.mark.parametrize("name", NAMES)
def test_in_place_writes_inside_forward_are_kept_like_torch(name):
    """nn.Embedding(max_norm=...) renormalises the rows it reads in place, inside forward: under
    cpu and auto the write landed in the device copy, dropped afterwards as a clean copy."""
    (ref, ref_opt), (gmodel, opt) = _pair(name)
    for model in (ref, gmodel.module):
        model.wte.max_norm = 0.1  # the (tied) rows have norms ~0.16 at init: every row read is renormed
    want, got = _train([(ref, ref_opt), (gmodel, opt)], batches(CFG, STEPS, batch=2, seq=16))
    _assert_same_run(got, want)


@pytest.mark.parametrize("name", NAMES)
def test_in_place_edits_after_an_evaluation_pass_are_kept_like_torch(name):
    """After a no_grad evaluation pass the parameters view the device copies auto keeps; an
    in-place edit there was dropped with them at the next step."""
    (ref, ref_opt), (gmodel, opt) = _pair(name)
    data = batches(CFG, STEPS, batch=2, seq=16)

    def evaluate_then_halve(model, step):
        with torch.no_grad():
            model(data[0][0])
            for p in model.parameters():
                p.mul_(0.5)

    want, got = _train([(ref, ref_opt), (gmodel, opt)], data, evaluate_then_halve)
    _assert_same_run(got, want)


def test_edits_cost_no_traffic_where_nothing_is_edited():
    """The engine's own writes (Adam, gradients, the step's copies) never count as edits: moving
    a model nobody edits moves the same bytes whether or not one edit happened long before."""
    def traffic(edit):
        (_, _), (gmodel, opt) = _pair("cpu")
        moved = []
        for i, (x, y) in enumerate(batches(CFG, 4, batch=2, seq=16)):
            GPT.loss(gmodel(x), y).backward()
            opt.step()
            opt.zero_grad()
            if edit and i == 0:
                with torch.no_grad():
                    gmodel.module.wpe.weight.mul_(0.5)
            moved.append((opt.report.h2d_bytes, opt.report.d2h_bytes))
        return moved

    assert traffic(edit=False) == traffic(edit=True)


@pytest.mark.parametrize("name", NAMES)
def test_assigned_param_data_is_trained_like_torch(name):
    """``p.data = t`` and torch.nn.utils.vector_to_parameters (which does it for every parameter):
    ignored under cpu and auto (the next fetch re-pointed p), and under cuda p trained nothing
    while the step updated a chunk the forward no longer read."""
    (ref, ref_opt), (gmodel, opt) = _pair(name)

    def reassign(model, step):
        if step == 0:
            w = model.wpe.weight
            w.data = torch.full_like(w, 0.05)
        if step == 1:
            params = list(model.parameters())
            if len({p.device for p in params}) > 1:  # on a GPU under static: the README's limitation
                with pytest.raises(TypeError, match="different devices"):
                    torch.nn.utils.parameters_to_vector(params)
                # The README's way round, both ways (vector_to_parameters refuses too, after it has
                # assigned the parameters before the first on the other device: the same values).
                vector = torch.cat([p.detach().to(DEVICE).flatten() for p in params]) * 0.5
                with pytest.raises(TypeError, match="different devices"):
                    torch.nn.utils.vector_to_parameters(vector, params)
                for p, piece in zip(params, vector.split([p.numel() for p in params])):
                    p.data = piece.view_as(p)
            else:
                torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(params) * 0.5, params)

    want, got = _train([(ref, ref_opt), (gmodel, opt)], batches(CFG, STEPS, batch=2, seq=16), reassign)
    _assert_same_run(got, want)


@pytest.mark.parametrize("name", ["cuda", "cpu"])
def test_assigned_param_data_of_another_dtype_or_shape_is_a_clear_error(name):
    base, _ = clone_pair(CFG)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, **CONFIGS[name]), lr=1e-2)
    x, y = batches(CFG, 1, batch=2, seq=16)[0]
    base.wpe.weight.data = torch.zeros(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"wpe\.weight: a tensor of shape \(3,\), dtype torch.float32 .*"
                                         r"shape \(32, 64\), dtype torch.float32"):
        gmodel(x)
    base.double()  # the module given to initialize, cast: the wrapper refuses, the module cannot
    with pytest.raises(ValueError, match=r"dtype torch.float64 .*dtype torch.float32.*\.double\(\)"):
        opt.step()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["cuda", "cpu", pytest.param("auto-evicting", marks=pytest.mark.standin)])
def test_low_precision_edits_reach_the_masters(name, precision):
    """Under bf16/fp16 an in-place edit changed the low-precision parameters only; the next step
    cast the unedited fp32 masters over it. Edited elements take the edit; the others keep their
    masters' fp32 bits. lr=0 isolates that from Adam: the step must change nothing."""
    (_, _), (gmodel, opt) = _pair(name, lr=0.0, precision=precision)
    data = batches(CFG, 2, batch=2, seq=16)
    opt.backward(GPT.loss(gmodel(data[0][0]), data[0][1]))
    opt.step()
    opt.zero_grad()
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    before = gmodel.state_dict()
    module = gmodel.module
    with torch.no_grad():
        module.blocks[0].mlp.fc.weight[:4].mul_(0.5)  # half of some rows: exact in low precision
        nn.init.zeros_(module.wpe.weight)
        module.ln_f.weight.data = torch.full_like(module.ln_f.weight, 2.0)  # an assigned p.data too
    want = dict(before)
    w = before["blocks.0.mlp.fc.weight"].clone()
    w[:4] = torch.where(w[:4].to(low) * 0.5 == w[:4].to(low), w[:4], (w[:4].to(low) * 0.5).float())
    want["blocks.0.mlp.fc.weight"] = w
    want["wpe.weight"] = torch.zeros_like(before["wpe.weight"])
    want["ln_f.weight"] = torch.full_like(before["ln_f.weight"], 2.0)
    for when in ("state_dict after the edit", "after a step"):
        got = gmodel.state_dict()
        for k in want:  # exact: untouched elements keep their masters' fp32 bits
            assert torch.equal(got[k], want[k]), f"{when}: {k} differs by {(got[k] - want[k]).abs().max()}"
        opt.backward(GPT.loss(gmodel(data[1][0]), data[1][1]))
        opt.step()
        opt.zero_grad()
    assert torch.equal(module.wpe.weight.detach().cpu(), torch.zeros_like(module.wpe.weight, device="cpu"))
