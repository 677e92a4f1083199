"""Input signatures: which inputs a trace covers ([Note: a trace covers smaller inputs])."""

import pytest
import torch

from tracer import TracedInputs, input_signature
from tracer.signature import PlanChoice


def _sig(*args, **kwargs):
    return input_signature(args, kwargs)


def _ids(batch: int, seq: int, dtype=torch.long):
    return torch.zeros(batch, seq, dtype=dtype)


@pytest.mark.parametrize("smaller", [(4, 32), (2, 64), (1, 1), (4, 64)])
def test_a_trace_covers_inputs_nowhere_larger(smaller):
    assert _sig(_ids(4, 64)).covers(_sig(_ids(*smaller)))


@pytest.mark.parametrize("other", [
    (_ids(4, 65),),  # longer
    (_ids(5, 8),),  # a larger batch, however short
    (_ids(4, 64, torch.int32),),  # another dtype
    (torch.zeros(4, 64, 1, dtype=torch.long),),  # another rank
    (_ids(4, 64), _ids(4, 64)),  # another structure
])
def test_a_trace_does_not_cover_larger_or_other_inputs(other):
    assert not _sig(_ids(4, 64)).covers(_sig(*other))


def test_plain_values_and_keywords_must_be_equal():
    traced = _sig(_ids(4, 64), mask=_ids(4, 64), causal=True)
    assert traced.covers(_sig(_ids(4, 32), mask=_ids(4, 32), causal=True))
    assert not traced.covers(_sig(_ids(4, 32), mask=_ids(4, 32), causal=False))
    assert not traced.covers(_sig(_ids(4, 32), causal=True))  # a keyword missing
    assert not _sig(_ids(4, 64), 16).covers(_sig(_ids(4, 64), 8))  # an int by value, not by size
    # An input's gradient is work and memory the trace must have seen; without it, less.
    assert not _sig(torch.zeros(2, 3)).covers(_sig(torch.zeros(2, 3, requires_grad=True)))
    assert _sig(torch.zeros(2, 3, requires_grad=True)).covers(_sig(torch.zeros(2, 3)))


def _traces(inputs: TracedInputs, *args, planned: bool = True) -> bool:
    """Whether an iteration on ``args`` is traced; one that runs on a plan is a landed step."""
    choice = inputs.choose(args, {}, planned=planned)
    if not choice.trace:
        inputs.start_step()
    return choice.trace


def test_traced_inputs_keep_the_plan_for_covered_inputs_until_an_iteration_overran():
    inputs = TracedInputs()
    inputs.trace((_ids(4, 64),), {})
    assert inputs.choose((_ids(4, 64),), {}, planned=True) == PlanChoice() and inputs.covered is None  # the traced ones
    assert inputs.choose((_ids(4, 40),), {}, planned=True) == PlanChoice()
    assert inputs.covered == _sig(_ids(4, 40))  # run on the larger trace's plan
    inputs.start_step()
    assert _traces(inputs, _ids(4, 40), planned=False)  # no plan (the warm-up overran): trace
    assert _traces(inputs, _ids(4, 80))  # longer
    inputs.choose((_ids(4, 40),), {}, planned=True)
    inputs.overran()  # the budget refused it on that plan: its own trace next time
    assert _traces(inputs, _ids(4, 40))
    assert not _traces(inputs, _ids(4, 48))  # others still covered
    inputs.trace((_ids(4, 40),), {})
    inputs.overran(planned=False)  # a warm-up's overrun: its own error, the trace stands
    assert not _traces(inputs, _ids(4, 40))
    inputs.choose((_ids(4, 40),), {}, planned=True)
    inputs.overran()  # the plan's own inputs (another engine holds more of the device now)
    assert _traces(inputs, _ids(4, 40))  # traced again
    assert _traces(inputs, _ids(4, 20))  # nothing is covered until then


