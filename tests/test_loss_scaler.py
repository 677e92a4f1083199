from __future__ import annotations

from gemini import DynamicLossScaler


def test_overflow_backs_off_after_hysteresis():
    s = DynamicLossScaler(initial_scale=1024.0, hysteresis=2, growth_interval=100)
    s.update(overflow=True)
    assert s.scale == 1024.0  # the first overflow is tolerated (its step is still skipped)
    s.update(overflow=True)
    assert s.scale == 512.0
    s.update(overflow=True)  # the allowance is spent until the next growth
    assert s.scale == 256.0


def test_growth_after_interval_and_reset_by_overflow():
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=3, hysteresis=1)
    s.update(False)
    s.update(False)
    s.update(True)  # resets the run of good steps, backs off (hysteresis 1)
    assert s.scale == 4.0
    for _ in range(2):
        s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0


def test_growth_restores_hysteresis():
    s = DynamicLossScaler(initial_scale=64.0, growth_interval=1, hysteresis=2)
    s.update(True)
    s.update(False)  # growth: 128, allowance back to 2
    assert s.scale == 128.0
    s.update(True)
    assert s.scale == 128.0


def test_bounds():
    s = DynamicLossScaler(initial_scale=4.0, min_scale=2.0, max_scale=8.0, growth_interval=1, hysteresis=1)
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0
    for _ in range(5):
        s.update(False)
    assert s.scale == 8.0


def test_state_round_trip():
    s = DynamicLossScaler(initial_scale=64.0, growth_interval=5, hysteresis=3)
    s.update(True)
    s.update(False)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    for over in (False, True, True, False):
        s.update(over)
        t.update(over)
        assert s.scale == t.scale and s.state_dict() == t.state_dict()


def test_steps_without_gradients_leave_the_engines_scale_alone():
    """``step()`` before any backward, after an evaluation, or after a NaN guard skipped the
    backward is a no-op (docs/api.md): under fp16 each counted as a good step, so a NaN guard's
    skipped steps grew the scale (4096 to 8192 after two)."""
    import torch

    import gemini
    from gemini.tools.gpt import GPT
    from helpers import DEVICE, TINY, batches, make_gpt

    model, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(
        device=DEVICE, placement="cpu", precision="fp16", initial_scale=4096.0, growth_interval=2), lr=1e-2)
    (x, y), = batches(TINY, 1)
    opt.step()
    opt.step()  # before any forward
    with torch.no_grad():
        model(x)  # an evaluation
    opt.step()
    GPT.loss(model(x), y)  # a backward a NaN guard skipped
    opt.step()
    opt.zero_grad()
    assert opt.loss_scale == 4096.0 and opt.scaler.state_dict()["good_steps"] == 0
    for _ in range(2):  # two good steps grow it, as before
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
    assert opt.loss_scale == 8192.0
