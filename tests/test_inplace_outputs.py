"""Module outputs modified in place after the call: the call's backward still fetches its
parameters, and under auto its backward period is announced ([Note: a call's outputs hooked
through in-place ops] in tracer/grad_nodes.py).

A Linear on a 3-D input returns a view; ``nn.ReLU(inplace=True)`` after it, or a residual
``out = self.proj(h); out += h``, made autograd drop the tensor hooks that announced the
Linear's backward, and backward read its released chunk ("setStorage: ... storage of size 0").
Each test trains through gemini and through plain PyTorch (AdamW, fused) and compares the
parameters after every step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemini
from helpers import DEVICE, assert_params_close, step_both
from tracer import Phase

V, D, STEPS = 50, 32, 3
# chunk_size: one Linear's weight per chunk, so that every call's chunk is fetched on its own.
CONFIGS = {
    "cpu": dict(placement="cpu", chunk_size=D * D + D),
    "static": dict(placement="static", chunk_size=D * D + D, static_param_device_fraction=0.0),
    "auto-evicting": dict(placement="auto", chunk_size=D * D + D, device_memory=112_000),
}


class _Pair(nn.Module):
    """A dict of outputs: one consumed and modified in place, one a view of the input, one
    that needs no gradient, one never consumed (a partial backward through the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(D, D)
        self.unused = nn.Linear(D, D)

    def forward(self, x):
        return {"used": self.used(x), "view": x.transpose(0, 1), "const": torch.ones(2),
                "unused": self.unused(x)}


class _InPlaceAfterCalls(nn.Module):
    def __init__(self, slice_in_place: bool) -> None:
        super().__init__()
        self.slice_in_place = slice_in_place
        self.emb = nn.Embedding(V, D)
        self.relu_after = nn.Sequential(nn.Linear(D, D), nn.ReLU(inplace=True))
        self.proj = nn.Linear(D, D)
        self.scaled = nn.Linear(D, D)
        self.pair = _Pair()
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        h = self.emb(idx)  # (B, T, D): every Linear below returns a view
        h = self.relu_after(h)
        out = self.proj(h)
        out += h  # a residual added in place
        s = self.scaled(out)
        s.mul_(0.5)
        if self.slice_in_place:
            # A slice of the output, in place, then the output into the next call: a tensor
            # hook on that input crashed torch (SIGSEGV).
            s[:, 0].add_(1.0)
        d = self.pair(s)
        d["used"].tanh_()
        return self.head(d["used"] + d["view"].transpose(0, 1) * d["const"][0])


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (4, 6), generator=g).to(DEVICE), torch.randint(0, V, (4, 6), generator=g).to(DEVICE))
            for _ in range(STEPS)]


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("slice_in_place", [False, True], ids=["residuals", "slice-in-place"])
@pytest.mark.parametrize("name", ["cpu", "static", pytest.param("auto-evicting", marks=pytest.mark.standin)])
def test_outputs_modified_in_place_train_like_torch(name, slice_in_place):
    torch.manual_seed(0)
    net = _InPlaceAfterCalls(slice_in_place)
    ref = copy.deepcopy(net).to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    gmodel, opt = gemini.initialize(net, gemini.GeminiConfig(device=DEVICE, **CONFIGS[name]), lr=1e-2,
                                    weight_decay=0.1)
    for step, (x, y) in enumerate(_data()):
        step_both(ref, ref_opt, gmodel, opt, _loss, x, y)
        assert_params_close(gmodel.state_dict(), ref.state_dict(), step=step)
    if name == "auto-evicting":
        assert opt._rt.residency.evictions > 0  # the budget made chunks move


class _Residuals(nn.Module):
    """Linears on 3-D inputs (each returns a view) whose outputs get residuals, in place or not."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.emb = nn.Embedding(V, D)
        self.relu_after = nn.Sequential(nn.Linear(D, D), nn.ReLU(inplace=in_place))
        self.proj = nn.Linear(D, D)
        self.mlp = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        h = self.relu_after(self.emb(idx))
        out = self.proj(h)
        if self.in_place:
            out += h
        else:
            out = out + h
        m = self.mlp(out)
        if self.in_place:
            m += out
        else:
            m = m + out
        return self.head(m)


@pytest.mark.standin
def test_outputs_modified_in_place_keep_their_backward_periods_under_auto():
    """auto's period hooks announced each call's backward through hooks on its output tensors,
    dropped by ``out += h`` on a Linear's view: proj's and mlp's backward periods were missing
    from the plan (a coarser plan). In place or not, the same periods, and training as torch."""
    keys = {}
    for in_place in (False, True):
        torch.manual_seed(0)
        net = _Residuals(in_place)
        ref = copy.deepcopy(net)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        gmodel, opt = gemini.initialize(net, gemini.GeminiConfig(device="cpu", **CONFIGS["auto-evicting"]),
                                        lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(_data()):
            step_both(ref, ref_opt, gmodel, opt, _loss, x, y)
            assert_params_close(gmodel.state_dict(), ref.state_dict(), step=step)
        assert opt._rt.residency.evictions > 0
        keys[in_place] = opt._rt.plan.keys
        opt.close()
    assert keys[True] == keys[False]
    backward = [name for phase, name in keys[True] if phase is Phase.BACKWARD]
    assert {"proj", "mlp"} <= set(backward), backward
