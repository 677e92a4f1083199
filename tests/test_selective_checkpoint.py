"""Selective activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=False,
context_fn=partial(create_selective_checkpoint_contexts, policy))``) over blocks with Dropout.

Its dispatch mode numbers every operator of the checkpointed forward and looks each up by the
same number in the recompute; the engine's chunk moves, run by the blocks' module hooks, used
to be numbered too, and under placements that move chunks they differ between the forward and
the recompute (see [Note: moves unseen by dispatch modes] in chunks/storage.py). Each test
trains the same model on plain PyTorch (torch.optim.AdamW, fused) and through gemini, with the
same seed before every forward (Dropout's masks), and compares losses and parameters after
every step (fp32, 1e-6).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import gemini
import zero_workers as zw
from helpers import DEVICE, assert_params_close, tolerance
from multiprocess import run_ranks

STEPS = 3
WIDTH = 64
# fp32 parameters, gradients, m and v of Net: 51,720 parameters.
MODEL_DATA_BYTES = 827_520
CONFIGS = {
    "cuda": dict(placement="cuda"),
    "cpu": dict(placement="cpu"),
    "static": dict(placement="static", static_param_device_fraction=0.5, static_optimizer_offload_fraction=0.5),
    "auto": dict(placement="auto"),
    # Below the model data: optimizer states stay on the host and parameter chunks come and go.
    "auto-budget": dict(placement="auto", device_memory=MODEL_DATA_BYTES // 2),
}
STANDIN = {"auto-budget"}  # a budget in the stand-in's bytes

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def save_matmuls(ctx, op, *args, **kwargs):
    """The usual policy: keep the matrix products' outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def save_all_but_dropout(ctx, op, *args, **kwargs):
    """Keep every output but those Dropout makes in place (its mask, drawn again from the same
    state): the views a chunk move takes of its payload were kept too, and replayed from the
    forward in the recompute instead of taken again."""
    mutated = op._schema.is_mutable or op in (torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format)
    return CheckpointPolicy.PREFER_RECOMPUTE if mutated else CheckpointPolicy.MUST_SAVE


POLICIES = {"save_matmuls": save_matmuls, "save_all_but_dropout": save_all_but_dropout}


class Net(nn.Module):
    def __init__(self, policy) -> None:
        super().__init__()
        self.policy = policy
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH),
                          nn.Dropout(0.1))
            for _ in range(3))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x):
        h = self.inp(x)
        context_fn = functools.partial(create_selective_checkpoint_contexts, self.policy)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=False, context_fn=context_fn)
        return self.head(h)


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g).to(DEVICE), torch.randint(0, 8, (8,), generator=g).to(DEVICE))
            for _ in range(STEPS)]


def _train(model, opt, data, *, gemini_opt: bool):
    """Losses, parameters after each step and (gemini) each step's device peak."""
    losses, snapshots, peaks = [], [], []
    for step, (x, y) in enumerate(data):
        torch.manual_seed(100 + step)  # the same Dropout masks in both
        loss = F.cross_entropy(model(x), y)
        opt.backward(loss) if gemini_opt else loss.backward()
        opt.step()
        if gemini_opt:
            peaks.append(opt.report.device_peak_bytes)
        opt.zero_grad()
        losses.append(loss.item())
        snapshots.append({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
    return losses, snapshots, peaks


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.standin) if n in STANDIN else n for n in CONFIGS])
def test_selective_checkpointing_with_dropout_trains_like_torch(name, policy):
    """Before the fix placements "cpu", "static" and "auto" failed in the first backward
    ("aten.slice.Tensor invocation index 12 encountered during backward but not found in
    storage")."""
    torch.manual_seed(0)
    base = Net(POLICIES[policy])
    assert sum(p.numel() for p in base.parameters()) * 16 == MODEL_DATA_BYTES
    ref = copy.deepcopy(base).to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, chunk_size=8192, **CONFIGS[name]),
                                   lr=1e-2, weight_decay=0.1)
    data = _data()
    want_losses, want, _ = _train(ref, ref_opt, data, gemini_opt=False)
    got_losses, got, peaks = _train(model, opt, data, gemini_opt=True)
    torch.testing.assert_close(got_losses, want_losses, **tolerance(1e-6, 1e-7))
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    if name == "auto-budget":
        assert max(peaks) <= MODEL_DATA_BYTES // 2, peaks  # every step, the recompute's included
    opt.close()


def test_selective_checkpointing_under_zero3_trains_like_torch(tmp_path):
    """2 ZeRO-3 ranks: the recompute gathers each block's parameters again. Before the fix the
    gathers (the collective, the views of the gathered chunk) ran inside SAC's dispatch mode, which
    numbered them: "c10d._allgather_base_.default invocation index 4 ... not found in storage",
    and with every other output saved "Tensor cached during selective activation checkpoint has
    been mutated" (the gathered chunk, freed and filled again)."""
    names = ["checkpoint_save_matmuls", "checkpoint_save_all_but_mutating"]
    run_ranks(zw.run_zoo, names, 3, 512, str(tmp_path), timeout_seconds=240)
    for name in names:
        want, _, _ = zw.train_reference(3, model=zw.make_zoo(name))
        for rank in range(2):
            got = torch.load(tmp_path / f"{name}_rank{rank}.pt", weights_only=True)
            for step, (g, w) in enumerate(zip(got["states"], want, strict=True)):
                assert_params_close(g, w, step=step)
