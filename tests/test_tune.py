"""The margin tuner: real runs at each ratio, headroom judged on the memory a step needs, and the
fastest ratio within noise (then the least device memory) recommended."""

from __future__ import annotations

import itertools

import pytest

import gemini
from gemini.tools.cli import main
from gemini.tools.gpt import GPT
from gemini.tools.tune import MarginTrial, RatioResult, recommend, summarize, tied_fastest
from helpers import TINY, batches, make_gpt

BUDGET = 2_500_000  # room for TINY's warm-up, and a margin that holds several chunk groups


def _config(**kw) -> gemini.GeminiConfig:
    return gemini.GeminiConfig(**{"device": "cpu", "placement": "auto", "chunk_size": 3000, "device_memory": BUDGET,
                                  **kw})


def _loss_fn():
    x, y = batches(TINY, 1, device="cpu")[0]  # the tuner's runs: on the CPU stand-in (BUDGET is sized for it)
    return lambda model: GPT.loss(model(x), y)


def test_rounds_interleave_the_ratios_in_rotated_order_and_the_engine_says_what_each_needs():
    seconds = {0.0: [3.0, 3.1], 0.5: [1.0, 1.1], 1.0: [2.0, 2.1]}  # 0.5 fastest, then 1.0, apart
    seen = []

    def measure(ratio, reports):
        seen.append((ratio, [r.step for r in reports]))
        # Ratio 0.5 is made to need the whole budget (over the headroom); the others keep the
        # engine's own figure, and a measured peak at the budget (as auto's cache makes it).
        return gemini.Measurement(step_seconds=seconds[ratio].pop(0), device_peak_bytes=BUDGET,
                                  needed_bytes=BUDGET if ratio == 0.5 else None)

    tuning = gemini.tune_margin(make_gpt, _loss_fn(), _config(), ratios=[0.0, 0.5, 1.0], steps=2, rounds=2,
                                headroom_fraction=0.1, measure=measure, isolate=False, lr=1e-2)
    # Round 1 in the given order, round 2 rotated by one; each trial a fresh engine, 2 steps.
    assert [r for r, _ in seen] == [0.0, 0.5, 1.0, 0.5, 1.0, 0.0]
    assert all(steps == [0, 1] for _, steps in seen)
    assert [t.round for t in tuning.trials] == [0, 0, 0, 1, 1, 1]
    by_ratio = {r.ratio: r for r in tuning.results}
    assert by_ratio[0.0].seconds == [3.0, 3.1] and by_ratio[0.0].median == pytest.approx(3.05)
    # The engine's needed memory: the planned peak, plus the pinned groups as the ratio grows.
    needed = [by_ratio[r].needed_bytes for r in (0.0, 1.0)]
    assert 0 < needed[0] < needed[1] < tuning.limit_bytes
    assert tuning.recommended_ratio == 1.0  # 0.5 is faster but needs more than the headroom leaves
    on_device = [by_ratio[r].os_chunks_on_device for r in (0.0, 0.5, 1.0)]
    assert on_device[0] == 0 < on_device[1] <= on_device[2]
    table = tuning.table().splitlines()
    assert len(table) == 4 and table[3].startswith("*  1.00") and table[2].split()[-1] == "no"
    assert "gpu_margin_mem_ratio=1 (the fastest" in tuning.recommendation()


def test_default_measurement_times_the_steps_after_the_warmup():
    tuning = gemini.tune_margin(make_gpt, _loss_fn(), _config(), ratios=[0.0], steps=3, rounds=1, lr=1e-2,
                                headroom_fraction=0.0, isolate=False)
    (trial,) = tuning.trials
    assert trial.step_seconds > 0 and 0 < trial.device_peak_bytes <= BUDGET
    assert 0 < trial.needed_bytes <= BUDGET
    assert tuning.recommended_ratio == 0.0


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_budget_of_the_needed_bytes_trains(ratio):
    """*needed* is a device_memory the step trains in: the warm-up accepts it and every step stays
    under it. It used to leave out the reserve the engine keeps free, so the warm-up refused a
    budget of exactly that size ("65536 bytes are missing")."""
    tuning = gemini.tune_margin(make_gpt, _loss_fn(), _config(), ratios=[ratio], steps=2, rounds=1, lr=1e-2,
                                headroom_fraction=0.0, isolate=False)
    (trial,) = tuning.trials
    needed = trial.needed_bytes
    model, opt = gemini.initialize(make_gpt(), _config(device_memory=needed, gpu_margin_mem_ratio=ratio), lr=1e-2)
    loss_fn = _loss_fn()
    for _ in range(3):
        opt.backward(loss_fn(model))
        opt.step()
        opt.zero_grad()
        assert opt.report.device_peak_bytes <= needed
    opt.close()


def _result(ratio, seconds, needed, peak=99, error=None):
    return RatioResult(ratio=ratio, seconds=list(seconds), needed_bytes=needed, device_peak_bytes=peak,
                       error=error)


