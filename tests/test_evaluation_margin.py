"""auto lends its margin's room to an evaluation forward on larger inputs than training's (see
[Note: an evaluation beside the margin] in gemini/engine/evaluation_room.py)."""

from __future__ import annotations

import gc

import pytest
import torch

import gemini
from chunks import ChunkState, Tier
from gemini.engine.evaluation_room import EvaluationRoom
from gemini.tools.gpt import GPT
from helpers import DEVICE, TINY, assert_params_close, batches, clone_pair, cpu_copy, step_both
from tracer import input_signature

# Budgets in bytes for the stand-in's exact counting. Training batches of 2 x 16 tokens; an
# evaluation batch of 24 x 32 needs about 1.24 MB without the margin's groups, which hold about
# 0.47 MB with gpu_margin_mem_ratio=1: under 1.5 MB it fits only with the margin lent (it was
# refused before), under 2 MB beside the margin too (and every chunk then stays on the device).
LENDS_EACH_TIME, FITS_BESIDE = 1_500_000, 2_000_000


def _loss(model, x, y):
    return GPT.loss(model(x), y)


def _margin_on_device(opt) -> bool:
    placement, groups = opt._rt.placement, opt._rt.manager.groups
    return bool(placement.os_on_device) and not placement.lent and all(
        c.primary_tier is Tier.DEVICE for i in placement.os_on_device for c in groups[i].chunks
        if c.state is not ChunkState.RELEASED)


