"""The pure Adam function against torch.optim.AdamW / Adam."""

from __future__ import annotations

import pytest
import torch

from gemini.optim.adam import adam_update


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("fused_reference", [True, False])
def test_adam_update_matches_torch(decoupled, fused_reference):
    torch.manual_seed(0)
    shapes = [(7, 5), (13,), (3, 3, 3)]
    ref = [torch.randn(s, requires_grad=True) for s in shapes]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(ref, lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05, fused=fused_reference or None,
              foreach=None if fused_reference else False)
    # Ours: one flat tensor holding all three, like a chunk.
    flat = torch.cat([p.detach().reshape(-1) for p in ref])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    step = torch.zeros((), dtype=torch.float32)
    for _ in range(6):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        scale = 1024.0
        g_flat = torch.cat([g.reshape(-1) for g in grads]) * scale  # a loss-scaled gradient
        adam_update([flat], [g_flat], [m], [v], [step], lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-7,
                    weight_decay=0.05, decoupled_weight_decay=decoupled,
                    grad_scale=torch.tensor(scale))
        want = torch.cat([p.detach().reshape(-1) for p in ref])
        torch.testing.assert_close(flat, want, rtol=1e-6, atol=1e-7)
    assert step.item() == 6.0
    torch.testing.assert_close(m, torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in ref]), rtol=1e-6, atol=1e-7)
