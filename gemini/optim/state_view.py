"""``optimizer.state`` of gemini's optimizer: the states live in chunks, not in this dict.

torch code iterates ``optimizer.state`` (empty here, as for an optimizer without states of its own), tests its truth
(torch.distributed.checkpoint's state_dict helpers: was the optimizer ever stepped), or reads
``optimizer.state[p]["exp_avg"]`` (a KeyError naming ``optimizer.param_state(p)``, which gives copies).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

__all__ = ["StatesInChunks"]


class _NoStateHere(dict):
    """``optimizer.state[p]``: empty, and a read of a key says where the state is."""

    def __missing__(self, key: Any):
        raise KeyError(f"optimizer.state[p][{key!r}]: gemini keeps the optimizer's states in chunks, not in "
                       f"optimizer.state; optimizer.param_state(p) gives a parameter's step, exp_avg and exp_avg_sq "
                       f"(copies; change them with optimizer.load_state_dict)")


class StatesInChunks(collections.defaultdict):
    """``optimizer.state``: empty, as torch code expects of an optimizer without states of its own; an entry read is
    a :class:`_NoStateHere`. Its truth says whether any parameter has a state (``has_states()``), as a torch
    optimizer's does: torch.distributed.checkpoint's get/set_state_dict take a false one for a fresh optimizer and
    initialise it with a step on zero gradients, which would step trained states (step + 1, m and v decayed)."""

    def __init__(self, has_states: Callable[[], bool]) -> None:
        super().__init__(dict)
        self._has_states = has_states

    def __bool__(self) -> bool:
        return self._has_states()

    def __missing__(self, key: Any) -> _NoStateHere:
        return _NoStateHere()
