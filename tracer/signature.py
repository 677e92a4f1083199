"""What about a model's inputs decides its memory: tensor shapes, dtypes, devices, structure.

A trace holds for the inputs it was taken with, and for smaller ones: see [Note: a trace covers
smaller inputs].
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import TreeSpec, tree_flatten

logger = logging.getLogger(__name__)

__all__ = ["KEPT_PLANS", "InputSignature", "PlanChoice", "TensorSignature", "TracedInputs", "input_signature"]

# Plain values that can change what a forward allocates (a sequence length passed as an
# int, a flag) are part of the signature by value; other objects by type only.
_BY_VALUE = (bool, int, float, str, type(None))


@dataclass(frozen=True, kw_only=True)
class TensorSignature:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True, kw_only=True)
class InputSignature:
    """The structure of a call's arguments and the signature of each leaf."""

    spec: TreeSpec
    leaves: tuple[Any, ...]

    def covers(self, other: InputSignature) -> bool:
        """Whether a trace taken on these inputs bounds an iteration on ``other``: the same
        structure and plain values, each tensor of the same dtype, device and rank, nowhere
        larger, and needing a gradient only where the traced one did (see [Note: a trace covers
        smaller inputs])."""
        return (self.spec == other.spec and len(self.leaves) == len(other.leaves)
                and all(_covers(a, b) for a, b in zip(self.leaves, other.leaves)))

    def __str__(self) -> str:
        return "(" + ", ".join(map(_describe, self.leaves)) + ")"

    def differences(self, other: InputSignature) -> str:
        """Where ``other`` differs from these inputs (the first three leaves), for a log line."""
        if self.spec != other.spec or len(self.leaves) != len(other.leaves):
            return "the structure of the arguments"
        return "; ".join([f"leaf {i}: {_describe(a)} -> {_describe(b)}"
                          for i, (a, b) in enumerate(zip(self.leaves, other.leaves)) if a != b][:3])


