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
    ) -> None:
        self.manager = manager
        self.placement = placement
        self._on_budget_error = on_budget_error
        self._handles: list = []
        self._backward_queued = False
        # Backward passes that ran to completion (the optimizer checks fp16 ones were scaled).
        self.backward_passes = 0
        # Registered first, so the root's pre-hook runs before (and its post-hook before)
        # the root's own chunk hooks.
        self._handles.append(
            module.register_forward_pre_hook(lambda m, args, kwargs: on_root_forward(args, kwargs), with_kwargs=True)
        )
        self._handles.append(module.register_forward_hook(lambda m, a, o: placement.end_forward()))
        for sub in module.modules():
            groups = manager.groups_of(sub.parameters(recurse=False))
            if not groups:
                continue
            placement.count_uses(groups)
            self._handles.append(sub.register_forward_pre_hook(functools.partial(self._pre_forward, groups)))
            self._handles.append(sub.register_forward_hook(functools.partial(self._post_forward, groups)))
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
    def _pre_forward(self, groups: list[ChunkGroup], module: nn.Module, args) -> None:
        with self._phase("gemini::pre_forward"):
            self.placement.before_compute(groups)

    def _post_forward(self, groups: list[ChunkGroup], module: nn.Module, args, output):
        with torch.profiler.record_function("gemini::post_forward"):
            self.placement.after_compute(groups)
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, functools.partial(self._pre_backward, groups), mode="any"
                    )
        return None

    # -------------------------------------------------------------------------- backward
    def _pre_backward(self, groups: list[ChunkGroup], grad) -> None:
        with self._phase("gemini::pre_backward"):
            if not self._backward_queued:
                self._backward_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
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
