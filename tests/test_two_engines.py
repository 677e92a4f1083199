"""Two engines in one process: a GAN's generator and discriminator, each through gemini.initialize.

Each engine measures the whole device while its iterations run, and the two interleave (the
discriminator's forward inside the generator's step, the generator's forward inside the
discriminator's): the monitors share one dispatch mode on the CPU stand-in ([Note: monitors
sharing one mode] in tracer/accounting_monitor.py), one device peak on CUDA ([Note: one device
peak, several monitors] in tracer/memory_monitor.py) and one allocator cap ([Note: one allocator
cap for several budgets] in gemini/engine/memory.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gemini
from helpers import DEVICE, assert_params_close

STEPS = 5
BATCH = 8


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    discriminator = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return generator, discriminator


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g).to(DEVICE), torch.randn(BATCH, 32, generator=g).to(DEVICE))
            for _ in range(STEPS)]


def _train(generator, discriminator, opt_g, opt_d, backward, after_step) -> None:
    """The usual GAN loop: the discriminator on real and (detached) fake samples, then the
    generator through the discriminator."""
    bce = nn.functional.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(BATCH, 1, device=DEVICE), torch.zeros(BATCH, 1, device=DEVICE)
    for z, real in _data():
        fake = generator(z).detach()
        backward(bce(discriminator(real), ones) + bce(discriminator(fake), zeros), opt_d)
        opt_d.step()
        opt_d.zero_grad()
        backward(bce(discriminator(generator(z)), ones), opt_g)
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()  # the generator's backward reached the discriminator too
        after_step()


@pytest.mark.parametrize("placement, budget", [
    ("cpu", None), ("auto", None),
    pytest.param("cpu", 100_000, marks=pytest.mark.standin),  # byte budgets of the stand-in's counting
    pytest.param("auto", 200_000, marks=pytest.mark.standin),
])
def test_a_gan_of_two_engines_trains_like_torch_within_the_budget(placement, budget):
    """Each step equal to two torch.optim.AdamW; every step's measured peak within each engine's
    budget; under auto both end planned, the generator traced once and the discriminator twice
    (its inputs need a gradient only from the generator's step on: that trace covers the real
    batch's, see [Note: a trace covers smaller inputs])."""
    generator, discriminator = _models()
    ref_g, ref_d = copy.deepcopy(generator).to(DEVICE), copy.deepcopy(discriminator).to(DEVICE)
    want = []
    _train(ref_g, ref_d, torch.optim.AdamW(ref_g.parameters(), lr=1e-3, fused=True),
           torch.optim.AdamW(ref_d.parameters(), lr=1e-3, fused=True), lambda loss, opt: loss.backward(),
           lambda: want.append((copy.deepcopy(ref_g.state_dict()), copy.deepcopy(ref_d.state_dict()))))

    def engine(model):
        config = gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=2048, device_memory=budget)
        return gemini.initialize(model, config, lr=1e-3, weight_decay=0.01)  # torch's AdamW default

    (g_model, g_opt), (d_model, d_opt) = engine(generator), engine(discriminator)
    got, traced = [], {"g": 0, "d": 0}

    def after_step():
        with g_opt._rt.memory.quiet(), d_opt._rt.memory.quiet():  # the test's snapshots are no device memory
            got.append((g_model.state_dict(), d_model.state_dict()))
        for name, opt in (("g", g_opt), ("d", d_opt)):
            traced[name] += opt.report.timeline is not None
            if budget is not None:
                assert opt.report.device_peak_bytes <= budget, (name, len(got), opt.report.device_peak_bytes)

    _train(g_model, d_model, g_opt, d_opt, lambda loss, opt: opt.backward(loss), after_step)
    for step, ((g, d), (want_g, want_d)) in enumerate(zip(got, want, strict=True)):
        assert_params_close(g, want_g, step=step)
        assert_params_close(d, want_d, step=step)
    if placement == "auto":
        assert g_opt._rt.state.name == d_opt._rt.state.name == "PLANNED"
        assert traced == {"g": 1, "d": 2}, traced
