"""The backward half of the engine's module hooks: when a backward pass begins and ends, and moving each parameter's
gradient into its chunk. A base class of :class:`gemini.engine.hooks.ModuleHooks`, using its residency, manager and
bookkeeping."""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from chunks import ChunkGroup, ChunkState, Tier
from gemini.engine.backward_uses import BackwardUse, task_computes_gradient_of
from offload.profiling import trace_range

logger = logging.getLogger(__name__)

__all__ = ["BackwardHooks"]


class BackwardHooks:
    """Gradient and backward-pass hooks: see :class:`gemini.engine.hooks.ModuleHooks`."""

    # [Note: a graph task that accumulates no parameter gradient]
    # Not every graph task through the model is the iteration's backward: ``torch.autograd.grad(out, x)`` (a saliency
    # map, an input-gradient penalty) and ``backward(inputs=[x])`` compute input gradients only. Such a task reads the
    # parameters (the pre-backward hooks fetch them, its end releases them) but is no backward pass: no p.grad is
    # armed or exposed, no gradient moves, fp16's scaled count and auto's warm-up ignore it, and auto's iteration goes
    # on. Taken for the pass, it would make fp16 refuse the step, and the real backward after it would not be the
    # pass. (Under create_graph its groups are held past its end: [Note: parameters a create_graph pass saved] in
    # residency.py.) At the first hook of each task the graph's AccumulateGrad nodes of parameters are asked whether
    # they will run, until one says yes (see [Note: the graph's own gradient accumulators] in backward_uses.py). A
    # nested task that accumulates (reentrant checkpointing) inside one that does not makes the outer pass the
    # iteration's backward: its end callback is queued already.
    def _begin_backward_pass(self, *, at_gradient: bool = False) -> None:
        task = torch._C._current_graph_task_id()
        if task == self._task_seen:
            return
        self._task_seen = task
        if self._backward_task is None:
            self._backward_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if not self._iteration_pass and self._computes_parameter_gradients():
            self._iteration_pass = True
            self._grad_hooks_last()
            self._on_backward_begin(keep_data=at_gradient)
            self._hooked_grads_accumulated()

    # [Note: the user's post-accumulate hooks]
    # Torch runs post-accumulate-grad hooks in registration order, and the engine's (_on_grad) moves the gradient
    # into its chunk and sets ``p.grad = None``, so a user's hook registered after initialize would find None. Each
    # pass therefore moves the engine's hook last (in the plain dict the C++ side walks). Those hooks must see the
    # gradient accumulated since zero_grad: where an earlier micro-batch left one in the chunk, a copy of it goes
    # into ``p.grad`` for autograd to add onto, and the slot takes the sum (not under ZeRO: slots hold the ranks'
    # reduced gradient). The copy is made per parameter as its gradient arrives (_grad_arriving), not for all at
    # the pass's start: those copies would hold a whole gradient the warm-up never traced (over auto's budget).
    def _grad_hooks_last(self) -> None:
        for p, key in self._grad_hooks:
            hooks = p._post_accumulate_grad_hooks
            if key in hooks and next(reversed(hooks)) != key:
                hooks[key] = hooks.pop(key)  # not move_to_end: the C++ side walks the plain dict's order

    def _hooked_grads_accumulated(self) -> None:
        """The parameters whose ``p.grad`` gets the step's gradient so far as this pass's arrives."""
        if self.residency.reducer is not None:
            return
        for p, _ in self._grad_hooks:
            if len(p._post_accumulate_grad_hooks) < 2 or p.grad is not None:
                continue  # no hook of the user's, or p.grad is the chunk's view (accumulated into)
            group, slot = self.manager.locate(p)
            if group.grad_ready[slot.index]:
                self._to_preload.add(p)

    @torch.no_grad()
    def _preload(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        self._to_preload.discard(param)  # once a pass: a second accumulator's gradient adds in _on_grad
        group, slot = self.manager.locate(param)
        if param.grad is None and group.grad_ready[slot.index] and group.grad.state is not ChunkState.RELEASED:
            param.grad = group.grad.flat_view(slot).view(slot.shape).to(grad.device, param.dtype, copy=True)
            self._preloaded.add(param)

    # [Note: a p.grad on another device than its gradient]
    # On a GPU a parameter between its uses lies on the host, so a tensor put in ``p.grad`` then (by the user, or
    # the preloaded gradient of _hooked_grads_accumulated) is on the CPU, while backward computes the gradient on the
    # GPU: autograd's accumulation would raise a device mismatch. So just before autograd adds onto it, the held
    # tensor follows the gradient to its device. (The CPU stand-in has one device: nothing moves.)
    def _grad_arriving(self, param_ref: weakref.ref, grad: torch.Tensor) -> None:
        # A graph over the parameters themselves (a penalty ``sum(p.pow(2))`` backpropagated alone) reaches no
        # module's output, whose hook announces a pass: it is announced here, before autograd accumulates, so the
        # exposed views are withdrawn first (otherwise autograd accumulates into them and the pass is never counted).
        # The parameters' data stays as the graph read it: see [Note: a pass begun inside its graph] in grad_views.py.
        param = param_ref()
        if grad.layout is not torch.strided and param is not None:  # before autograd accumulates it anywhere
            raise RuntimeError(
                f"gemini: the gradient of {self.manager.locate(param)[1].name} is {grad.layout} (F.embedding(..., "
                f"sparse=True) makes one): gemini's chunks, like torch's Adam, hold dense gradients only; pass "
                f"sparse=False")
        if torch._C._current_graph_task_id() != self._task_seen:
            self._begin_backward_pass(at_gradient=True)
        if param is not None and param in self._to_preload:
            self._preload(param, grad)
        elif self._devices_differ and param is not None:
            held = param.grad
            if held is not None and held.device != grad.device:
                param.grad = held.to(grad.device)

    def _computes_parameter_gradients(self) -> bool:
        """Whether the running graph task will compute a gradient of a trainable parameter.

        [Note: the graph's own gradient accumulators] in gemini/engine/backward_uses.py says how."""
        return task_computes_gradient_of([p for group in self.manager.trainable_groups for p in group.params])

    # [Note: a backward pass that raised]
    # Autograd runs a queued callback only when its graph task completes, so when backward raises (a user's autograd
    # Function, an anomaly check, an OOM) the end of backward never comes: no later pass would queue its own end
    # (p.grad stays None, fp16 and auto's warm-up count no more passes) and the groups fetched for it stay held. Torch
    # recovers with zero_grad() and the next batch, so the engine ends the broken pass at the first call that can only
    # come after it: the next forward, zero_grad() or step(), outside any backward. It counts as one pass (under fp16
    # optimizer.backward counted it as scaled). Its iteration is given up, with the groups held for its create_graph
    # graphs (see [Note: parameters a create_graph pass saved]).
    @property
    def backward_aborted(self) -> bool:
        """A backward pass raised and was not ended yet (see [Note: a backward pass that raised])."""
        return self._backward_task is not None and torch._C._current_graph_task_id() == -1

    def end_aborted_backward(self) -> None:
        """End a backward pass that raised (see [Note: a backward pass that raised])."""
        if self.backward_aborted:
            logger.info("a backward pass raised before it ended: closing it")
            self._end_of_backward()
            self.residency.release_held()

    def _pre_backward(self, groups: list[ChunkGroup], use: BackwardUse | None) -> None:
        with self._phase("gemini::pre_backward"):
            self._begin_backward_pass()
            if use is not None:
                use.begin()
            self.residency.before_backward(groups)
            if torch.is_grad_enabled():  # create_graph=True: the graph it makes saves the parameters
                self.residency.hold(groups)

    def _on_grad(self, param: nn.Parameter) -> None:
        """Move ``param``'s freshly accumulated gradient into its gradient chunk."""
        if self._accumulated_in_place(param):
            # Autograd added it into the chunk: nothing to move, no decision to mark (see [Note: autograd accumulates
            # into the chunks] in gemini/engine/grad_views.py).
            group, slot = self.manager.locate(param)
            group.grad_ready[slot.index] = True
            self._count_grad(group)
            return
        # p.grad holds the step's gradient so far: see [Note: the user's post-accumulate hooks]
        preloaded = param in self._preloaded
        self._preloaded.discard(param)
        if param.grad is None:  # a hook of the user's before this one dropped it: no gradient, as in torch
            if preloaded:  # the step's so far included
                group, slot = self.manager.locate(param)
                group.grad_ready[slot.index] = False
            return
        with self._phase("gemini::grad_to_chunk"):
            group, slot = self.manager.locate(param)
            if param.grad.requires_grad:
                param.grad = None  # not left for the next pass to accumulate onto
                raise RuntimeError(
                    f"gemini: backward(create_graph=True) made the gradient of {slot.name} part of an autograd "
                    f"graph (a higher-order gradient through the parameters). Gradients live in gemini's chunks, "
                    f"which hold values only: higher-order gradients through parameters are not supported. "
                    f"Input-gradient penalties are (WGAN-GP, R1): compute them with torch.autograd.grad(outputs, "
                    f"inputs=<the inputs>, create_graph=True) and backward the loss with the penalty added.")
            outside = not group.param.is_on(Tier.DEVICE)  # read on the host: see [Note: read twice]
            if group.grads_this_backward == 0:
                self.residency.mark()  # the group's first gradient of this backward
            grad = self.residency.grad_buffer(group)
            dst = grad.flat_view(slot)
            src = param.grad.reshape(-1)
            if group.grad_ready[slot.index] and not preloaded:
                # A gradient computed where the parameter lay (on the host, read outside its module's call) onto
                # the device buffer, or the other way. Blocking: a non-blocking copy to the host is not there yet
                # when add_ reads it.
                dst.add_(src.to(dst.device) if src.device != dst.device else src)
                earlier = self._arrived.get(param)  # None: none of this pass yet ([Note: read twice])
                if earlier is not None and (earlier or outside) and self._graph_forwards == 1:
                    self.residency.policy.read_outside(group.index)
            else:
                dst.copy_(src)
                group.grad_ready[slot.index] = True
            param.grad = None
            self._arrived[param] = self._arrived.get(param, False) or outside
            self._count_grad(group)

    # [Note: read twice]
    # Where moves drop gradient accumulators (a GPU), a parameter read both inside its module's call (the device copy)
    # and outside it (the host copy between uses, e.g. a penalty over the parameters in the loss) gets two gradients
    # in one pass, one per accumulator. The warm-up read it on the host, unmeasured; later iterations keeping it on
    # the device would compute the penalty's temporaries there, over budget. So such a group counts as read outside
    # its modules ([Note: parameters read outside their modules] in gemini/policies/auto.py) and later iterations drop
    # it after each use, as the warm-up did. Two forwards before one backward, or a module called twice with its group
    # fetched again in between, also give two gradients (one per accumulator) but are no outside reads, and dropping
    # those groups would cost extra fetches. So only a gradient that arrived while its group was on the host only (the
    # penalty's branch, which autograd runs before the modules' backward fetch) counts, with one forward per pass.

    def _count_grad(self, group: ChunkGroup) -> None:
        """One more of ``group``'s gradients is in; after the last, the group's backward is over."""
        group.grads_this_backward += 1
        if group.grads_this_backward == len(group.slots):
            group.grads_this_backward = 0
            self.residency.after_backward(group)

    # [Note: a group released before all its gradients]
    # A group's backward is over when each of its parameters has its gradient (_count_grad), or when the calls that
    # fetched it for backward are all done (its release, [Note: a group between its uses in backward] in
    # gemini/engine/residency.py). A group with a parameter that gets no gradient in a pass (a skipped submodule, a
    # pooler the loss ignores, one left out of ``backward(inputs=...)``) beside ones that do is released by its last
    # call but never closed: its gradients would stay on the device while its parameters go back to the host, and
    # ``p.grad`` (so clip_grad_norm_) raises "not beside its parameter". So every group with gradients of the pass
    # is closed at its end.
    def _end_of_backward(self) -> None:
        """Close chunk groups whose parameters got no gradient (unused or frozen)."""
        with trace_range("gemini::end_of_backward"):
            self._backward_task = None
            if not self._iteration_pass:  # see [Note: a graph task that accumulates no parameter gradient]
                self.residency.end_backward(iteration=False)
                return
            self._iteration_pass = False
            self._preloaded.clear()
            self._to_preload.clear()
            self._arrived.clear()
            self._graph_forwards = 0
            self.backward_passes += 1
            for group in self.residency.groups_fetched_for_backward():
                group.grads_this_backward = 0
                self.residency.after_backward(group)
            for group in self.manager.trainable_groups:
                if group.grads_this_backward:  # see [Note: a group released before all its gradients]
                    group.grads_this_backward = 0
                    self.residency.after_backward(group)
            self.residency.end_backward()
            self._on_backward_end()
