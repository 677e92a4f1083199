"""Ctrl-C during optimizer.step(): never half a step ([Note: Ctrl-C during the in-memory update]
in gemini/engine/interrupts.py). A SIGINT during the in-memory update is raised once the step
is complete; one before it is raised at once with the step undone. Either way the run goes on
to plain AdamW's result."""

from __future__ import annotations

import signal
import threading

import pytest
import torch

import gemini
import gemini.optim.adam_batches as adam_batches
from gemini.engine.interrupts import HeldInterrupt
from gemini.tools.gpt import GPT
from helpers import (DEVICE, STATE_CUDA_ATOL, TINY, assert_params_close, batches, clone_pair, cpu_copy, tolerance,
                     train_reference)

LR = 1e-2


def _groups(model):  # decay / no-decay: two fused Adam calls per tier
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def _ctrl_c_at_adam_call(monkeypatch, nth: int) -> None:
    """A real SIGINT (as Ctrl-C sends) during the ``nth`` fused Adam call of the next step."""
    real, calls = adam_batches.adam_update, [0]

    def adam_update(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(adam_batches, "adam_update", adam_update)


def _values(model, opt):
    return model.state_dict(), cpu_copy(opt.state_dict()["state"])


def _assert_adamw(model, opt, ref, ref_opt) -> None:
    assert_params_close(model.state_dict(), {k: v.cpu() for k, v in ref.state_dict().items()})
    state = opt.state_dict()["state"]
    for i, p in enumerate(p for group in ref_opt.param_groups for p in group["params"]):  # torch's numbering
        assert int(state[i]["step"]) == int(ref_opt.state[p]["step"])
        torch.testing.assert_close(state[i]["exp_avg"], ref_opt.state[p]["exp_avg"].cpu(),
                                   **tolerance(1e-6, 1e-9, cuda_atol=STATE_CUDA_ATOL))


@pytest.mark.parametrize("placement, extra", [("cpu", {}), ("static", dict(static_optimizer_offload_fraction=0.5))])
def test_ctrl_c_during_the_in_memory_update_is_raised_once_the_step_is_complete(placement, extra, monkeypatch):
    base, ref = clone_pair()
    data = batches(TINY, 3)
    _, _, ref_opt = train_reference(ref, data, lr=LR, param_groups=_groups)
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=2000,
                                                             **extra), lr=LR, param_groups=_groups(base))
    handler = signal.getsignal(signal.SIGINT)
    for i, (x, y) in enumerate(data):
        opt.backward(GPT.loss(model(x), y))
        if i == 1:
            with monkeypatch.context() as patch:
                _ctrl_c_at_adam_call(patch, 2)  # between the two param groups' calls
                with pytest.raises(KeyboardInterrupt, match="the step was completed"):
                    opt.step()
            steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
            assert steps == {2}, "every group stepped, none twice"
        else:
            opt.step()
        opt.zero_grad()
    assert signal.getsignal(signal.SIGINT) is handler
    _assert_adamw(model, opt, ref, ref_opt)


def _half_on_nvme(tmp_path):
    """(model, optimizer, batches, reference, its AdamW trained on them): half the states on NVMe."""
    base, ref = clone_pair()
    data = batches(TINY, 3)
    _, _, ref_opt = train_reference(ref, data, lr=LR, param_groups=_groups)
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000, nvme_dir=str(tmp_path),
                              nvme_offload_fraction=0.5)
    model, opt = gemini.initialize(base, cfg, lr=LR, param_groups=_groups(base))
    return model, opt, data, ref, ref_opt


def test_ctrl_c_while_nvme_groups_stream_undoes_the_step_at_once(monkeypatch, tmp_path):
    """Phase 2 can be undone: a SIGINT there raises at once, nothing changed; the retry equals AdamW."""
    model, opt, data, ref, ref_opt = _half_on_nvme(tmp_path)
    for i, (x, y) in enumerate(data):
        opt.backward(GPT.loss(model(x), y))
        if i == 1:
            before = _values(model, opt)
            with monkeypatch.context() as patch:
                _ctrl_c_at_adam_call(patch, 1)  # the first streamed group's update
                with pytest.raises(KeyboardInterrupt) as caught:
                    opt.step()
            assert "completed" not in str(caught.value)
            after = _values(model, opt)
            assert all(torch.equal(after[0][k], v) for k, v in before[0].items())
            assert {int(s["step"]) for s in after[1].values()} == {1}
        opt.step()
        opt.zero_grad()
    _assert_adamw(model, opt, ref, ref_opt)
    opt.close()


def test_a_second_ctrl_c_while_the_failed_step_is_undone_waits_for_the_undo(monkeypatch, tmp_path):
    """Ctrl-C twice: the first while NVMe groups stream fails the step, the second lands in its
    undo. It was raised there, half-way: the groups not yet restored kept the failed step's
    values, and the retry trained on them. Now the undo ends first ([Note: Ctrl-C during an
    undo] in gemini/engine/interrupts.py): the KeyboardInterrupt says so, nothing changed, and
    the retry equals AdamW."""
    import gemini.engine.transaction as transaction

    model, opt, data, ref, ref_opt = _half_on_nvme(tmp_path)
    handler = signal.getsignal(signal.SIGINT)
    write_back, restored = transaction.StepTransaction._write_back, []

    def second_ctrl_c(self, saved, values):
        if not restored:
            signal.raise_signal(signal.SIGINT)
        restored.append(saved)
        return write_back(self, saved, values)

    for i, (x, y) in enumerate(data):
        opt.backward(GPT.loss(model(x), y))
        if i == 1:
            before = _values(model, opt)
            with monkeypatch.context() as patch:
                _ctrl_c_at_adam_call(patch, 3)  # the third streamed update: two groups to restore
                patch.setattr(transaction.StepTransaction, "_write_back", second_ctrl_c)
                with pytest.raises(KeyboardInterrupt, match="the undo was completed first"):
                    opt.step()
            after = _values(model, opt)
            assert all(torch.equal(after[0][k], v) for k, v in before[0].items())
            assert all(torch.equal(after[1][i][k], v[k]) for i, v in before[1].items() for k in v)
            assert len(restored) > 1  # the Ctrl-C came with copies still to restore
            assert signal.getsignal(signal.SIGINT) is handler
        opt.step()
        opt.zero_grad()
    _assert_adamw(model, opt, ref, ref_opt)
    opt.close()


def test_held_interrupt_is_a_no_op_off_the_main_thread_and_restores_the_handler():
    handler = signal.getsignal(signal.SIGINT)
    seen = []

    def off_main():
        held = HeldInterrupt()
        held.hold()
        seen.append(signal.getsignal(signal.SIGINT))
        held.release()

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join()
    assert seen == [handler]
    held = HeldInterrupt()
    held.hold()
    assert signal.getsignal(signal.SIGINT) is not handler
    held.release()  # nothing received: nothing raised
    assert signal.getsignal(signal.SIGINT) is handler
