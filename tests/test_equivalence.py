"""Training through gemini equals plain torch.optim.AdamW, step after step (fp32, 1e-6)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gemini
from gemini.tools.gpt import GPT, GPTConfig
from helpers import DEVICE, TINY, assert_params_close, batches, clone_pair, train_gemini, train_reference

PLACEMENTS = ["cuda", "cpu"]
STEPS = 10


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("chunk_size", [1000, 5000, None])
def test_fp32_training_equals_adamw(placement, chunk_size):
    base, ref = clone_pair()
    data = batches(TINY, STEPS)
    want_losses, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    cfg = gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=chunk_size)
    got_losses, got, _, opt = train_gemini(base, data, cfg, lr=1e-2, weight_decay=0.1)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    assert got_losses == pytest.approx(want_losses, rel=1e-6)
    assert len(opt._rt.manager.groups) >= (2 if chunk_size else 1)


def _two_groups(model: nn.Module):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3},
    ]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_clipping_groups_frozen_and_accumulation(placement):
    base, ref = clone_pair()
    for m in (base, ref):
        for p in m.blocks[0].mlp.parameters():
            p.requires_grad_(False)  # a frozen layer
    data = batches(TINY, 2 * STEPS, batch=2)
    frozen_before = base.blocks[0].mlp.fc.weight.detach().clone()
    want_losses, want, _ = train_reference(
        ref, data, micro_batches=2, clip=0.05, param_groups=_two_groups, lr=1e-2
    )
    cfg = gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=3000, clip_grad_norm=0.05)
    got_losses, got, _, opt = train_gemini(base, data, cfg, micro_batches=2, param_groups=_two_groups, lr=1e-2)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    assert got_losses == pytest.approx(want_losses, rel=1e-6)
    torch.testing.assert_close(got[-1]["blocks.0.mlp.fc.weight"], frozen_before, rtol=0, atol=0)
    # Clipping was active: the unclipped norm exceeded the bound.
    assert opt.report.grad_norm > 0.05


def test_adam_mode_with_l2_decay_equals_torch_adam():
    base, ref = clone_pair()
    ref.to(DEVICE)
    data = batches(TINY, 5)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    gmodel, opt = gemini.initialize(
        base, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=4096),
        lr=1e-2, weight_decay=0.1, adamw_mode=False,
    )
    for x, y in data:
        GPT.loss(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        GPT.loss(gmodel(x), y).backward()  # plain loss.backward() works outside fp16
        opt.step()
        opt.zero_grad()
        assert_params_close(gmodel.state_dict(), ref.state_dict())


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt = GPT(TINY)
        self.unused = nn.Linear(4, 4)  # never called: torch skips it, so must we

    def forward(self, x):
        return self.gpt(x)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_unused_parameters_are_skipped_like_torch(placement):
    torch.manual_seed(0)
    base = _WithUnused()
    ref = copy.deepcopy(base).to(DEVICE)
    data = batches(TINY, 4)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    gmodel, opt = gemini.initialize(
        base, gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=100_000), lr=1e-2, weight_decay=0.1
    )
    for x, y in data:
        GPT.loss(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        assert_params_close(gmodel.state_dict(), ref.state_dict())
    # The unused layer shares a chunk with used ones and still was not touched by weight decay.
    assert len(opt._rt.manager.groups) == 1


class _WithEmpty(nn.Module):
    """Zero-element parameters (an empty bias, a 0-width adapter), first in the layout too."""

    def __init__(self):
        super().__init__()
        self.empty_first = nn.Parameter(torch.zeros(0))
        self.gpt = GPT(TINY)
        self.empty_adapter = nn.Parameter(torch.zeros(0, 32))

    def forward(self, x):
        return self.gpt(x) + self.empty_first.sum() + self.empty_adapter.sum()


@pytest.mark.parametrize("placement", ["cuda", "cpu", "auto"])
def test_zero_element_parameters_train_like_torch(placement):
    torch.manual_seed(0)
    base = _WithEmpty()
    ref = copy.deepcopy(base).to(DEVICE)
    data = batches(TINY, 3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=2000),
                                    lr=1e-2, weight_decay=0.1)
    for x, y in data:
        for model, o in ((ref, opt_ref), (gmodel, opt)):
            GPT.loss(model(x), y).backward()
            o.step()
            o.zero_grad()
        assert_params_close(gmodel.state_dict(), ref.state_dict())
    assert gmodel.state_dict()["empty_adapter"].shape == (0, 32)
    restored = copy.deepcopy(ref)
    restored.load_state_dict(gmodel.state_dict())
    assert set(opt.state_dict()["state"]) == set(opt_ref.state_dict()["state"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_low_precision_tracks_fp32_loss(precision, placement):
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
    base, ref = clone_pair(cfg)
    data = batches(cfg, 1) * 12  # one batch, learned by heart: the loss must fall
    want_losses, _, _ = train_reference(ref, data, lr=3e-3)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement=placement, precision=precision, chunk_size=20_000)
    got_losses, got, gmodel, opt = train_gemini(base, data, gcfg, lr=3e-3)
    # The curves agree to bf16/fp16 resolution and both go down.
    for g, w in zip(got_losses, want_losses):
        assert g == pytest.approx(w, rel=0.02)
    assert got_losses[-1] < got_losses[0] - 0.5
    assert all(v.dtype == torch.float32 for v in got[-1].values())
    assert gmodel.module.wte.weight.dtype == getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[precision])
    if precision == "fp16":
        assert opt.report.loss_scale > 1
    else:
        assert opt.report.loss_scale == 1.0


def test_fp16_without_scaled_backward_is_refused():
    gmodel, opt = gemini.initialize(
        GPT(TINY), gemini.GeminiConfig(device=DEVICE, placement="cpu", precision="fp16", chunk_size=10_000)
    )
    x, y = batches(TINY, 1)[0]
    GPT.loss(gmodel(x), y).backward()
    with pytest.raises(RuntimeError, match="optimizer.backward"):
        opt.step()


def test_fp16_overflow_skips_the_step_and_backs_off():
    gmodel, opt = gemini.initialize(
        GPT(TINY),
        gemini.GeminiConfig(device=DEVICE, placement="cuda", precision="fp16", chunk_size=10_000, hysteresis=1),
    )
    before = {k: v.clone() for k, v in gmodel.state_dict().items()}
    x, y = batches(TINY, 1)[0]
    opt.backward(GPT.loss(gmodel(x), y) * 1e30)  # overflows fp16 gradients
    opt.step()
    assert opt.report.skipped
    assert opt.loss_scale == 2.0**15
    assert_params_close(gmodel.state_dict(), before, rtol=0, atol=0)
    opt.zero_grad()
    opt.backward(GPT.loss(gmodel(x), y))
    opt.step()
    assert not opt.report.skipped
    assert not torch.equal(gmodel.state_dict()["wte.weight"], before["wte.weight"])


class _MLPWithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_buffers_are_updated_like_torch(placement):
    torch.manual_seed(0)
    base = _MLPWithBatchNorm()
    ref = copy.deepcopy(base).to(DEVICE)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=64),
                                    lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        x, y = torch.randn(16, 8, generator=g).to(DEVICE), torch.randn(16, 1, generator=g).to(DEVICE)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        ours, theirs = gmodel.state_dict(), ref.state_dict()
        assert "net.1.running_mean" in ours and int(ours["net.1.num_batches_tracked"]) == int(theirs["net.1.num_batches_tracked"])
        # A bias before BatchNorm, and the running mean that follows it (the batch means include it)
        assert_params_close(ours, theirs, noise=("net.0.bias", "net.1.running_mean"))
