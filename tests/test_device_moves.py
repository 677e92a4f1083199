"""What a GPU does to the parameters that the CPU stand-in does not, simulated on the CPU.

On a GPU, ``p.data`` of an offloaded parameter moves between the device copy and the host copy
at every fetch and release, and each move across devices drops the AccumulateGrad node the
tensor caches (torch's ``VariableHooks::set_data``): the graph of the forward keeps its node,
``get_gradient_edge(p)`` gives a new one. On the stand-in both copies are on the CPU and the
cache stays. A round trip of ``p.data`` through another dtype between forward and backward drops
it the same way (see [Note: the graph's own gradient accumulators] in
gemini/engine/backward_uses.py). The first CUDA run of the suite failed every test under auto
("optimizer.step() before any backward pass") and exposed no p.grad under cpu and static.
"""

from __future__ import annotations

import pytest
import torch

import gemini
from gemini.tools.gpt import GPT, GPTConfig
from helpers import assert_params_close, batches, clone_pair, placement_configs, train_reference

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=64)
CONFIGS = {**placement_configs(16 * CFG.num_params()), "auto": dict(placement="auto", chunk_size=8192)}


def _drop_cached_accumulators(model) -> None:
    for p in model.parameters():
        data = p.data
        p.data = torch.empty(0, dtype=torch.float64)  # another type: the cache goes, as on a device move
        p.data = data


# auto-evicting's budget is sized for the stand-in's exact counting (tests/test_torch_idioms.py).
@pytest.mark.parametrize("placement", ["cpu", "static", pytest.param("auto-evicting", marks=pytest.mark.standin), "auto"])
def test_a_pass_whose_parameters_moved_between_forward_and_backward_trains_like_torch(placement):
    fields = CONFIGS[placement]
    base, ref = clone_pair(CFG)
    data = batches(CFG, 3, batch=2, seq=16)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    check = clone_pair(CFG)[1].to(data[0][0].device)
    GPT.loss(check(data[0][0]), data[0][1]).backward()
    ref_grads = [p.grad.detach().to("cpu", copy=True) for p in check.parameters()]
    del check
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=data[0][0].device.type, **fields),
                                   lr=1e-2, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        loss = GPT.loss(model(x), y)
        _drop_cached_accumulators(model)
        opt.backward(loss)
        assert opt._rt.hooks.backward_passes == step + 1, "the backward was not taken for the iteration's"
        # The gradients are exposed as torch's (p.grad after backward); not under a budget sized
        # for the stand-in, which counts the comparison's own tensors too.
        if step == 0 and placement != "auto-evicting":
            for p, want_grad in zip(model.parameters(), ref_grads):
                torch.testing.assert_close(p.grad.detach().cpu(), want_grad, rtol=1e-6, atol=1e-7)
        opt.step()
        opt.zero_grad()
        assert_params_close(model.state_dict(), want[step], step=step)
    opt.close()