def test_an_overrun_charges_every_plan_the_step_ran_on():
    """Micro-batches of one step on two plans (b's own inputs, a's larger trace covering c): the
    step's peak does not say whose it was, so each is traced when it comes again, and a landed
    step in between charges nothing to the next one's refusal."""
    inputs = TracedInputs()
    for name, rows in (("a", 8), ("b", 4)):
        inputs.trace((_ids(rows, 8), name), {})
        inputs.keep(f"plan {name}")
    inputs.start_step()
    assert inputs.choose((_ids(4, 8), "b"), {}, planned=True) == PlanChoice()  # in force
    inputs.start_step()  # landed
    assert inputs.choose((_ids(2, 8), "a"), {}, planned=True) == PlanChoice(plan="plan a")  # covered
    assert inputs.choose((_ids(4, 8), "b"), {}, planned=True) == PlanChoice(plan="plan b")
    inputs.overran()
    assert _traces(inputs, _ids(4, 8), "b") and _traces(inputs, _ids(2, 8), "a")
    assert inputs.choose((_ids(8, 8), "a"), {}, planned=True) == PlanChoice(plan="plan a")  # its own: kept
    for _ in range(100):  # forwards that never step (gradients for analysis) charge each plan once
        inputs.choose((_ids(8, 8), "a"), {}, planned=True)
    assert len(inputs._used) == 1


def test_inputs_that_take_turns_come_back_to_their_kept_plans():
    """[Note: plans kept per input signature]: a multi-task model's calls, batches cut to a token
    budget; the plan in force first where it covers, the least recently used plan forgotten."""
    inputs = TracedInputs(capacity=2)
    inputs.trace((_ids(8, 16), "a"), {})
    inputs.keep("plan a")
    assert _traces(inputs, _ids(8, 16), "b")  # a plain value differs: no plan covers
    inputs.trace((_ids(8, 16), "b"), {})
    inputs.keep("plan b")
    assert inputs.choose((_ids(8, 16), "a"), {}, planned=True) == PlanChoice(plan="plan a")
    assert inputs.signature == _sig(_ids(8, 16), "a") and inputs.covered is None
    assert inputs.choose((_ids(8, 16), "a"), {}, planned=True) == PlanChoice()  # in force now
    assert inputs.choose((_ids(2, 16), "b"), {}, planned=True) == PlanChoice(plan="plan b")  # covered by b's
    assert inputs.covered == _sig(_ids(2, 16), "b")
    assert inputs.choose((_ids(8, 16), "b"), {}, planned=True) == PlanChoice()  # b's own, in force
    # Token budget: neither shape covers the other; a third plan forgets the least recently used (a's).
    assert _traces(inputs, _ids(4, 32), "b")
    inputs.trace((_ids(4, 32), "b"), {})
    inputs.keep("plan b long")
    assert inputs.choose((_ids(8, 16), "b"), {}, planned=True) == PlanChoice(plan="plan b")
    assert inputs.choose((_ids(4, 30), "b"), {}, planned=True) == PlanChoice(plan="plan b long")
    assert _traces(inputs, _ids(8, 16), "a")  # forgotten
    # Inputs that the plan in force covers stay on it, though another kept plan covers them too.
    inputs.choose((_ids(8, 16), "b"), {}, planned=True)
    assert inputs.choose((_ids(4, 16), "b"), {}, planned=True) == PlanChoice()
    assert inputs.choose((_ids(8, 16), "b"), {}, planned=False) == PlanChoice()  # the same inputs: no trace
    assert inputs.choose((_ids(4, 16), "b"), {}, planned=False) == PlanChoice(plan="plan b")  # none in force


def test_a_kept_plan_whose_own_inputs_overran_is_forgotten():
    inputs = TracedInputs()
    for name in ("a", "b"):
        inputs.trace((_ids(4, 8), name), {})
        inputs.keep(f"plan {name}")
        inputs.start_step()
    assert inputs.choose((_ids(4, 8), "a"), {}, planned=True) == PlanChoice(plan="plan a")
    inputs.overran()  # on its own plan: what else uses the device changed
    assert _traces(inputs, _ids(4, 8), "a") and _traces(inputs, _ids(2, 8), "a")
    assert inputs.choose((_ids(4, 8), "b"), {}, planned=True) == PlanChoice(plan="plan b")
    inputs.start_step()
    inputs.choose((_ids(2, 8), "b"), {}, planned=True)
    inputs.overran()  # covered inputs overran b's plan: they are traced when they come again
    assert _traces(inputs, _ids(2, 8), "b")
    assert inputs.choose((_ids(4, 8), "b"), {}, planned=True) == PlanChoice()  # the plan itself stays