def test_ratios_within_noise_are_a_tie_won_by_the_least_device_memory():
    results = [
        _result(0.0, [1.02, 1.10, 1.05], needed=30),  # overlaps the fastest's range
        _result(0.5, [0.98, 1.04, 1.00], needed=60),  # the fastest median
        _result(0.75, [1.30, 1.35, 1.40], needed=70),  # clearly slower: not tied
        _result(1.0, [0.50, 0.50, 0.50], needed=95),  # fastest of all, but over the headroom
        _result(0.25, [], needed=None, peak=None, error="DeviceBudgetError: ..."),
    ]
    assert [r.ratio for r in tied_fastest(results, limit_bytes=90)] == [0.0, 0.5]
    assert recommend(results, limit_bytes=90) == 0.0
    # Identical inputs, identical answers, whatever the order they come in.
    answers = {recommend(list(p), limit_bytes=90) for p in itertools.permutations(results)}
    assert answers == {0.0}
    # Apart: the faster wins even though it needs more memory.
    apart = [_result(0.0, [2.0, 2.1, 2.2], needed=30), _result(0.5, [1.0, 1.05, 1.1], needed=60)]
    assert recommend(apart, limit_bytes=90) == 0.5
    # Ranges that do not overlap but medians closer than the wider spread: a tie.
    noisy = [_result(0.0, [1.1, 1.5, 1.9], needed=30), _result(0.5, [1.0, 1.0, 1.0], needed=60)]
    assert recommend(noisy, limit_bytes=90) == 0.0
    # Equal times and memory: the smaller ratio.
    assert recommend([_result(0.5, [1.0], 40), _result(0.25, [1.0], 40)], limit_bytes=90) == 0.25
    assert recommend(results, limit_bytes=10) is None


def _trial(ratio, seconds, peak, needed, round=0, error=None):
    return MarginTrial(ratio=ratio, os_chunks_on_device=0, os_chunks_total=4, step_seconds=seconds,
                       device_peak_bytes=peak, needed_bytes=needed, round=round, error=error)


def test_headroom_is_judged_on_needed_memory_not_on_the_cached_peak():
    # Measured peaks at 99% of a 100-byte budget (auto caches chunks up to the budget); needed
    # memory decides: 50 fits under 90, 95 does not; unknown needed falls back to the peak.
    trials = [_trial(0.0, 2.0, 99, 50), _trial(0.5, 1.0, 99, 95), _trial(1.0, 0.5, 99, None),
              _trial(0.0, 2.1, 98, 52, round=1)]
    results = summarize(trials)
    assert [(r.ratio, r.seconds, r.needed_bytes, r.device_peak_bytes) for r in results] == [
        (0.0, [2.0, 2.1], 52, 99), (0.5, [1.0], 95, 99), (1.0, [0.5], None, 99)]
    assert recommend(results, limit_bytes=90) == 0.0
    tuning = gemini.MarginTuning(trials=trials, budget_bytes=100, headroom_fraction=0.1, recommended_ratio=0.0)
    rows = tuning.table().splitlines()
    assert rows[1].startswith("*  0.00") and rows[1].split()[-1] == "yes"
    assert "(52%)" in rows[1] and "(99%)" in rows[1]  # both figures shown
    assert rows[2].split()[-1] == "no" and rows[3].split()[-1] == "no"


def test_the_readme_command_exits_0_with_a_recommendation(capsys):
    # The README's example with a smaller model (the README's takes minutes) and two ratios:
    # every trial in its own process, a line per trial on stderr, the second round in the other
    # order, the table and the recommendation on stdout.
    argv = ["tune-margin", "--device", "cpu", "--layers", "2", "--embd", "128", "--heads", "4", "--vocab", "256",
            "--seq", "16", "--device-memory", "4MiB", "--ratios", "0,1", "--steps", "2", "--rounds", "2"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "[trial 1/4] ratio 0 round 1: " in err and "[trial 2/4] ratio 1 round 1: " in err
    assert "[trial 3/4] ratio 1 round 2: " in err and "[trial 4/4] ratio 0 round 2: " in err
    table = out[out.index("  ratio  OS chunks"):].splitlines()
    assert "needed" in table[0] and "measured peak" in table[0]
    assert sum(row.startswith("*") for row in table[1:3]) == 1
    assert "recommended: gpu_margin_mem_ratio=" in out
    assert "host memory peak: this process " in out and "largest trial process " in out


@pytest.mark.parametrize("kwargs, match", [
    (dict(config=gemini.GeminiConfig(device="cpu", placement="cpu", device_memory=BUDGET)), "placement"),
    (dict(config=gemini.GeminiConfig(device="cpu", placement="auto")), "device_memory"),
    (dict(steps=1), "steps"),
    (dict(rounds=0), "rounds"),
    (dict(ratios=[0.5, 1.5]), "ratios"),
    (dict(headroom_fraction=1.0), "headroom_fraction"),
    (dict(isolate=True), "isolate"),  # a lambda cannot go to another process
])
def test_bad_arguments_name_the_parameter(kwargs, match):
    args = dict(config=_config(), steps=2, ratios=[0.0])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        gemini.tune_margin(make_gpt, _loss_fn(), args.pop("config"), **args)


def test_a_model_for_model_fn_is_named():
    """A model passed where a factory goes failed inside the first trial ("forward() missing 1
    required positional argument"), naming nothing of tune_margin's."""
    with pytest.raises(TypeError, match="model_fn=GPT is invalid: expected a function building a fresh model"):
        gemini.tune_margin(make_gpt(), _loss_fn(), _config(), steps=2, ratios=[0.0])


@pytest.mark.parametrize("field, value", [("step_seconds", -1.0), ("step_seconds", float("nan")),
                                          ("device_peak_bytes", 1.5), ("device_peak_bytes", True),
                                          ("needed_bytes", -1)])
def test_measurement_validates_its_fields(field, value):
    values = dict(step_seconds=1.0, device_peak_bytes=10)
    values[field] = value
    with pytest.raises(ValueError, match=f"Measurement.{field}="):
        gemini.Measurement(**values)
