"""The engine holds no memory it should not: nothing accumulates per iteration, and an engine
is freed with its model and optimizer."""

from __future__ import annotations

import gc
import weakref

import pytest

import gemini
from gemini.tools.gpt import GPT
from gemini.engine.hooks import _BackwardUse
from helpers import DEVICE, TINY, batches, make_gpt, roomy_budget


def _live_backward_uses() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, _BackwardUse))


@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_no_hook_state_accumulates_over_iterations(placement):
    model, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=2000,
                                                                   device_memory=roomy_budget("4MiB")), lr=1e-2)
    (x, y), = batches(TINY, 1)
    counts = []
    for n in (2, 20):
        for _ in range(n):
            opt.backward(GPT.loss(model(x), y))
            opt.step()
            opt.zero_grad()
        counts.append(_live_backward_uses())
    # Before the fix each module call's graph lived on (about 30 closures an iteration).
    assert counts[1] == counts[0], counts
    opt.close()


@pytest.mark.parametrize("close", [True, False])
@pytest.mark.parametrize("placement", ["cuda", "cpu", "auto"])
def test_an_engine_is_freed_with_its_model_and_optimizer(placement, close):
    """Dropped, closed or not, the engine and its chunks go (its parameter hooks hold it weakly)."""
    def run():
        config = gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=2000,
                                     device_memory=roomy_budget("4MiB"))
        model, opt = gemini.initialize(make_gpt(), config, lr=1e-2)
        for x, y in batches(TINY, 2):
            opt.backward(GPT.loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if close:
            opt.close()
        return weakref.ref(opt._rt), weakref.ref(opt._rt.manager)

    runtime, manager = run()
    gc.collect()
    assert runtime() is None and manager() is None