def test_inputs_whose_own_plan_overran_are_traced_not_run_on_a_larger_plan():
    """What else uses the device changed (another engine holds more): a larger trace's plan,
    measured before that change, is as stale as the inputs' own; they are traced again."""
    inputs = TracedInputs()
    for seq in (64, 32):
        inputs.trace((_ids(4, seq),), {})
        inputs.keep(f"plan {seq}")
        inputs.start_step()
    assert inputs.choose((_ids(4, 32),), {}, planned=True) == PlanChoice()  # its own plan, in force
    inputs.overran()
    assert _traces(inputs, _ids(4, 32))  # not the 64's plan, which covers it
    assert inputs.choose((_ids(4, 64),), {}, planned=True) == PlanChoice(plan="plan 64")


def test_inputs_traced_again_and_again_are_warned_about_once(caplog):
    """A step counter passed as an int: every iteration traced, silently ([Note: traces that keep
    coming]); one warning names where the inputs differ, after as many retraces as kept plans."""
    inputs = TracedInputs()
    inputs.trace((_ids(4, 64), 0), {})
    with caplog.at_level("WARNING", logger="tracer.signature"):
        for step in range(1, 20):
            choice = inputs.choose((_ids(4, 64), step), {}, planned=True)
            assert choice.trace
            inputs.trace((_ids(4, 64), step), {})
            inputs.keep(f"plan {step}")
            if step < 8:
                assert not caplog.records
    assert len(caplog.records) == 1
    assert "8 iterations traced again" in caplog.text and "leaf 1: 7 -> 8" in caplog.text
    assert _sig(_ids(4, 64)).differences(_sig(_ids(4, 64), mask=_ids(4, 64))) == "the structure of the arguments"
    assert _sig(_ids(4, 64), 3).differences(_sig(_ids(2, 64), 3)) == "leaf 0: torch.int64[4, 64]@cpu -> torch.int64[2, 64]@cpu"
    assert (_sig(torch.zeros(2, 3)).differences(_sig(torch.zeros(2, 3, requires_grad=True)))
            == "leaf 0: torch.float32[2, 3]@cpu -> torch.float32[2, 3]@cpu needing its gradient")


def test_inputs_traced_again_after_their_plans_overran_are_no_warning(caplog):
    """Two engines on one device: an engine's own plan overran (the other holds more now) and its
    inputs are traced again, again and again; the inputs did not change, so no warning says they do."""
    inputs = TracedInputs()
    fake = torch.zeros(16, 32, requires_grad=True)
    with caplog.at_level("WARNING", logger="tracer.signature"):
        for _ in range(12):
            # The discriminator's phase overruns on its plan; the generator's (its input needing
            # its gradient) runs on its own.
            for x, overruns in ((fake.detach(), True), (fake, False)):
                if inputs.choose((x,), {}, planned=True).trace:
                    inputs.trace((x,), {})
                    inputs.keep(f"plan {x.requires_grad}")
                if overruns:
                    inputs.overran()
                inputs.start_step()
    assert not caplog.records


def test_inputs_remembered_as_overrun_are_bounded():
    """A plain int among the inputs counts by value: each refused step would add one signature
    to those remembered as overrun, for good."""
    inputs = TracedInputs()
    for step in range(1000):
        inputs.trace((_ids(2, 8), step), {})
        inputs.keep("plan")
        inputs.choose((_ids(2, 8), step), {}, planned=True)
        inputs.overran()
    assert len(inputs._overran) <= 8 * 8 and len(inputs._overrun_own) <= 8 * 8
