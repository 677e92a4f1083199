"""Hooks on the autograd node that receives a tensor's gradient, which in-place ops on the tensor
keep: the period hooks (tracer/hooks.py) announce a call's backward with them, the engine follows
each call through backward with them (gemini/engine/backward_uses.py).

[Note: a call's outputs hooked through in-place ops]
A call's backward begins when the first gradient of its outputs arrives. Hooks on the output
tensors themselves (``register_multi_grad_hook``, ``Tensor.register_hook``) are lost when an
output that is a view is modified in place: autograd rebases the view onto its base's new history
and drops the view's tensor hooks. A Linear on a 3-D input returns a view (``addmm`` then
``view``), so ``nn.ReLU(inplace=True)`` after it, or a residual ``out = self.proj(h); out += h``,
left its pre-backward hook unfired: the engine never fetched its parameters for backward (and
backward read freed storage: "setStorage: ... storage of size 0"), and the period hooks announced
no backward period for it (a coarser plan under auto). So the hook goes on the autograd node that
receives each output's gradient, as that node is when the call returns, which no later in-place
op takes out of the graph: an in-place op puts its own node in front of it. For a view that is
its base's node: every gradient of a view flows into its base's history (through a
``CopySlices`` once the view is modified in place), while the view's own ``ViewBackward`` node
is dropped from the graph by the rebase. The node runs once per graph task; the first of a
call's nodes to run fires the hook, once per task (as ``register_multi_grad_hook``'s mode "any"
did). A leaf (an output that is a parameter or an input) keeps a tensor hook: a leaf's gradient
accumulator is held weakly until a graph uses it, and the node ``get_gradient_edge`` makes for a
leaf no graph uses yet is gone with its hooks by then; a leaf is never a view modified in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

__all__ = ["gradient_node", "hook_each", "hook_first_grad", "node_key", "unbatched"]


def gradient_node(t: torch.Tensor) -> Node:
    """The node whose run means ``t``'s gradient arrives, kept through in-place ops on ``t``
    (see [Note: a call's outputs hooked through in-place ops]); ``t`` is no leaf."""
    if t._is_view() and t._base.grad_fn is not None:
        return t._base.grad_fn
    return t.grad_fn


def node_key(node: Node) -> tuple[str, int]:
    """Who ``node`` is, comparable after its Python object is gone. Before torch 2.12 the object
    that ``t.grad_fn`` returns lives only as long as a Python reference to it: ``id()`` of one
    that was let go says nothing of the next (two ids of one node differed, and the period hooks
    of a model and its head, which share an output, no longer merged into one). The sequence
    number autograd gave the node when the forward made it tells it apart from every other node
    that thread made."""
    return type(node).__name__, node._sequence_nr()


def hook_each(tensors: list[torch.Tensor], make: Callable[[int], Callable]) -> list[RemovableHandle]:
    """``make(n)(...)`` as a hook on the node receiving the gradient of each of ``tensors`` (its
    ``n`` distinct nodes), or on the tensor itself for a leaf (see [Note: a call's outputs hooked
    through in-place ops]); the hooks' handles."""
    nodes = {gradient_node(t) for t in tensors if t.grad_fn is not None}
    leaves = [t for t in tensors if t.grad_fn is None]
    hook = make(len(nodes) + len(leaves))
    return [node.register_prehook(hook) for node in nodes] + [t.register_hook(hook) for t in leaves]


# [Note: outputs of a call under vmap]
# Inside ``torch.func.vmap`` a call's outputs are batched wrappers, with no ``grad_fn`` of their
# own, and they say they need no gradient: the graph the backward after the vmap runs is the
# wrapped tensors'. So no call's backward began: the engine never fetched its groups back and
# backward read freed storage ("setStorage: ... storage of size 0"), the period hooks announced
# nothing. The hooks go on the wrapped tensors' nodes.
def unbatched(values: list) -> list:
    """``values`` with vmap's batched wrappers replaced by the tensors they wrap (see [Note:
    outputs of a call under vmap]); one C call outside functorch's transforms."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return values
    out = []
    for t in values:
        while isinstance(t, torch.Tensor) and torch._C._functorch.is_batchedtensor(t):
            t = torch._C._functorch.get_unwrapped(t)
        out.append(t)
    return out


def hook_first_grad(tensors: list[torch.Tensor], hook: Callable[[], None]) -> list[RemovableHandle]:
    """``hook()`` once per graph task, when the first gradient of ``tensors`` (all needing one)
    arrives (see [Note: a call's outputs hooked through in-place ops]); the hooks' handles."""
    last_task = [None]

    def first(_grad) -> None:
        task = torch._C._current_graph_task_id()
        if last_task[0] != task:
            last_task[0] = task
            hook()

    return hook_each(tensors, lambda n: first)
