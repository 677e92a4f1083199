"""The warm-up's chunk visits, replayed beside the planner's meta run (gemini/tools/meta_run.py).

It holds what the engine's warm-up holds on the device at each operator (the chunk groups a module computes with, a
group's gradient chunk while its gradients arrive), and so gives the warm-up's peak and the peak its plan charges
(see [Note: the warm-up replayed on meta]).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.utils._python_dispatch import TorchDispatchMode

from gemini.policies.footprint import DeviceGroups
from tracer.hooks import Boundary, Phase
from tracer.monitors import TensorAccountingMonitor

__all__ = ["WarmupReplay"]


# [Note: the warm-up replayed on meta]
# The warm-up (placement "cpu", and "auto" before its plan) holds a chunk group on the device only while it computes:
# in forward, from the pre-hook of the first module using it until the last such module's forward ends (tied and
# straddling groups wait for their last use); in backward, from the backward of a module call using it until every
# begun call using it is done (its inputs' gradients computed) or all its gradients are in, with its gradient chunk
# from the first gradient to the last. The meta run follows the same events with the engine's own period hooks
# (tracer/hooks.py), module hooks and gradient hooks, and after every operator adds the chunk bytes held to the
# non-model bytes alive: the largest sum is the warm-up's peak. (A sum of the two peaks would overstate it: the
# largest non-model peak often falls where no chunk is held, e.g. the loss after the root module's forward.)
# The engine's plan charges each segment (a period, from one module's forward or backward to the next, cut again
# where backward marks a decision: a group's first gradient, a call's backward done) its own most chunk bytes plus
# its own non-model peak, since later iterations keep fetched chunks cached; the meta run keeps the same per-segment
# figures, so its planned peak, and the margin auto computes from it, are the engine's.
#
# [Note: a gradient taken into its chunk]
# Autograd accumulates a parameter's gradient as a tensor of its own; the engine's post-accumulate hook then
# allocates the group's gradient chunk (at its first gradient), copies the gradient in and only then drops it, and
# after the group's last gradient releases its parameters and moves the gradient chunk to the host. So for a moment
# the parameters, the gradient chunk and the gradient are all on the device: with one parameter per group (a big
# weight) that moment is the peak, which counting the chunk only between first and last gradient would miss.
#
# [Note: what stays on the device, replayed]
# A placement that keeps some groups on the device for good ("static"'s fractions; "auto" after its warm-up, which
# caches every parameter chunk it fetched) has its own timeline: the kept chunks throughout, the other groups
# visiting as in the warm-up. With ``residents`` (which groups keep their parameters, which are kept whole) the
# replay also follows that timeline and gives the peak of the chunks that come and go plus non-model bytes
# (``resident_peak``), which the forecast adds to the bytes kept; adding the largest visiting group and the non-model
# peak instead sums peaks that never coincide. Kept groups' gradient chunks are there from the first step on
# (see [Note: what every step keeps is there from the first] in gemini/engine/residency.py).


class WarmupReplay(TorchDispatchMode):
    """Follows the chunk groups the warm-up holds, and the peaks (see [Note: the warm-up replayed on meta])."""

    def __init__(self, monitor: TensorAccountingMonitor, group_bytes: Sequence[int],
                 uses: dict[int, int], grads_expected: dict[int, int], residents: DeviceGroups | None = None) -> None:
        super().__init__()
        # See [Note: what stays on the device, replayed].
        self.residents = residents or DeviceGroups()
        self.resident_bytes = 0  # the chunks that come and go beside the kept ones
        self.resident_peak = 0
        self.monitor = monitor
        self.group_bytes = group_bytes
        self.uses = uses  # group -> module calls using it in one forward
        self.grads_expected = grads_expected  # group -> trainable parameters in it
        self.uses_left: dict[int, int] | None = {}  # None once the root's forward is over
        self.refs: dict[int, int] = {}  # forward: modules using the group now
        self.backward_open: dict[int, int] = {}  # group -> module calls whose backward began, not done
        self.grads_in: dict[int, int] = {}
        self.grad_chunks: set[int] = set()  # groups whose gradient chunk is on the device
        self.held_bytes = 0
        self.warmup_peak = 0
        self.period_non_model = 0
        self.period_held = 0
        self.planned_peak = 0

    def _update(self) -> None:
        held = set(g for g, n in self.refs.items() if n) | set(g for g, n in (self.uses_left or {}).items() if n) \
            | set(g for g, n in self.backward_open.items() if n)
        self.held_bytes = self._bytes(held) + self._bytes(self.grad_chunks)
        kept = self.residents.params | self.residents.whole
        self.resident_bytes = self._bytes(held - kept) + self._bytes(self.grad_chunks - self.residents.whole)
        self._measure()

    def _bytes(self, groups: set[int]) -> int:
        return sum(self.group_bytes[g] for g in groups)

    def _measure(self) -> None:
        now = self.monitor.current_bytes()
        self.warmup_peak = max(self.warmup_peak, now + self.held_bytes)
        self.resident_peak = max(self.resident_peak, now + self.resident_bytes)
        self.period_non_model = max(self.period_non_model, now)
        self.period_held = max(self.period_held, self.held_bytes)

    def new_period(self) -> None:
        self.planned_peak = max(self.planned_peak, self.period_non_model + self.period_held)
        self.period_non_model = self.monitor.current_bytes()
        self.period_held = self.held_bytes

    def on_boundary(self, boundary: Boundary, groups: Sequence[int]) -> None:
        """A period begins (the engine's boundaries: tracer/hooks.py); a backward one fetches the module's groups."""
        self.new_period()
        if boundary.phase is Phase.BACKWARD and groups:
            for g in groups:
                self.backward_open[g] = self.backward_open.get(g, 0) + 1
            self._update()

    def forward_begins(self, groups: Sequence[int]) -> None:
        for g in groups:
            if self.uses_left is not None and not self.uses_left.get(g):
                self.uses_left[g] = self.uses[g]
            self.refs[g] = self.refs.get(g, 0) + 1
        self._update()

    def forward_over(self) -> None:
        """The root's forward returned: from now on (a checkpoint's recompute) a group leaves after each module using
        it, as the engine's ``Residency.end_forward`` arranges."""
        self.uses_left = None
        self._update()

    def backward_done(self, groups: Sequence[int]) -> None:
        """A module call's inputs have their gradients: the engine marks a decision and releases the groups no other
        begun call still reads."""
        self.new_period()
        for g in groups:
            if self.backward_open.get(g):
                self.backward_open[g] -= 1
        self._update()

    def forward_ends(self, groups: Sequence[int]) -> None:
        for g in groups:
            self.refs[g] -= 1
            if self.uses_left is not None:
                self.uses_left[g] -= 1
        self._update()

    def grad_in(self, group: int) -> None:
        """A gradient of ``group`` is accumulated and not yet taken: the engine copies it into the gradient chunk
        while the gradient itself is still alive (see [Note: a gradient taken into its chunk])."""
        self.grads_in[group] = self.grads_in.get(group, 0) + 1
        if self.grads_in[group] == 1:
            # The engine marks a decision here (a new segment), then the gradient chunk arrives.
            self.new_period()
        self.grad_chunks.add(group)
        self._update()

    def grad_taken(self, group: int) -> None:
        """The gradient is in its chunk and dropped; after the group's last one the engine releases its parameters and
        moves its gradient chunk off the device."""
        if self.grads_in[group] >= self.grads_expected[group]:
            self.backward_open.pop(group, None)
            self.grad_chunks.discard(group)
        self._update()

    def finish(self) -> None:
        self.new_period()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self._measure()
        return out
