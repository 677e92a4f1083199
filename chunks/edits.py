"""`ParamEdits`: writes that torch code makes through the parameters viewing a param chunk.

[Note: writes through the parameters]
Each parameter's ``.data`` is a view of its slot in the param chunk's primary copy
(``ChunkManager.repoint``), and torch code writes into parameters in place: ``nn.Embedding(max_norm=...)``
renormalises rows inside forward, ``with torch.no_grad(): p.mul_(0.5)`` or ``nn.init.*``
between steps. Two assumptions of the engine break under such a write:
- a HOST_AND_DEVICE chunk's device copy equals its host copy, so it is dropped without a copy
  back ([Note: parameter chunks around compute] in gemini/engine/residency.py). The write
  landed in the device copy (the primary one) and went with it.
- under bf16/fp16 the param chunk is the fp32 master's cast, cast again after each step: the
  write was overwritten ([Note: edits of low-precision parameters] in gemini/engine/step_moves.py).
Every in-place op bumps its tensor's version counter (``_version``), which views and
``detach()`` share. But ``p.data = view`` leaves ``p`` its own counter: writes through ``p``
bump it and not the payload's, and the engine's own writes into the payload (Adam, gradient
copies, the step's casts, ZeRO's gathers) bump the payload's and not ``p``'s. (The step bumps the
counters of the parameters it updated, as torch's step does, so that autograd refuses a graph saved
before it, and says so: ``bumped``.) So the sum of the parameters' counters moves exactly when torch
code wrote through them: the engine's writes never count, and a chunk nobody edits never moves a byte more. The sum is read at every move of the
chunk (beside ``repoint``, which loops over the same parameters anyway): a move carries the
primary copy's bytes along (a fetch copies them, ``drop_host_copy`` keeps them), except one
that drops a device copy with a host copy beside it, where ``Chunk`` first copies the device
copy back (counted as d2h) if the sum moved since the last move. ``edited`` stays set until the
step brings the edit into the masters.

Not seen: writes through ``p.data`` (``p.data.mul_(2)``), since torch gives each ``p.data`` a
fresh counter; the README says to write under ``torch.no_grad()`` instead. Assigning ``p.data``
itself is another matter: ``ChunkManager.adopt_assigned`` finds it by address.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["ParamEdits"]


class ParamEdits:
    """The version counters of the parameters viewing one param chunk (see the module note)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self._params = tuple(params)
        self._seen = self._count()
        # Written through since the masters were last brought up to date (low precision's step).
        self.edited = False

    def _count(self) -> int:
        return sum(p._version for p in self._params)

    def bumped(self, count: int) -> None:
        """The engine bumped ``count`` of these counters itself (a step's update, so that autograd
        refuses a graph saved before it, as after torch's step): no write of torch code."""
        self._seen += count

    def new(self) -> bool:
        """Whether a parameter was written through since the last call (then ``edited`` is set)."""
        count = self._count()
        if count == self._seen:
            return False
        self._seen = count
        self.edited = True
        return True
