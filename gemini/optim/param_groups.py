"""What ``HybridAdam.param_groups`` may and may not become after ``gemini.initialize``.

[Note: param groups are fixed at initialize]
``initialize`` lays the parameters out in chunk groups by param group (each chunk group records its param group's
index), so which parameters a group holds, and how many groups there are, cannot change afterwards: a parameter added
later has no chunk to be updated in, and one removed would still be updated by its chunk group. Hyperparameters may
change at any time (schedulers edit ``lr`` and ``betas``): every step reads them afresh. Refused too are the flags of
``torch.optim.Adam`` / ``AdamW`` that ask for math the fused update (adam.py) lacks, and a ``decoupled_weight_decay``
against ``adamw_mode`` (one kind of weight decay per optimizer): a step ignoring them would silently train differently
from torch.

The checks run at every step, so they cost O(param groups): parameter lists are compared element by element only when
a list is not the one ``initialize`` gave.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TORCH_FLAGS", "UNSUPPORTED_FLAGS", "GroupLayout", "check_flags", "check_frozen", "check_weight_decay_mode"]

# torch.optim.Adam / AdamW options adam.py's update passes as False: truthy, each would change the result (capturable
# and differentiable, the graph or device it is computed under). False or None, torch's defaults, are harmless.
UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")
# The flag keys torch.optim.AdamW's param groups carry, set to what gemini's update does. ``fused=True`` because the
# update is the fused kernel's bits (adam.py), and torch's load_state_dict keeps the saved group's flags: a torch
# AdamW(fused=True) loading ``fused=None`` would switch to the foreach kernel and drift from the uninterrupted run.
TORCH_FLAGS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=True)

_FIXED = ("the parameters of each param group are fixed at gemini.initialize (their chunks are laid out by "
          "group); only hyperparameters (lr, betas, eps, weight_decay) may change afterwards")


def check_flags(groups: Sequence[dict[str, Any]], *, where: str, advice: str) -> None:
    """Raise ``ValueError`` naming the first group of ``groups`` that sets an unsupported flag truthy; ``where`` names
    the groups in the message (``"optimizer.param_groups"``)."""
    for i, group in enumerate(groups):
        for key in UNSUPPORTED_FLAGS:
            value = group.get(key)
            if value:
                raise ValueError(
                    f"{where}[{i}][{key!r}] = {value!r} is not supported: gemini's Adam/AdamW implements none "
                    f"of {', '.join(UNSUPPORTED_FLAGS)} (accepted: False, None or absent); {advice}")


def check_weight_decay_mode(groups: Sequence[dict[str, Any]], *, adamw_mode: bool, where: str, advice: str,
                            saved_mode: bool | None = None) -> None:
    """Raise ``ValueError`` naming the first group that asks for the other weight decay than ``adamw_mode``'s where
    that changes the math (weight_decay not 0). torch.optim.Adam's groups say ``decoupled_weight_decay=False``, AdamW's
    True (torch follows a loaded group's value); gemini's own states say ``adamw_mode`` once, ``saved_mode`` here."""
    key = "decoupled_weight_decay"
    for i, group in enumerate(groups):
        mode = group.get(key, saved_mode)
        if mode is None or bool(mode) == adamw_mode or not group.get("weight_decay", 0):
            continue
        source = f"{where}[{i}][{key!r}] = {mode!r}" if key in group else f"{where}[{i}] (saved with adamw_mode={mode!r})"
        raise ValueError(
            f"{source} with weight_decay {group['weight_decay']!r} asks for {_decay_kind(bool(mode))}, but this "
            f"optimizer does {_decay_kind(adamw_mode)} (gemini.initialize(adamw_mode={adamw_mode})); {advice}")


def check_frozen(chunk_groups: Sequence[Any]) -> None:
    """Parameters frozen at initialize have no gradient chunk nor optimizer states: one made trainable since would be
    silently not stepped (``chunk_groups``: the manager's, ``trainable`` False for the frozen ones)."""
    for g in chunk_groups:
        if not g.trainable:
            for slot, p in zip(g.slots, g.params):
                if p.requires_grad:
                    raise ValueError(
                        f"parameter {slot.name} had requires_grad=False at gemini.initialize and now requires "
                        f"grad: gemini gives gradient and optimizer-state chunks only to parameters trainable at "
                        f"initialize (nothing was stepped). Set requires_grad before gemini.initialize (freezing "
                        f"afterwards works), or set it back to False")


def _decay_kind(decoupled: bool) -> str:
    return "AdamW's decoupled weight decay" if decoupled else "Adam's L2 weight decay (added to the gradient)"


class GroupLayout:
    """The parameters of each param group as ``initialize`` gave them, to tell cheaply that ``optimizer.param_groups``
    still holds exactly those (see [Note: param groups are fixed at initialize])."""

    def __init__(self, param_groups: Sequence[dict[str, Any]]) -> None:
        self._params = [tuple(hp["params"]) for hp in param_groups]
        # The list objects themselves: a group still holding its list at its length had nothing removed or appended
        # (an element replaced in place is not caught by this cheap test).
        self._lists = [hp["params"] for hp in param_groups]

    def check(self, param_groups: Sequence[dict[str, Any]]) -> None:
        """Raise ``ValueError`` naming the group if the groups' parameters changed."""
        if len(param_groups) != len(self._params):
            changed = next((i for i in range(min(len(param_groups), len(self._params)))
                            if not self._same(i, param_groups[i])), None)
            which = "" if changed is None else f" (param_groups[{changed}] no longer holds the parameters it was given)"
            raise ValueError(f"optimizer.param_groups has {_count(param_groups, 'group')}, gemini.initialize made "
                             f"{len(self._params)}{which}: groups can't be added or removed after initialize; "
                             f"{_FIXED}. Call gemini.initialize again with the param_groups you want")
        for i, hp in enumerate(param_groups):
            params = hp.get("params") if isinstance(hp, dict) else None
            if params is self._lists[i] and len(params) == len(self._params[i]):
                continue
            if not self._same(i, hp):
                raise ValueError(self._changed_message(i, params))
            self._lists[i] = params  # an equal list put in its place: the cheap test holds from now on

    def _same(self, i: int, hp: Any) -> bool:
        params = hp.get("params") if isinstance(hp, dict) else None
        want = self._params[i]
        return (isinstance(params, (list, tuple)) and len(params) == len(want)
                and all(a is b for a, b in zip(params, want)))

    def _changed_message(self, i: int, params: Any) -> str:
        if not isinstance(params, (list, tuple)):
            what = f"is now {type(params).__name__}, not the list of {len(self._params[i])} parameters it was given"
        else:
            now = {id(p) for p in params}
            before = {id(p) for p in self._params[i]}
            removed = [tuple(p.shape) for p in self._params[i] if id(p) not in now]
            added = [tuple(getattr(p, "shape", ())) for p in params if id(p) not in before]
            edits = [f"{_count(shapes)} {verb}, of shapes {shapes[:4]}"
                     for shapes, verb in ((removed, "removed"), (added, "added")) if shapes]
            what = (f"was changed after initialize ({'; '.join(edits)})" if edits
                    else "was reordered or holds a parameter twice")
        return (f"optimizer.param_groups[{i}]['params'] {what}: {_FIXED}. To stop training a parameter, "
                f"call p.requires_grad_(False); to train a different set, call gemini.initialize again "
                f"with the param_groups you want")


def _count(items: Sequence[Any], noun: str = "parameter") -> str:
    return f"{len(items)} {noun}" + ("" if len(items) == 1 else "s")
