"""The margin tuner: real runs at each ratio, and the fastest ratio within headroom recommended."""

from __future__ import annotations

import pytest

import gemini
from gemini.gpt import GPT
from gemini.tune import MarginTrial, recommend
from helpers import TINY, batches, make_gpt

BUDGET = 2_500_000  # room for TINY's warm-up, and a margin that holds several chunk groups


def _config(**kw) -> gemini.GeminiConfig:
    return gemini.GeminiConfig(device="cpu", placement="auto", chunk_size=3000, device_memory=BUDGET, **kw)


def _loss_fn():
    x, y = batches(TINY, 1)[0]
    return lambda model: GPT.loss(model(x), y)


def test_recommends_the_fastest_ratio_within_headroom_with_injected_timings():
    step_seconds = {0.0: 3.0, 0.5: 1.0, 1.0: 2.0}  # 0.5 fastest, then 1.0
    seen = []

    def measure(ratio, reports):
        seen.append((ratio, [r.step for r in reports]))
        # Real peaks, except that ratio 0.5 is made to break the headroom.
        peak = BUDGET if ratio == 0.5 else max(r.device_peak_bytes for r in reports)
        return gemini.Measurement(step_seconds=step_seconds[ratio], device_peak_bytes=peak)

    tuning = gemini.tune_margin(make_gpt, _loss_fn(), _config(), ratios=[0.0, 0.5, 1.0], steps=2,
                                headroom_fraction=0.1, measure=measure, lr=1e-2)
    assert seen == [(0.0, [0, 1]), (0.5, [0, 1]), (1.0, [0, 1])]  # each trial: a fresh optimizer, 2 steps
    assert [t.step_seconds for t in tuning.trials] == [3.0, 1.0, 2.0]
    assert tuning.limit_bytes == int(0.9 * BUDGET)
    assert tuning.trials[2].device_peak_bytes <= tuning.limit_bytes
    assert tuning.recommended_ratio == 1.0  # 0.5 is faster but over the headroom
    # The ratio really reached the engine: more of the margin, more optimizer states on the device.
    on_device = [t.os_chunks_on_device for t in tuning.trials]
    assert on_device[0] == 0 < on_device[1] <= on_device[2]
    table = tuning.table().splitlines()
    assert len(table) == 4 and table[3].startswith("*  1.00") and "no" in table[2].split()[-1]
    assert "gpu_margin_mem_ratio=1" in tuning.recommendation()


def test_default_measurement_times_the_steps_after_the_warmup():
    tuning = gemini.tune_margin(make_gpt, _loss_fn(), _config(), ratios=[0.0], steps=3, lr=1e-2,
                                headroom_fraction=0.0)
    (trial,) = tuning.trials
    assert trial.step_seconds > 0 and 0 < trial.device_peak_bytes <= BUDGET
    assert tuning.recommended_ratio == 0.0


def _trial(ratio, seconds, peak, error=None):
    return MarginTrial(ratio=ratio, os_chunks_on_device=0, os_chunks_total=4, step_seconds=seconds,
                       device_peak_bytes=peak, error=error)


def test_recommend_skips_failed_and_over_headroom_trials_and_prefers_the_smaller_ratio_on_ties():
    trials = [_trial(0.0, 2.0, 50), _trial(0.25, 1.0, 50), _trial(0.5, 1.0, 40), _trial(0.75, 0.5, 101),
              _trial(1.0, None, None, error="DeviceBudgetError: ...")]
    assert recommend(trials, limit_bytes=100) == 0.25
    assert recommend(trials, limit_bytes=10) is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(config=gemini.GeminiConfig(device="cpu", placement="cpu", device_memory=BUDGET)), "placement"),
    (dict(config=gemini.GeminiConfig(device="cpu", placement="auto")), "device_memory"),
    (dict(steps=1), "steps"),
    (dict(ratios=[0.5, 1.5]), "ratios"),
    (dict(headroom_fraction=1.0), "headroom_fraction"),
])
def test_bad_arguments_name_the_parameter(kwargs, match):
    args = dict(config=_config(), steps=2, ratios=[0.0])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        gemini.tune_margin(make_gpt, _loss_fn(), args.pop("config"), **args)


@pytest.mark.parametrize("field, value", [("step_seconds", -1.0), ("step_seconds", float("nan")),
                                          ("device_peak_bytes", 1.5), ("device_peak_bytes", True)])
def test_measurement_validates_its_fields(field, value):
    values = dict(step_seconds=1.0, device_peak_bytes=10)
    values[field] = value
    with pytest.raises(ValueError, match=f"Measurement.{field}="):
        gemini.Measurement(**values)
