"""Training loops shared by the integration tests: the same model and data, two optimizers."""

from __future__ import annotations

import copy

import torch

import gemini
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch

TINY = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


def make_gpt(cfg: GPTConfig = TINY, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batches(cfg: GPTConfig, n: int, *, batch: int = 4, seq: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [synthetic_batch(cfg, batch, seq, generator=g) for _ in range(n)]


def train_reference(model, data, *, micro_batches: int = 1, clip: float = 0.0, param_groups=None, **adamw):
    """Plain PyTorch: AdamW over the model's parameters. Returns (losses, params per step)."""
    groups = param_groups(model) if param_groups else model.parameters()
    opt = torch.optim.AdamW(groups, fused=True, **adamw)
    losses, snapshots = [], []
    for i in range(0, len(data), micro_batches):
        total = 0.0
        for x, y in data[i : i + micro_batches]:
            loss = GPT.loss(model(x), y) / micro_batches
            loss.backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, snapshots, opt


def train_gemini(model, data, config: gemini.GeminiConfig, *, micro_batches: int = 1, param_groups=None, **adamw):
    """The same loop through gemini.initialize. Returns (losses, params per step, model, optimizer)."""
    groups = param_groups(model) if param_groups else None
    gmodel, opt = gemini.initialize(model, config, param_groups=groups, **adamw)
    losses, snapshots = [], []
    for i in range(0, len(data), micro_batches):
        total = 0.0
        for x, y in data[i : i + micro_batches]:
            loss = GPT.loss(gmodel(x), y) / micro_batches
            opt.backward(loss)
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
        snapshots.append(gmodel.state_dict())
    return losses, snapshots, gmodel, opt


def assert_params_close(got: dict, want: dict, *, rtol: float = 1e-6, atol: float = 1e-7, step: int | None = None):
    assert got.keys() == want.keys(), f"keys differ: {set(got) ^ set(want)}"
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"step {step}, {k}: {m}")


def clone_pair(cfg: GPTConfig = TINY, seed: int = 0):
    base = make_gpt(cfg, seed)
    return base, copy.deepcopy(base)
