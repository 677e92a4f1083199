"""Module and gradient hooks: chunks resident before compute, gradients into chunk storage.

Only real PyTorch hooks are used: forward pre/post hooks on every module that owns
parameters, a multi-grad hook on each module's outputs as its pre-backward hook, a
post-accumulate-grad hook on every trainable parameter, and an autograd-engine callback at
the end of each backward pass.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from chunks import ChunkGroup, ChunkManager
from gemini.memory import DeviceBudgetError
from gemini.placement import PlacementPolicy

logger = logging.getLogger(__name__)

__all__ = ["ModuleHooks"]


class ModuleHooks:
    """Installs and owns the hooks that drive chunk movement for one module tree."""

    def __init__(
        self,
        module: nn.Module,
        manager: ChunkManager,
        placement: PlacementPolicy,
        *,
        on_root_forward: Callable[[tuple, dict], None],
        on_budget_error: Callable[[], None],
        on_backward_begin: Callable[[], None] = lambda: None,
        on_backward_end: Callable[[], None] = lambda: None,
    ) -> None:
        self.manager = manager
        self.placement = placement
        self._on_budget_error = on_budget_error
        self._on_backward_begin = on_backward_begin
        self._on_backward_end = on_backward_end
        self._handles: list = []
        self._backward_queued = False
        # Backward passes that ran to completion (the optimizer checks fp16 ones were scaled).
        self.backward_passes = 0
        # Registered first, so the root's pre-hook runs before (and its post-hook before)
        # the root's own chunk hooks.
        # Forward hooks are never traced by torch.compile: see [Note: hooks under torch.compile].
        root_pre = torch._disable_dynamo(lambda m, args, kwargs: on_root_forward(args, kwargs))
        self._handles.append(module.register_forward_pre_hook(root_pre, with_kwargs=True))
        # always_call: the post-hooks run even when the forward raises, so every module entered
        # is left again. Non-reentrant activation checkpointing stops its recompute with an
        # exception (_StopRecomputationError) inside the last module it needs; without this,
        # that module's compute references leaked, one per iteration, and its chunks could
        # never be evicted again.
        self._handles.append(module.register_forward_hook(self._root_post_forward, always_call=True))
        for sub in module.modules():
            groups = manager.groups_of(sub.parameters(recurse=False))
            if not groups:
                continue
            placement.count_uses(groups)
            self._handles.append(sub.register_forward_pre_hook(functools.partial(self._pre_forward, groups)))
            self._handles.append(sub.register_forward_hook(functools.partial(self._post_forward, groups),
                                                           always_call=True))
        for group in manager.trainable_groups:
            for p in group.params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def _phase(self, name: str):
        with torch.profiler.record_function(name):
            try:
                yield
            except DeviceBudgetError:
                self._on_budget_error()
                raise

    # --------------------------------------------------------------------------- forward
    # [Note: hooks under torch.compile]
    # The forward hooks move chunks and re-point parameters (``p.data = view``) and read the
    # placement's Python state (use counts, plans). Traced by dynamo inside a compiled model,
    # ``p.data = ...`` became an input mutation (``set_``) of the graph that bumps the
    # parameter's version counter, so autograd found the tensors saved for backward "modified
    # by an inplace operation", and every change of that Python state failed a guard and
    # compiled the frame again, until the recompile limit. So these hooks (and the period
    # hooks of tracer/hooks.py) are never traced: each is a graph break and runs eagerly
    # between the compiled graphs. ``torch._disable_dynamo`` is ``torch.compiler.disable``
    # importing dynamo at the first call rather than at ``import gemini`` (2 s; torch.optim
    # uses it the same way, and imports dynamo in ``initialize`` anyway). Backward hooks run
    # in the autograd engine, outside any compiled frame. See the README's "torch.compile".
    @torch._disable_dynamo
    def _pre_forward(self, groups: list[ChunkGroup], module: nn.Module, args) -> None:
        with self._phase("gemini::pre_forward"):
            self.placement.before_compute(groups)
            # This module's backward is done once its inputs' gradients are (see [Note: a group
            # between its uses in backward]); a recompute's inputs never get gradients.
            if torch._C._current_graph_task_id() == -1 and self.placement.track_backward_uses(groups):
                self._hook_grads_of(args, functools.partial(self._backward_use_done, groups), mode="all")

    def _backward_use_done(self, groups: list[ChunkGroup], grads) -> None:
        with self._phase("gemini::backward_use_done"):
            self.placement.backward_use_done(groups)

    @torch._disable_dynamo
    def _post_forward(self, groups: list[ChunkGroup], module: nn.Module, args, output):
        with torch.profiler.record_function("gemini::post_forward"):
            self.placement.after_compute(groups)
            self._hook_grads_of(output, functools.partial(self._pre_backward, groups))
        return None

    @torch._disable_dynamo
    def _root_post_forward(self, module: nn.Module, args, output) -> None:
        self.placement.end_forward()
        # The root's outputs get their gradients before any parameter of the model does (a
        # parameter's gradient flows through them), so the backward pass begins here: the
        # gradient views are withdrawn before autograd could accumulate into one.
        self._hook_grads_of(output, lambda grad: self._begin_backward_pass())

    @staticmethod
    def _hook_grads_of(tree, hook, *, mode: str = "any") -> None:
        """``hook`` on the gradients of the tensors in ``tree`` that need one (see
        ``torch.autograd.graph.register_multi_grad_hook`` for ``mode``)."""
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode=mode)

    # -------------------------------------------------------------------------- backward
    def _begin_backward_pass(self) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._on_backward_begin()

    def _pre_backward(self, groups: list[ChunkGroup], grad) -> None:
        with self._phase("gemini::pre_backward"):
            self._begin_backward_pass()
            self.placement.before_backward(groups)

    def _on_grad(self, param: nn.Parameter) -> None:
        """Move ``param``'s freshly accumulated gradient into its gradient chunk."""
        with self._phase("gemini::grad_to_chunk"):
            group, slot = self.manager.locate(param)
            grad = self.placement.grad_buffer(group)
            dst = grad.flat_view(slot)
            src = param.grad.reshape(-1)
            if group.grad_ready[slot.index]:
                dst.add_(src)  # accumulation over micro-batches
            else:
                dst.copy_(src)
                group.grad_ready[slot.index] = True
            param.grad = None
            group.grads_this_backward += 1
            if group.grads_this_backward == len(group.slots):
                group.grads_this_backward = 0
                self.placement.after_backward(group)

    def _end_of_backward(self) -> None:
        """Close chunk groups whose parameters got no gradient (unused or frozen)."""
        with torch.profiler.record_function("gemini::end_of_backward"):
            self._backward_queued = False
            self.backward_passes += 1
            for group in self.placement.groups_fetched_for_backward():
                group.grads_this_backward = 0
                self.placement.after_backward(group)
            self.placement.end_backward()
            for group in self.manager.trainable_groups:
                group.grads_this_backward = 0
            self._on_backward_end()
