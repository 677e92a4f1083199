"""Input signatures: which inputs a trace covers ([Note: a trace covers smaller inputs])."""

import pytest
import torch

from tracer import TracedInputs, input_signature


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


def test_traced_inputs_keep_the_plan_for_covered_inputs_until_an_iteration_overran():
    inputs = TracedInputs()
    inputs.trace((_ids(4, 64),), {})
    assert not inputs.needs_trace((_ids(4, 64),), {}, planned=True) and inputs.covered is None  # the traced ones
    assert not inputs.needs_trace((_ids(4, 40),), {}, planned=True)
    assert inputs.covered == _sig(_ids(4, 40))  # run on the larger trace's plan
    assert inputs.needs_trace((_ids(4, 40),), {}, planned=False)  # no plan (the warm-up overran): trace
    assert inputs.needs_trace((_ids(4, 80),), {}, planned=True)  # longer
    inputs.needs_trace((_ids(4, 40),), {}, planned=True)
    inputs.overran()  # the budget refused it on that plan: its own trace next time
    assert inputs.needs_trace((_ids(4, 40),), {}, planned=True)
    assert not inputs.needs_trace((_ids(4, 48),), {}, planned=True)  # others still covered
    inputs.trace((_ids(4, 40),), {})
    inputs.overran(planned=False)  # a warm-up's overrun: its own error, the trace stands
    assert not inputs.needs_trace((_ids(4, 40),), {}, planned=True)
    inputs.overran()  # the plan's own inputs (another engine holds more of the device now)
    assert inputs.needs_trace((_ids(4, 40),), {}, planned=True)  # traced again
    assert inputs.needs_trace((_ids(4, 20),), {}, planned=True)  # nothing is covered until then
