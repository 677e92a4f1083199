"""Placement "cuda" never moves a chunk, so no module gets a hook (issue 17): training must still
equal plain AdamW with tied weights, frozen parameters and gradient accumulation."""

from __future__ import annotations

import pytest
import torch

import gemini
from helpers import TINY, assert_params_close, batches, clone_pair, train_gemini, train_reference


def _module_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules() if m is not model)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_cuda_placement_installs_no_module_hooks_and_equals_adamw(micro_batches):
    ref, mine = clone_pair()
    for model in (ref, mine):
        model.blocks[0].mlp.fc.weight.requires_grad_(False)  # frozen
    assert mine.lm_head.weight is mine.wte.weight  # tied
    data = batches(TINY, 6)
    want_losses, want, _ = train_reference(ref, data, micro_batches=micro_batches, lr=1e-2, weight_decay=0.1)
    config = gemini.GeminiConfig(device="cpu", placement="cuda", chunk_size=2000)
    losses, got, gmodel, opt = train_gemini(mine, data, config, micro_batches=micro_batches, lr=1e-2,
                                            weight_decay=0.1)
    assert _module_hooks(mine) == 0  # only the root module's own hooks
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    opt.close()


def test_placements_that_move_chunks_keep_their_module_hooks():
    _, mine = clone_pair()
    gemini.initialize(mine, gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=2000))
    assert _module_hooks(mine) > 0