def input_signature(args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> InputSignature:
    """The signature of a call ``f(*args, **kwargs)``."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs or {})))
    return InputSignature(spec=spec, leaves=tuple(_leaf_signature(leaf) for leaf in leaves))


def _leaf_signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return TensorSignature(
            shape=tuple(leaf.shape), dtype=leaf.dtype, device=leaf.device, requires_grad=leaf.requires_grad
        )
    if isinstance(leaf, _BY_VALUE):
        return (type(leaf).__name__, leaf)
    return (type(leaf).__name__,)


def _describe(leaf: Any) -> str:
    if isinstance(leaf, TensorSignature):
        return f"{leaf.dtype}{list(leaf.shape)}@{leaf.device}" + (" needing its gradient" if leaf.requires_grad else "")
    return repr(leaf[1]) if len(leaf) == 2 else f"a {leaf[0]}"  # see _leaf_signature


def _covers(mine: Any, other: Any) -> bool:
    if isinstance(mine, TensorSignature) and isinstance(other, TensorSignature):
        return (mine.dtype == other.dtype and mine.device == other.device
                and (mine.requires_grad or not other.requires_grad)  # its gradient: more to do
                and len(mine.shape) == len(other.shape) and all(m >= o for m, o in zip(mine.shape, other.shape)))
    return mine == other


# [Note: a trace covers smaller inputs]
# Auto's plan holds for the inputs its warm-up traced. Batches whose shapes change from step to
# step (dynamic padding to the longest sequence of each batch, an epoch's last short batch) were
# traced again at every change: each such iteration a warm-up that releases every group (placement
# cpu's traffic) and plans, its plan never used. What an iteration needs on the device
# (activations, workspaces, the chunks' traffic) grows with its inputs, so a plan traced on
# inputs at least as large in every dimension (same structure, dtypes and devices) bounds an
# iteration on smaller ones, and on inputs needing no gradient where the traced ones did (a GAN's
# discriminator takes the generator's output with a graph, the real batch without): the plan is
# kept (conservatively: the room a smaller batch leaves is not used; an iteration of fewer periods,
# an RNN unrolled fewer steps, follows the trace as [Note: an iteration that skips traced periods]
# in gemini/policies/plan.py says), and only inputs larger
# somewhere are traced, so a run traces about as often as its largest batch grows. Every step's
# peak is still checked against the budget: a model whose memory does not shrink with its inputs
# fails that check once, and those inputs are traced when they come again; the plan's own inputs
# overrunning it (another engine in the process holds more of the device now: [Note: monitors
# sharing one mode] in tracer/accounting_monitor.py) are traced at the next iteration. A warm-up
# that overran the budget (no plan) traces again at any change: a smaller batch is the usual
# answer to its error. Under ZeRO the ranks trace together when any needs to ([Note: ranks trace
# together] in gemini/parallel/zero.py), each on its own inputs.
class PlanChoice(NamedTuple):
    """What an iteration's inputs run on: a trace of their own (``trace``), a kept plan other
    than the one in force (``plan``), or neither: the plan in force (or none: ``UNPLANNED``)."""

    trace: bool = False
    plan: Any = None


# Plans kept for inputs traced before, the most recently used last (torch.compile keeps 8
# compiled graphs per function by default for the same reason: a few shapes in turn).
KEPT_PLANS = 8


class TracedInputs:
    """The inputs auto's plans were traced on, each with its plan (the last :data:`KEPT_PLANS`),
    and which plan later inputs run on (see [Note: a trace covers smaller inputs] and [Note:
    plans kept per input signature])."""

    def __init__(self, capacity: int = KEPT_PLANS) -> None:
        self.signature: InputSignature | None = None  # the inputs of the plan in force (or of the warm-up)
        self.covered: InputSignature | None = None  # this iteration's, run on a larger trace's plan
        self._overran: list[InputSignature] = []  # inputs that overran the budget on such a plan
        self._kept: list[tuple[InputSignature, Any]] = []  # (traced inputs, their plan), least recently used first
        self._capacity = capacity
        self._used: list[tuple[InputSignature | None, InputSignature | None]] = []  # this step's (signature, covered)
        self._retraces = 0  # iterations traced again for inputs no kept plan covered
        self._overrun_own: list[InputSignature] = []  # inputs whose own plan overran: traced again for that

    def trace(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """The warm-up traces these inputs."""
        self.signature, self.covered = input_signature(args, kwargs), None
        self._charge()

    def start_step(self) -> None:
        """A step landed: what the next one's forwards run on is charged to it (see :meth:`overran`)."""
        self._used = []

    def retrace(self) -> None:
        """The warm-up of :attr:`signature` made no plan to keep, and not for want of room: its
        inputs are traced again when they come (unlike a warm-up's that overran the budget)."""
        self.signature = None

    def keep(self, plan: Any) -> None:
        """The warm-up of :attr:`signature` planned ``plan``: inputs it covers may run on it later."""
        self._forget(self.signature)
        self._kept.append((self.signature, plan))
        del self._kept[:-self._capacity]

    def choose(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, planned: bool) -> PlanChoice:
        """What an iteration on these inputs runs on; ``planned``: the plan of :attr:`signature`
        is in force (not ``UNPLANNED``: its warm-up overran the budget and stays without a plan
        for the same inputs)."""
        signature, self.covered = input_signature(args, kwargs), None
        if signature == self.signature or (planned and self.signature is not None and signature not in self._overran
                                           and self.signature.covers(signature)):
            self.covered = None if signature == self.signature else signature  # the plan in force: no move
            self._charge()
            return PlanChoice()
        kept = ([k for k in reversed(self._kept) if k[0] == signature]
                or [k for k in reversed(self._kept) if k[0].covers(signature) and signature not in self._overran])
        if not kept:
            changed = signature not in self._overrun_own  # an overrun's retrace is no input that keeps changing
            self._retraces += changed
            if changed and self._retraces == self._capacity and self.signature is not None:  # [Note: traces that keep coming]
                logger.warning(
                    "auto placement: %d iterations traced again for inputs no kept plan covers (the last differs from "
                    "the plan in force at %s): each such iteration moves chunks as placement 'cpu' does. Plain "
                    "values among the inputs (ints, strings, flags) count by value: a step counter or a per-batch "
                    "length passed as an int traces every step (pass it as a tensor); batches padded to a few "
                    "lengths are traced once each, and smaller ones run on a larger one's plan.",
                    self._retraces, self.signature.differences(signature))
            return PlanChoice(trace=True)
        self._kept.remove(kept[0])
        self._kept.append(kept[0])
        traced, plan = kept[0]
        self.signature, self.covered = traced, (signature if traced != signature else None)
        self._charge()
        return PlanChoice(plan=plan)

    def overran(self, *, planned: bool = True) -> None:
        """This iteration overran the budget: if it ran on plans (``planned``; a warm-up's overrun
        is its own error), the inputs of each forward since the last landed step are traced when
        they come again: a plan's own inputs at once (what else uses the device has changed), a
        larger trace's inputs whenever they come. Micro-batches of one step may have run on
        different plans, and the step's peak does not say whose it was."""
        used, self._used = self._used or [(self.signature, self.covered)], []
        if not planned:
            return
        for signature, covered in used:
            if covered is None:
                self._forget(signature)
                if signature is not None:
                    _remember(self._overrun_own, signature)
                    _remember(self._overran, signature)  # nor run on a larger kept plan: traced
                if signature == self.signature:
                    self.signature = None
            else:
                _remember(self._overran, covered)

    def _charge(self) -> None:  # this forward runs on (signature, covered): once each until a step lands
        if (self.signature, self.covered) not in self._used:
            self._used.append((self.signature, self.covered))

    def _forget(self, signature: InputSignature | None) -> None:
        self._kept = [k for k in self._kept if k[0] != signature]


_REMEMBERED = 8 * KEPT_PLANS  # inputs remembered as overrun: a bound, since a plain int among them counts by value


def _remember(signatures: list[InputSignature], signature: InputSignature) -> None:
    """``signature`` in ``signatures``, the most recent last, the oldest forgotten past the bound."""
    if signature in signatures:
        signatures.remove(signature)
    signatures.append(signature)
    del signatures[:-_REMEMBERED]


# [Note: plans kept per input signature]
# A new trace used to replace the plan in force, so inputs that take turns and do not cover each
# other were traced at every turn: a multi-task model called with the task's name
# (``model(x, "a")`` then ``model(x, "b")``), batches cut to a token budget (8 x 16 then 4 x 32
# tokens), micro-batches of one step that differ so: every such iteration a warm-up moving
# chunks as placement "cpu" does, its plan used once if at all. Each plan is kept with the
# inputs it was traced on (the last few), and inputs that one of them covers switch to it
# without a trace: only the groups its choice places differently move (the plan in force first,
# where it covers them: no move at all). A kept plan is dropped when its own inputs overrun the
# budget on it, as the plan in force was; a step refused over the budget charges every plan its
# forwards ran on since the last landed step, since micro-batches of one step may run on
# different plans and the step's peak does not say whose it was. Inputs whose own plan overran
# are traced when they come again, not run on another kept plan that covers them: what else uses
# the device changed, and a larger trace's plan, measured before that change as theirs was, is
# no better a guess than theirs (a retry on it is refused by about the same bytes).


# [Note: traces that keep coming]
# Inputs that change in a way no kept plan covers are traced each time, and nothing said so but
# an INFO line per trace: a model called with the step number (``model(x, step)``: a plain int
# counts by value, as a sequence length passed as an int must) moved 450 KB in and 356 KB out
# every step on a tiny model under auto with gpu_margin_mem_ratio=1, where ``model(x)`` moved
# nothing after its warm-up. When as many iterations as there are kept plans have been traced
# again, one warning names where the last inputs differ from the plan's and what helps. Inputs
# traced again because their own plan overran the budget (two engines sharing a device) are no
# such change and do not count: counted, a GAN whose engines overran took the warning, blaming
# the discriminator's inputs taking turns (the generator's output needing its gradient in G's
# phase, which the line did not even show), where its retraces came from the overruns.
