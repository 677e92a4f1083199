import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tracer.hooks import PeriodHooks, Phase

F, B, R = Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE


class Net(nn.Module):
    def __init__(self, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.a = nn.Linear(8, 8)
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x):
        h = self.a(x)
        if self.checkpointed:
            return checkpoint(self.seq, h, use_reentrant=False)
        return self.seq(h)


def _record(model, fn):
    seen = []
    with PeriodHooks(model, lambda b: seen.append((b.phase, b.module_name))):
        fn()
    return seen


FORWARD = [(F, ""), (F, "a"), (F, "seq"), (F, "seq.0"), (F, "seq.1"), (F, "seq.2")]


def test_forward_then_backward_order_with_parents_before_children_on_shared_outputs():
    model = Net()
    x = torch.randn(2, 8)
    seen = _record(model, lambda: model(x).sum().backward())
    # The model, seq and seq.2 return the same tensor: one hook announces all three,
    # outermost first, before seq.2's backward ops run.
    assert seen == FORWARD + [(B, ""), (B, "seq"), (B, "seq.2"), (B, "seq.1"), (B, "seq.0"), (B, "a")]


def test_checkpoint_reforward_shows_up_as_recompute_periods():
    model = Net(checkpointed=True)
    x = torch.randn(2, 8)
    seen = _record(model, lambda: model(x).sum().backward())
    assert seen[: len(FORWARD)] == FORWARD
    backward = seen[len(FORWARD) :]
    # seq.2's backward needs its saved input, so the region re-runs its forward right there.
    assert backward == [
        (B, ""), (B, "seq"), (B, "seq.2"),
        (R, "seq"), (R, "seq.0"), (R, "seq.1"), (R, "seq.2"),
        (B, "seq.1"), (B, "seq.0"), (B, "a"),
    ]  # fmt: skip


def test_no_grad_forward_has_no_backward_boundaries_and_hooks_come_off():
    model = Net()
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert _record(model, lambda: model(x)) == FORWARD
    # After remove(), neither module hooks nor hooks on a graph built meanwhile remain.
    seen = []
    hooks = PeriodHooks(model, lambda b: seen.append(b))
    hooks.install()
    out = model(x)
    hooks.remove()
    out.sum().backward()
    assert len(seen) == len(FORWARD)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_two_forwards_then_one_backward_announce_both_backwards():
    model = Net()
    x1, x2 = torch.randn(2, 8), torch.randn(3, 8)
    seen = _record(model, lambda: (model(x1).sum() + model(x2).sum()).backward())
    names = [n for phase, n in seen if phase is B]
    assert sorted(names) == sorted(["", "seq", "seq.2", "seq.1", "seq.0", "a"] * 2)


def test_fired_grad_hooks_do_not_pile_up_across_iterations():
    model = Net()
    x = torch.randn(2, 8)
    hooks = PeriodHooks(model, lambda b: None)
    live = []
    with hooks:
        for _ in range(3):
            model(x).sum().backward()
            live.append(len(hooks._grad_hooks))
    assert live[1] == live[2] <= live[0]


class Residuals(nn.Module):
    """Linears on a 3-D input (each returns a view), then ops on their outputs in place or not."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.a = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=in_place))
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        out = self.proj(h)
        if self.in_place:
            out += h
        else:
            out = out + h
        return self.head(out)


def test_outputs_modified_in_place_keep_their_backward_boundaries():
    """A tensor hook on a view is dropped when the view is modified in place: ``out += h`` took
    proj's backward boundary away (see [Note: a call's outputs hooked through in-place ops] in
    tracer/grad_nodes.py). In place or not, the same boundaries in the same order."""
    x = torch.randn(2, 3, 8)
    seen = {}
    for in_place in (False, True):
        torch.manual_seed(0)
        model = Residuals(in_place)
        seen[in_place] = _record(model, lambda: model(x).sum().backward())
    assert seen[True] == seen[False]
    assert [n for phase, n in seen[True] if phase is B] == ["", "head", "proj", "a", "a.1", "a.0"]
