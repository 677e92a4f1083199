"""The backward half of the engine's module hooks (a base class of
:class:`gemini.engine.hooks.ModuleHooks`, using its residency, manager and bookkeeping): when a
backward pass begins and ends, and each parameter's gradient moved into its chunk."""

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
    # Not every autograd graph task through the model is the iteration's backward:
    # ``torch.autograd.grad(out, x)`` (a saliency map; an input-gradient penalty with
    # create_graph=True) and ``backward(inputs=[x])`` compute gradients of inputs and none of a
    # parameter (``torch.autograd.grad(loss, params)`` does: its gradients go to p.grad by hand).
    # Such a task reads the parameters all the same (the pre-backward hooks fetch them, its end
    # releases them), but it is no backward pass: no p.grad is armed
    # or exposed, no gradient moves, neither fp16's scaled count nor auto's warm-up counts it,
    # and auto's iteration goes on. Taken for the pass, it armed p.grad for nothing, fp16 then
    # refused the step (a second, unscaled pass), and the real backward after it was no longer
    # the pass. (Under create_graph its groups are held past its end: [Note: parameters a
    # create_graph pass saved] in residency.py.) Whether the running task will accumulate, torch
    # says node by node: the graph's AccumulateGrad nodes of parameters are asked at the first hook
    # of each task, until one says yes (a few nodes from the loss in an ordinary backward; the
    # task's id spares its later hooks even that; see [Note: the graph's own gradient
    # accumulators] in backward_uses.py). A task nested in one that accumulates nothing (reentrant
    # checkpointing runs a segment's backward inside the outer task) that does accumulate makes
    # the outer pass the iteration's backward: its end callback is queued already.
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
    # Torch runs a parameter's post-accumulate-grad hooks in the order they were registered, and
    # the engine's (_on_grad, registered by initialize) moves the gradient into its chunk and sets
    # ``p.grad = None`` (where autograd does not accumulate into the chunk): a hook the user
    # registered after initialize (a per-parameter optimizer, a gradient logger, a hook scaling
    # ``p.grad`` in place) found None. So each pass puts the engine's hook after every other
    # (torch keeps them in a dict the C++ side walks): theirs see and may
    # change the accumulated gradient, as in plain torch, before it goes into the chunk.
    # Their hooks see the gradient accumulated since zero_grad, as torch's do: where an earlier
    # pass of the step left one in the chunk (micro-batches) and ``p.grad`` is not the chunk's
    # view (the engine moves chunks, and took the gradient out of p.grad), a copy of it goes into
    # ``p.grad`` for autograd to add onto, and the chunk's slot takes the sum, not another
    # addition. Not under ZeRO, whose slots hold the reduced gradient of the ranks. The copy is
    # made as the parameter's gradient arrives (``_grad_arriving``), on the gradient's device,
    # and goes into the chunk right after the hooks: copied for every parameter as the pass
    # began, the copies held a whole gradient beside the chunks, which no trace had seen (the
    # warm-up traces the first micro-batch), so under auto with a budget the second micro-batch
    # went over it, at every budget with gpu_margin_mem_ratio=1.
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
    # On a GPU a parameter between its uses lies on the host (its ``.data`` a CPU tensor), so a
    # tensor put in ``p.grad`` then (``p.grad = torch.full_like(p, ...)``, or the step's gradient
    # so far that _hooked_grads_accumulated gives the user's hooks) is on the CPU, while the
    # backward computes the gradient on the GPU, where the parameter was fetched: autograd's
    # accumulation raised torch's device mismatch. Just before autograd adds onto it, the held
    # tensor follows the gradient to its device. (The CPU stand-in has one device: nothing moves.)
    def _grad_arriving(self, param_ref: weakref.ref, grad: torch.Tensor) -> None:
        # A graph over the parameters themselves (a penalty ``sum(p.pow(2))`` backpropagated on its
        # own) reaches no module's output, whose hook announces a pass: announced here, before
        # autograd accumulates, the exposed views are withdrawn first (accumulated into, they were
        # taken for gradients torch code replaced, and the pass was never counted). The
        # parameters' data stays as the graph read it: see [Note: a pass begun inside its graph]
        # in grad_views.py.
        if torch._C._current_graph_task_id() != self._task_seen:
            self._begin_backward_pass(at_gradient=True)
        param = param_ref()
        if param is not None and param in self._to_preload:
            self._preload(param, grad)
        elif self._devices_differ and param is not None:
            held = param.grad
            if held is not None and held.device != grad.device:
                param.grad = held.to(grad.device)

    def _computes_parameter_gradients(self) -> bool:
        """Whether the running graph task will compute a gradient of a trainable parameter (see
        [Note: the graph's own gradient accumulators] in gemini/engine/backward_uses.py)."""
        return task_computes_gradient_of([p for group in self.manager.trainable_groups for p in group.params])

    # [Note: a backward pass that raised]
    # Autograd runs a queued callback only when its graph task completes: when the backward
    # raises (a user's autograd Function, an anomaly check, an out-of-memory), the end of the
    # backward never comes. Left so, no later pass queued its own end (p.grad stayed None and
    # torch's clip_grad_norm_ clipped nothing, fp16 and auto's warm-up counted no more passes)
    # and the groups fetched for that backward stayed held. torch recovers with zero_grad() and
    # the next batch, so the engine ends the broken pass at the first call that can only come
    # after it: the next forward, zero_grad() or step(), outside any backward. The pass counts
    # as one: under fp16 it went through optimizer.backward, which counted it as scaled. The
    # iteration it belonged to is given up, and with it the graphs its create_graph passes made:
    # the groups held for them go (see [Note: parameters a create_graph pass saved]).
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
            # Autograd added it into the chunk: nothing to move, no decision to mark (see [Note:
            # autograd accumulates into the chunks] in gemini/engine/grad_views.py).
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
                # a gradient computed where the parameter lay (on the host, read outside its
                # module's call) onto the buffer on the device, or the other way; blocking: a
                # non-blocking copy to the host is not there yet when add_ reads it
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
    # Where moves drop a parameter's gradient accumulator (a GPU's), a parameter read both inside
    # its module's call (the device copy) and outside it (the host copy, between its uses: a
    # penalty over the parameters in the loss) gets two gradients in one pass, one per
    # accumulator, where one forward made the graph. The warm-up read it on the host outside,
    # which no measurement saw; later iterations, keeping it on the device, computed the
    # penalty's temporaries there (a whole copy of the parameters: every second step of a
    # 2-layer GPT refused by the budget, 1,155,536 bytes against the warm-up's 823,984). Such a
    # group is read outside its modules ([Note: parameters read outside their modules] in
    # gemini/policies/auto.py): later iterations drop it after each use, as the warm-up did.
    # Two forwards before one backward also give two gradients a pass, and so does a module called
    # twice whose group was fetched again between the calls (each fetch a new accumulator): those
    # are no reads outside, and dropping such a group after each use fetched it once more a pass
    # (12 fetches a step where 8 do, tests/test_budget_promise.py). So only a pass in which one
    # of the parameter's gradients arrived while its group was on the host only (the penalty's
    # branch, which autograd runs before the modules' backward fetch the group) counts.

    def _count_grad(self, group: ChunkGroup) -> None:
        """One more of ``group``'s gradients is in; after the last, the group's backward is over."""
        group.grads_this_backward += 1
        if group.grads_this_backward == len(group.slots):
            group.grads_this_backward = 0
            self.residency.after_backward(group)

    # [Note: a group released before all its gradients]
    # A group's backward is over when each of its parameters has its gradient (_count_grad), or
    # when the calls that fetched it for backward are all done (its release, [Note: a group
    # between its uses in backward] in gemini/engine/residency.py). A group holding a parameter
    # that gets no gradient in a pass (a submodule the forward skipped, a pooler a loss ignores,
    # one left out of ``backward(inputs=...)``) beside ones that do was released by its last call
    # and so was never closed: its gradients stayed on the device while its parameters went back
    # to the host, so ``p.grad`` raised "not beside its parameter" until the step, and with it
    # torch's clip_grad_norm_. Every group with gradients of the pass is closed at its end.
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
