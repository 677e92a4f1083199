"""Period boundaries of a module tree: where one period of an iteration ends and the next begins.

A new period begins

- before each module's forward (its forward pre-hook), in the forward pass;
- before each module's backward: when the first gradient of any of its outputs is ready
  (pre-hooks on the autograd nodes receiving the outputs' gradients, put there by the module's
  forward hook, which in-place ops on the outputs keep: see [Note: a call's outputs hooked
  through in-place ops] in tracer/grad_nodes.py);
- before each module's forward when it runs again inside the autograd engine, which is
  activation checkpointing's re-forward (``torch.utils.checkpoint``, non-reentrant).

The runtime tracer measures these periods during warm-up; the engine can install the same
hooks in later iterations to count periods in step with the trace.
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from tracer.grad_nodes import gradient_node, hook_first_grad, node_key, unbatched

logger = logging.getLogger(__name__)

__all__ = ["Boundary", "PeriodHooks", "Phase", "in_autograd_engine"]


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"  # a forward re-run inside backward (activation checkpointing)


@dataclass(frozen=True, kw_only=True)
class Boundary:
    """The start of a period: which module's forward, backward or recompute begins."""

    phase: Phase
    module_name: str
    module: nn.Module = field(compare=False, repr=False)


def in_autograd_engine() -> bool:
    """Whether this thread is running a graph task of the autograd engine (a backward)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(eq=False)
class _GradHook:
    """One hook on the gradients of a forward's outputs, announcing one or more backward periods."""

    handles: list[RemovableHandle]  # one per autograd node (or leaf) receiving an output's gradient
    outputs: tuple[weakref.ref, ...]
    nodes: tuple[tuple[str, int] | None, ...]  # node_key of the outputs' gradient nodes when hooked (None: a leaf)
    announces: tuple[tuple[str, nn.Module], ...]  # (module name, module), outermost first

    def guards(self, outputs: list[torch.Tensor], nodes: tuple[tuple[str, int] | None, ...]) -> bool:
        """Whether this hook sits on exactly these tensors (not on dead ones whose ids were
        reused) and their gradient nodes (not modified in place since: see [Note: shared
        outputs])."""
        return (len(outputs) == len(self.outputs) and all(r() is t for r, t in zip(self.outputs, outputs))
                and nodes == self.nodes)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class PeriodHooks:
    """Calls ``on_boundary(Boundary)`` at every period boundary of ``module`` and its children.

    ``install()`` registers the hooks (before any hook already there, so that at a shared
    boundary the period changes before other hooks of the same module act, such as an
    engine making chunks resident); ``remove()`` takes every one of them off again. Also a
    context manager. No forward method is replaced.
    """

    def __init__(self, module: nn.Module, on_boundary: Callable[[Boundary], None], *,
                 root_forward_hook: bool = True) -> None:
        """``root_forward_hook=False``: no forward pre-hook on ``module`` itself; its owner calls
        :meth:`root_forward` from a pre-hook of its own, once what must precede the root's
        boundary has run (see [Note: the root's boundary])."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not callable(on_boundary):
            raise TypeError(f"on_boundary must be callable, got {type(on_boundary).__name__} {on_boundary!r}")
        self._module = module
        self._on_boundary = on_boundary
        self._root_forward_hook = root_forward_hook
        self._module_handles: list[RemovableHandle] = []
        # Live gradient hooks by serial number; see [Note: pruning grad hooks].
        self._grad_hooks: dict[int, _GradHook] = {}
        self._serials = itertools.count()
        self._fired_ids: list[int] = []
        # This forward's hooks by the ids of the outputs they sit on; see [Note: shared outputs].
        self._by_outputs: dict[tuple[int, ...], int] = {}

    @property
    def installed(self) -> bool:
        return bool(self._module_handles)

    def install(self) -> None:
        if self.installed:
            raise RuntimeError(f"PeriodHooks on {type(self._module).__name__} are already installed")
        # named_modules() drops duplicates: a module reachable under two names is hooked
        # once and reported under its first name.
        for name, mod in self._module.named_modules():
            if mod is not self._module or self._root_forward_hook:
                self._module_handles.append(
                    mod.register_forward_pre_hook(functools.partial(self._forward_pre, name), prepend=True)
                )
            self._module_handles.append(
                mod.register_forward_hook(functools.partial(self._forward_post, name), prepend=True)
            )
        logger.debug("period hooks on %d modules of %s", len(self._module_handles) // 2, type(self._module).__name__)

    def remove(self) -> None:
        for handle in self._module_handles:
            handle.remove()
        self._module_handles.clear()
        for hook in self._grad_hooks.values():
            hook.remove()
        self._grad_hooks.clear()
        self._fired_ids.clear()
        self._by_outputs.clear()

    def __enter__(self) -> PeriodHooks:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # [Note: the root's boundary]
    # An engine that begins its warm-up trace in its own root pre-hook needs the root's
    # boundary to come after that, so that the trace's first period is the root's, in the
    # warm-up as in every later iteration (a boundary the trace missed would shift every
    # period after it). Hook order cannot promise that: these hooks are prepended, and may be
    # installed after the engine's. So such an engine installs these hooks without the root's
    # pre-hook and announces the root's forward itself.
    def root_forward(self) -> None:
        """The root module's forward begins (for ``root_forward_hook=False``; a no-op while
        the hooks are not installed)."""
        if self.installed:
            self._forward_pre("", self._module, ())

    # Run eagerly, never traced, inside a torch.compile'd model: the callback moves chunks and
    # reads Python state (see [Note: hooks under torch.compile] in gemini/engine/hooks.py).
    @torch._disable_dynamo
    def _forward_pre(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        phase = Phase.RECOMPUTE if in_autograd_engine() else Phase.FORWARD
        if phase is Phase.FORWARD and module is self._module:
            self._by_outputs.clear()  # a new forward: no output of the last one is shared
        self._on_boundary(Boundary(phase=phase, module_name=name, module=module))

    # [Note: shared outputs]
    # A module that returns its child's output unchanged (a Sequential and its last layer,
    # a model and its head, an attention block and its output projection) puts its hook on
    # the very tensor its child hooked a moment earlier. Hooks on one autograd node run in
    # registration order, child first, so the parent's backward period would begin after
    # the child's and swallow the child's backward: its chunks would look unused while
    # they are being used. So the parent takes the child's hook over: the old one is
    # removed and one hook announces the parent, then the child. Outputs that only partly
    # overlap keep separate hooks (and the child-first order), as do outputs the parent
    # modified in place (``nn.ReLU(inplace=True)`` returning its input): their gradient node
    # is then the in-place op's, which runs before the child's.

    @torch._disable_dynamo
    def _forward_post(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # A recomputed forward's outputs only feed the saved tensors of the original graph;
        # their gradients are never computed, so there is no backward to announce.
        if in_autograd_engine() or not torch.is_grad_enabled():
            return
        self._prune_fired()
        outputs = [t for t in unbatched(tree_leaves(output)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outputs:
            return
        key = tuple(id(t) for t in outputs)
        nodes = tuple(None if t.grad_fn is None else node_key(gradient_node(t)) for t in outputs)
        announces: tuple[tuple[str, nn.Module], ...] = ((name, module),)
        inner_serial = self._by_outputs.get(key, -1)
        inner = self._grad_hooks.get(inner_serial)
        if inner is not None and inner.guards(outputs, nodes):
            inner.remove()
            del self._grad_hooks[inner_serial]
            announces += inner.announces
        serial = next(self._serials)
        handles = hook_first_grad(outputs, functools.partial(self._backward_pre, serial, announces))
        self._grad_hooks[serial] = _GradHook(
            handles=handles, outputs=tuple(weakref.ref(t) for t in outputs), nodes=nodes, announces=announces
        )
        self._by_outputs[key] = serial

    def _backward_pre(self, serial: int, announces: tuple[tuple[str, nn.Module], ...]) -> None:
        self._fired_ids.append(serial)
        for name, module in announces:
            self._on_boundary(Boundary(phase=Phase.BACKWARD, module_name=name, module=module))

    # [Note: pruning grad hooks]
    # Every forward puts hooks on its outputs' gradient nodes. Kept forever, their handles would
    # pile up when the hooks stay installed across iterations; removed inside the hook, they
    # would mutate the node's hook dict while autograd iterates over it. So a hook that
    # has fired is removed at the next module forward outside backward. A retained graph
    # backwarded again before that announces its backward boundaries again (a real
    # backward); after it, it does not.
    def _prune_fired(self) -> None:
        for serial in self._fired_ids:
            hook = self._grad_hooks.pop(serial, None)
            if hook is not None:
                hook.remove()
        self._fired_ids.clear()