def _train_and_evaluate(budget: int, *, eval_batch: int, eval_seq: int = 32, steps: int = 3, mode=torch.no_grad):
    """Each step of gemini and of torch's AdamW, then an evaluation forward of both on a batch of
    ``eval_batch`` x ``eval_seq``: parameters, outputs and every peak checked; returns the
    model, the optimizer and the margin's moves (True: lent, False: given back)."""
    base, ref = clone_pair(TINY)
    data = batches(TINY, steps, batch=2, seq=16)
    evaluations = batches(TINY, steps, batch=eval_batch, seq=eval_seq, seed=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    config = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=8192, device_memory=budget,
                                 gpu_margin_mem_ratio=1.0)
    model, opt = gemini.initialize(base, config, lr=1e-2, weight_decay=0.01)
    placement, moves = opt._rt.placement, []
    lend = placement.lend_margin
    placement.lend_margin = lambda lent: (moves.append(lent), lend(lent))[1]
    for step, ((x, y), (inputs, _)) in enumerate(zip(data, evaluations)):
        step_both(ref.to(x.device), ref_opt, model, opt, _loss, x, y)
        assert opt.report.device_peak_bytes <= budget, f"step {step}: {opt.report.device_peak_bytes} > {budget}"
        assert _margin_on_device(opt), f"step {step}: the margin's groups are not all on the device"
        assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()), step=step)
        with mode():
            got, want = model(inputs), ref(inputs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert opt._rt.memory.peak_bytes() <= budget, f"evaluation after step {step}"
        del got, want
    return model, opt, moves


@pytest.mark.standin
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_larger_evaluation_batch_borrows_the_margin_and_training_equals_adamw(mode):
    """Refused before ("this evaluation forward ... needed 1711456 bytes"): the margin's groups go
    to the host for each evaluation and come back for each training forward."""
    _, opt, moves = _train_and_evaluate(LENDS_EACH_TIME, eval_batch=24, mode=mode)
    assert moves == [True, False, True, False, True]
    assert opt._rt.placement.lent  # the last evaluation's: back at the next training forward or step


@pytest.mark.standin
def test_after_an_inference_mode_evaluation_that_borrowed_the_chunks_can_be_written():
    """The margin's groups moved to the host under inference_mode were inference tensors:
    ``zero_grad(set_to_none=False)`` and ``load_state_dict`` then raised "Inplace update to
    inference tensor outside InferenceMode"."""
    model, opt, moves = _train_and_evaluate(LENDS_EACH_TIME, eval_batch=24, steps=1, mode=torch.inference_mode)
    assert moves == [True] and opt._rt.placement.lent
    opt.zero_grad(set_to_none=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    opt.load_state_dict(opt.state_dict())
    x, y = batches(TINY, 1, batch=2, seq=16, seed=3)[0]
    opt.backward(_loss(model, x, y))
    opt.step()
    assert not opt._rt.placement.lent and _margin_on_device(opt)


@pytest.mark.standin
def test_an_evaluation_measured_to_fit_beside_the_margin_borrows_once():
    """Every chunk fits the device during training (no module hooks: [Note: auto settled on the
    device]); the first evaluation on new inputs borrows (with the hooks back for it), its peak
    says the next ones fit beside the margin, so they run with everything on the device."""
    _, opt, moves = _train_and_evaluate(FITS_BESIDE, eval_batch=24)
    assert moves == [True, False]
    assert not opt._rt.placement.follows_modules and not opt._rt.hooks._module_handles


@pytest.mark.standin
def test_an_evaluation_on_inputs_the_trace_covers_moves_nothing():
    *_, moves = _train_and_evaluate(LENDS_EACH_TIME, eval_batch=2, eval_seq=16)
    assert moves == []


@pytest.mark.standin
def test_an_evaluation_before_the_step_that_overran_is_named_by_the_step():
    """Inside an iteration (here between backward and step) nothing is lent: the step refuses,
    and says the peak was the evaluation's and what to do."""
    model, opt, _ = _train_and_evaluate(LENDS_EACH_TIME, eval_batch=2, eval_seq=16, steps=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batches(TINY, 1, batch=2, seq=16, seed=3)[0]
    opt.backward(_loss(model, x, y))
    with torch.no_grad():
        model(batches(TINY, 1, batch=24, seq=32, seed=2)[0][0])
    with pytest.raises(gemini.DeviceBudgetError, match=r"its peak in a forward without gradients run before its step"):
        opt.step()
    assert_params_close(model.state_dict(), before, rtol=0, atol=0)


def test_what_an_evaluation_borrows_is_learnt_per_input_signature():
    traced = input_signature((torch.zeros(2, 16, dtype=torch.long),))
    small, large = (input_signature((torch.zeros(b, s, dtype=torch.long),)) for b, s in ((1, 16), (24, 32)))
    room = EvaluationRoom(capacity=2)
    kw = dict(traced=traced, margin_bytes=400, budget_bytes=1000)
    assert not room.borrows(small, **kw)  # covered by the plan's inputs
    assert room.borrows(large, **kw) and room.borrows(large, **{**kw, "traced": None})
    room.measured(large, 600)  # with the margin lent
    assert not room.borrows(large, **kw) and room.borrows(large, **{**kw, "margin_bytes": 401})
    room.measured(small, None)  # overran beside the margin though covered
    assert room.borrows(small, **kw)
    room.measured(traced, 100)
    room.measured(input_signature((torch.zeros(3, 3),)), 100)  # the capacity: the oldest is forgotten
    assert room.borrows(large, **kw) and not room.borrows(small, **kw)


@pytest.mark.cuda
def test_a_larger_evaluation_batch_borrows_the_margin_on_cuda():
    """On a GPU, the budget's allocator cap stops an evaluation that overruns it: with ratio 1 the
    margin fills what training leaves, and an evaluation batch 128 times training's tokens fits
    only with the margin lent. Sized from a probe on the same GPU (ratio 0, a roomy budget)."""
    import copy

    from gemini.tools.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=256)  # 3.4M parameters
    base, ref = clone_pair(cfg)
    data = batches(cfg, 3, batch=4, seq=32, device="cuda")
    evaluation = batches(cfg, 1, batch=256, seq=64, seed=2, device="cuda")[0][0]
    for _ in range(2):  # the second probe measures what the run will: the CUDA libraries' allocations are made
        probe, probe_opt = gemini.initialize(copy.deepcopy(base), gemini.GeminiConfig(
            device="cuda", placement="auto", chunk_size=2**18, device_memory=2**34), lr=1e-2)
        probe_opt.backward(GPT.loss(probe(data[0][0]), data[0][1]))
        probe_opt.step()
        probe_opt.zero_grad()
        training_peak = probe_opt.report.device_peak_bytes
        with torch.no_grad():
            probe(evaluation)
        evaluation_peak = probe_opt._rt.memory.peak_bytes()
        probe_opt.close()
        del probe, probe_opt
    assert evaluation_peak > training_peak + 16 * cfg.num_params() // 2, (evaluation_peak, training_peak)
    budget = evaluation_peak + 16 * cfg.num_params() // 4  # far less than the margin ratio 1 fills
    # The reference trains first and leaves the GPU: the budget caps the process's allocator, and
    # the reference's model and states beside the engine (54 MB) took the room the evaluation was
    # sized for (the GPU run of 2026-11-27: its forward 46 MB short).
    ref_opt = torch.optim.AdamW(ref.cuda().parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    want_states, want_outputs = [], []
    for x, y in data:
        _loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want_states.append(cpu_copy(ref.state_dict()))
        with torch.no_grad():
            want_outputs.append(ref(evaluation).cpu())
    del ref, ref_opt
    gc.collect()
    torch.cuda.empty_cache()
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device="cuda", placement="auto", chunk_size=2**18,
                                                             device_memory=budget, gpu_margin_mem_ratio=1.0),
                                   lr=1e-2, weight_decay=0.01)
    moves = []
    lend = opt._rt.placement.lend_margin
    opt._rt.placement.lend_margin = lambda lent: (moves.append(lent), lend(lent))[1]
    for step, (x, y) in enumerate(data):
        opt.backward(_loss(model, x, y))
        opt.step()
        opt.zero_grad()
        assert opt.report.device_peak_bytes <= budget
        assert_params_close(model.state_dict(), want_states[step], rtol=1e-5, atol=1e-6, step=step)
        assert _margin_on_device(opt)
        with torch.no_grad():
            got = model(evaluation).cpu()
        torch.testing.assert_close(got, want_outputs[step], rtol=1e-4, atol=1e-5)
        del got
    assert moves[0] is True and opt.report.os_chunks_on_device > 0
