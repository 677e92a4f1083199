"""``p.grad`` as views of the gradient chunks, so torch's own gradient tools see gemini's gradients.

[Note: gradients exposed as p.grad]
Gradients live in gradient chunks, not in ``p.grad`` (the hooks move each accumulated gradient into its slot and set
``p.grad = None``). Torch code reads and writes ``p.grad`` between backward and step (``clip_grad_norm_``,
``zero_grad()``, logging), so after each backward and each step every parameter with a gradient since ``zero_grad``
gets ``p.grad`` = a view of its slot:
- torch requires ``p.grad`` on ``p``'s device: when the gradient chunk is on the host and the parameter chunk also
  has a device copy, ``p.data`` points at the identical host copy while the views are out (:meth:`GradViews.hide`
  points it back). No byte moves.
- What torch does to the views is what the step sees: ``clip_grad_norm_`` scales the chunk in place, ``p.grad =
  None`` (``zero_grad``) forgets the gradient, ``p.grad.zero_()`` zeroes it, an assigned tensor replaces it.
  :meth:`GradViews.hide` reads those changes back.
- Where no view can be exact (fp16: loss-scaled; ZeRO: a rank holds 1/world of each reduced gradient), ``p.grad`` is
  an :class:`UnavailableGrad` with the right shape, dtype and device, so code that only looks works; any computation
  with it raises, naming ``model.clip_grad_norm_``.
- Views are withdrawn before the next forward or backward pass (autograd must not accumulate into them) and before
  the step moves chunks (no view outlives its payload), except under a policy that never moves a chunk (see
  [Note: autograd accumulates into the chunks]).

[Note: autograd accumulates into the chunks]
Under placement "cuda" (without ZeRO or fp16) a gradient chunk, once allocated, stays on the device. There, as a
backward pass begins, :meth:`GradViews.arm` puts each trainable parameter's slot view into ``p.grad`` (zeroed where
nothing accumulated since ``zero_grad``): autograd adds each new gradient into it in place, i.e. into the chunk, and
the gradient hook only marks the slot ready (no copy). A ``p.grad`` replaced in between (None or another tensor)
takes the copying path. Views are cached per parameter and payload, so arming and exposing allocate nothing.

[Note: a step that moves no chunk]
Before a step the views are read back and, in general, withdrawn, since the step may move their chunks. Under a
policy that never moves a chunk they stay valid: :meth:`GradViews.settle` reads them back but leaves untouched views
in ``p.grad``, and :meth:`GradViews.expose` after the step puts back only the changed ones. The step writes gradients
only in place (clipping), so a kept view reads what a fresh one would. If no view was touched, expose has nothing to
do: every ready gradient had its view out (each backward ends by exposing) and the step marks none ready; not so
under ZeRO (ranks agree on which gradients any rank has), so the engine settles only without ZeRO.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from chunks import Chunk, ChunkGroup, ChunkManager, ChunkState, Tier

__all__ = ["GradViews", "PendingGrad", "UnavailableGrad", "why_no_grad_views"]


def why_no_grad_views(*, zero_world: int | None, precision: str) -> str | None:
    """Why ``p.grad`` cannot be an exact view (ZeRO over ``zero_world`` ranks, fp16), with a {name} field; None
    where it can (see [Note: gradients exposed as p.grad])."""
    fix = "clip with model.clip_grad_norm_(max_norm) or GeminiConfig(clip_grad_norm=...)"
    if zero_world is not None:
        return (f"gemini: under ZeRO each rank keeps 1/{zero_world} of the reduced gradient of {{name}}, "
                f"so no whole p.grad exists; {fix}")
    if precision == "fp16":
        return f"gemini: under precision='fp16' the gradient of {{name}} is loss-scaled; {fix}"
    return None


class UnavailableGrad(torch.Tensor):
    """Stands in ``p.grad`` where no exact view of the gradient exists; any use raises."""

    reason: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, reason: str) -> UnavailableGrad:
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        t.reason = reason
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"UnavailableGrad(shape={tuple(self.shape)}, dtype={self.dtype}: {self.reason})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, UnavailableGrad):
                raise RuntimeError(f"{t.reason} (while calling {func})")
        raise RuntimeError(f"UnavailableGrad in {func}")


# Reads of a tensor's metadata, not of its values: a PendingGrad answers them without waiting.
_METADATA = frozenset({
    *(getattr(torch.Tensor, name).__get__ for name in ("shape", "dtype", "device", "ndim", "layout", "is_cuda",
                                                       "requires_grad", "is_leaf", "grad_fn")),
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.stride,
    torch.Tensor.element_size, torch.Tensor.is_contiguous, torch.Tensor.data_ptr, torch.Tensor.__len__,
})


class PendingGrad(torch.Tensor):
    """``p.grad``: a view of a host copy that a copy from the device may still be writing.

    [Note: gradients still crossing to the host]
    A group whose optimizer states live on the host sends its gradients there as its backward ends, asynchronously
    on a GPU ([Note: host groups updated as their gradients land] in gemini/optim/adam_batches.py). Plain views of
    those host copies would make ``backward()`` wait for every copy, so the step's CPU Adam could not overlap the
    GPU's backward. So ``p.grad`` is this alias of the view: it waits for its chunk's copy before the first torch
    function that touches it (a read, an in-place scaling, ``zero_grad``), then behaves as the plain view (results are
    plain tensors); metadata reads (``shape``, ``dtype``, ``numel()``) do not wait. Used only while a copy is in
    flight (never on the CPU stand-in, whose copies are synchronous); a loop that never reads ``p.grad`` waits in the
    step.
    """

    _chunk: Chunk | None

    @staticmethod
    def __new__(cls, view: torch.Tensor, chunk: Chunk) -> PendingGrad:
        t = torch.Tensor._make_subclass(cls, view)
        t._chunk = chunk
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for t in () if func in _METADATA else tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, PendingGrad) and t._chunk is not None:
                chunk, t._chunk = t._chunk, None
                chunk.wait_host()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class GradViews:
    """Puts views of the gradient chunks into ``p.grad`` and takes them back (see the module note)."""

    def __init__(self, manager: ChunkManager, *, unavailable_reason: str | None) -> None:
        self.manager = manager
        # Why no exact view exists (fp16, ZeRO), with a {name} field; None: views are exact.
        self._unavailable_reason = unavailable_reason
        # param -> (its group, its slot index, the tensor put into p.grad, the gradient's tier, where that tensor's
        # data was: ``p.grad.data = t`` keeps the object, see _untouched)
        self._out: dict[nn.Parameter, tuple[ChunkGroup, int, torch.Tensor, Tier | None, int | None]] = {}
        self._redirected: list[Chunk] = []  # param chunks whose params point at a non-primary copy
        # param -> (the gradient payload, the view of its slot in it): reused while the payload is
        self._views: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor]] = {}
        self._armed: dict[nn.Parameter, torch.Tensor] = {}  # put into p.grad by arm() for this backward
        self._settled = False  # settle() left untouched views in p.grad for expose() to keep
        self._settled_whole = False  # ... and every view was untouched: expose() has nothing to do

    def _view(self, g: ChunkGroup, slot, p: nn.Parameter, tier: Tier | None) -> torch.Tensor:
        payload = g.grad.payload(tier, wait=False)  # a view reads nothing: see PendingGrad
        cached = self._views.get(p)
        if cached is not None and cached[0] is payload:
            return cached[1]
        view = payload[slot.offset : slot.end].view(slot.shape)
        self._views[p] = (payload, view)
        return view

    def arm(self, buffer) -> None:
        """A backward pass begins under a policy that never moves a chunk: ``p.grad`` = the view of each trainable
        parameter's slot (``buffer(group)`` gives the group's gradient chunk on the device), zero where nothing has
        accumulated yet (see [Note: autograd accumulates into the chunks])."""
        self.hide()
        if self._unavailable_reason is not None:
            return
        self.adopt_assigned(buffer)  # a tensor the user put in p.grad: this backward adds onto it, as torch's
        with torch.no_grad():
            for g in self.manager.trainable_groups:
                grad = buffer(g)
                tier = grad.primary_tier
                ready = g.grad_ready
                any_ready = g.any_grad_ready
                if not any_ready:
                    grad.payload(tier).zero_()
                for slot, p in zip(g.slots, g.params):
                    if not p.requires_grad:
                        continue
                    view = self._view(g, slot, p, tier)
                    if any_ready and not ready[slot.index]:
                        view.zero_()
                    p.grad = view
                    self._armed[p] = view
                    self._out[p] = (g, slot.index, view, tier, view.data_ptr())

    def accumulated_in_place(self, p: nn.Parameter) -> bool:
        """Whether autograd added ``p``'s gradient straight into its slot (it is the armed view)."""
        armed = self._armed.get(p)
        return armed is not None and p.grad is armed

    def expose(self) -> None:
        """Every parameter with a gradient since zero_grad: ``p.grad`` = its gradient (after :meth:`settle`, only
        where it is not already there)."""
        settled, whole = self._settled, self._settled_whole
        self._settled = self._settled_whole = False
        if whole:
            return
        if not settled:
            self.hide()
        for g in self.manager.trainable_groups:
            if not g.any_grad_ready:
                continue
            reason = self._unavailable_reason
            tier = None
            if reason is None:
                tier = g.grad.primary_tier if g.grad.state is not ChunkState.RELEASED else None
                if tier is None or not g.param.is_on(tier):
                    reason = (f"gemini: the gradient of {{name}} is not beside its parameter (gradient chunk "
                              f"{g.grad.state.value}, parameter chunk {g.param.state.value})")
                elif g.param.primary_tier is not tier:
                    self._redirect(g, tier)
            for slot, p in zip(g.slots, g.params):
                if not g.grad_ready[slot.index]:
                    continue
                out = self._out.get(p)
                if (out is not None and _untouched(p, out)
                        and (reason is not None or out[2] is self._view(g, slot, p, tier))):
                    continue  # settled: its gradient is still there
                if reason is not None:
                    grad = UnavailableGrad(p, reason.format(name=slot.name))
                elif g.grad.copy_in_flight(tier):  # see [Note: gradients still crossing to the host]
                    grad = PendingGrad(self._view(g, slot, p, tier), g.grad)
                else:
                    grad = self._view(g, slot, p, tier)
                p.grad = grad
                self._out[p] = (g, slot.index, grad, tier, None if reason is not None else grad.data_ptr())

    def _redirect(self, g: ChunkGroup, tier) -> None:
        g.param.keep_edits(g.param.primary_tier)  # the copy the parameters will view has them too
        for slot, p in zip(g.param.slots, g.params):
            p.data = g.param.view(slot, tier)
        self._redirected.append(g.param)

    def settle(self) -> None:
        """Read back what torch code did to ``p.grad``, as :meth:`hide` does, but leave every untouched view in
        place: for a step that moves no chunk and marks no gradient ready, after which :meth:`expose` has only the
        changed ones to put back, or none (see [Note: a step that moves no chunk])."""
        if self._redirected:  # p.data points at another copy: that must end before the step
            self.hide()
            return
        if all(_untouched(p, out) for p, out in self._out.items()):  # the common case, hide's loop without its work
            self._armed.clear()
            self._settled = self._settled_whole = True
            return
        out = len(self._out)
        self.hide(keep_untouched=True)
        self._settled = True
        self._settled_whole = len(self._out) == out

    def hide(self, *, keep_untouched: bool = False, keep_data: bool = False) -> None:
        """Take the views back, keeping what was done to them (see the module note); ``keep_data``: the parameters
        pointed at another copy stay so until the next hide (see [Note: a pass begun inside its graph])."""
        refused = []
        kept = {}
        for p, out in self._out.items():
            g, index, grad, tier, _ = out
            now = p.grad
            if _untouched(p, out):
                if keep_untouched:
                    kept[p] = out
                else:
                    p.grad = None
                continue
            p.grad = None
            if p in self._armed:  # replaced while armed: the copying path took the gradient
                continue
            if now is None:
                self._forget(g, index)
            elif isinstance(grad, UnavailableGrad):
                refused.append(f"{g.slots[index].name}: {grad.reason}")
            else:  # assigned (to p.grad, or to its .data): it replaces the gradient
                g.grad.flat_view(g.slots[index], tier).copy_(now.reshape(-1))
                self._views.pop(p, None)  # a view whose .data was assigned views the slot no more
        self._out.clear()
        self._out.update(kept)
        self._armed.clear()
        if not keep_data:
            self._end_redirects()
        if refused:
            raise RuntimeError("gemini: tensors were assigned to p.grad where gemini's gradient cannot be replaced "
                               "(it was kept): " + "; ".join(refused))

    # [Note: a pass begun inside its graph]
    # A graph over the parameters alone (a penalty ``sum(p.pow(2))`` backpropagated on its own) begins its pass at the
    # first parameter's gradient hook, after the graph was built. Where the views were out, some parameters pointed
    # at their gradients' copy (on a GPU, the host) when the penalty read them, and the graph saved them so. Pointing
    # them back to the device copy as the pass begins would change the device of saved tensors under autograd (a
    # device mismatch on a GPU). Such a pass leaves them as they are; the next hide (end of pass, next forward) ends it.
    def _end_redirects(self) -> None:
        """The parameters pointed at another copy than their chunk's primary one point back."""
        if self._redirected:  # a tensor assigned to p.data meanwhile goes into the chunk, not dropped
            self.manager.adopt_assigned()
        for chunk in self._redirected:
            chunk.keep_edits(Tier.HOST)  # written through the parameters while they viewed the host copy
            self.manager.repoint(chunk)
        self._redirected.clear()

    def clear(self, params: Iterable[nn.Parameter], *, set_to_none: bool) -> None:
        """``zero_grad``: forget every gradient (``params``' ``.grad`` too), or with ``set_to_none=False`` keep them
        as zeros, as torch does, so the views put back read zeros."""
        self.hide()
        if not set_to_none:
            with torch.no_grad():
                for g in self.manager.trainable_groups:
                    if g.any_grad_ready and g.step_grad.state is not ChunkState.RELEASED:
                        for tier in g.step_grad.tiers:
                            g.step_grad.payload(tier).zero_()
            self.expose()
            return
        for g in self.manager.trainable_groups:
            g.grad_ready = [False] * len(g.slots)
            g.grad_shard_filled = False
        for p in params:
            p.grad = None

    @torch.no_grad()
    def adopt_assigned(self, buffer) -> None:
        """Before a step, after :meth:`hide` or :meth:`settle`: a tensor assigned to ``p.grad`` of a parameter with
        no view out (no backward ran, or its gradient came from ``torch.autograd.grad``) is its gradient, as torch's
        step takes it; ``buffer(group)`` gives the group's gradient chunk to write it into."""
        for g in self.manager.trainable_groups:
            for slot, p in zip(g.slots, g.params):
                grad = p.grad
                if grad is None or p in self._out:
                    continue
                if self._unavailable_reason is not None:
                    raise RuntimeError("gemini: a tensor was assigned to p.grad where gemini's gradient cannot be "
                                       "replaced: " + self._unavailable_reason.format(name=slot.name))
                buffer(g).flat_view(slot).copy_(grad.reshape(-1))  # slots not ready are never read
                g.grad_ready[slot.index] = True
                p.grad = None
                self._settled_whole = False  # expose() puts it back as the view, as after a backward

    @staticmethod
    def _forget(g: ChunkGroup, index: int) -> None:
        """``p.grad = None`` for one parameter: it has no gradient until the next backward."""
        g.grad_ready[index] = False
        if g.grad_shard is not None and g.grad_shard.state is not ChunkState.RELEASED:
            # ZeRO: the reduced shard accumulates across backward passes; clear this tensor's pieces.
            for piece in g.os_slots:
                if piece.index == index:
                    for tier in g.grad_shard.tiers:
                        g.grad_shard.payload(tier)[piece.offset : piece.end].zero_()


def _untouched(p: nn.Parameter, out: tuple) -> bool:
    """Whether ``p.grad`` is still the tensor put there (``out``, an entry of ``GradViews._out``) viewing what it
    viewed: ``p.grad.data = t`` (an old idiom for scaling gradients) keeps the object but not its data."""
    return p.grad is out[2] and (out[4] is None or out[2].data_ptr() == out[4])
