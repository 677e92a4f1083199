"""Following one forward call of a module through backward: its backward *begins* when its outputs' gradients arrive
and is *done* when nothing of it is left to read its parameters (see
[Note: a group between its uses in backward] in gemini/engine/residency.py). Used by the module hooks
(gemini/engine/hooks.py) and the planner's meta-device replay (gemini/tools/meta_run.py).

[Note: several graph tasks through one forward]
One forward's graph may be run by several autograd graph tasks: an input-gradient penalty
(``torch.autograd.grad(out, x, create_graph=True)``, then the loss backward), a saliency map
(``torch.autograd.grad(loss, x, retain_graph=True)``, then ``loss.backward()``). Each task runs the backward of some
module calls again, so a call begins and is done once per task, and every count below starts over when a new task
reaches it. Counted across tasks, a call done in the first task would never be reported done in the second (groups
held to the end), and one whose first task computed only some of its inputs' gradients would be reported done too
early in the second, releasing a group one of its nodes still reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten

from chunks import ChunkGroup
from tracer.grad_nodes import gradient_node, hook_each, hook_first_grad, unbatched

__all__ = ["BackwardUse", "graph_inputs", "hook_all_grads_of", "hook_first_grad_of", "hook_nodes_of",
           "moves_drop_accumulators", "refuse_function_transforms", "renew_accumulators",
           "task_computes_gradient_of"]

# A call whose inputs need no gradient reports done through the autograd nodes of its graph; beyond this many nodes,
# hooking them all costs more than holding its chunks until its gradients are in.
MAX_NODES_FOLLOWED = 64


class BackwardUse:
    """One forward call of a module, seen from the backward pass: begun in graph task ``task`` when its outputs'
    gradients arrive, ``done`` when its inputs' gradients are computed."""

    __slots__ = ("groups", "task", "done", "via_inputs")

    def __init__(self, groups: list[ChunkGroup]) -> None:
        self.groups = groups
        self.task: int | None = None  # the graph task its backward began in (None: not begun)
        self.done = False
        self.via_inputs = False  # done is reported by its inputs' gradients (else by its nodes)

    def begin(self) -> None:
        """Its backward begins in the running graph task (see [Note: several graph tasks through one forward])."""
        self.task = torch._C._current_graph_task_id()
        self.done = False

    def finish(self) -> bool:
        """Whether this ends the backward that began in the running graph task (once per task; gradients that
        reached its inputs along another path before it began are not its own)."""
        if self.done or self.task != torch._C._current_graph_task_id():
            return False
        self.done = True
        return True


def needing_grad(tree) -> list[torch.Tensor]:
    if not torch.is_grad_enabled():
        return []
    tensors = {id(t): t for t in unbatched(tree_flatten(tree)[0]) if isinstance(t, torch.Tensor) and t.requires_grad}
    return list(tensors.values())


def hook_first_grad_of(tree, hook: Callable[[], None]) -> bool:
    """``hook()`` once per graph task, when the first gradient of the tensors in ``tree`` that need one arrives (see
    [Note: a call's outputs hooked through in-place ops] in tracer/grad_nodes.py); False if none needs one."""
    tensors = needing_grad(tree)
    if not tensors:
        return False
    hook_first_grad(tensors, hook)
    return True


def _countdown(n: int, hook: Callable[[], None]) -> Callable:
    """A hook to fire ``n`` times per graph task; the last time in each task it calls ``hook()`` (see [Note: several
    graph tasks through one forward])."""
    state = [n, None]  # hooks left to fire in the task below, that task's id

    def one(*_) -> None:
        task = torch._C._current_graph_task_id()
        if state[1] != task:
            state[0], state[1] = n, task
        state[0] -= 1
        if state[0] == 0:
            hook()

    return one


# [Note: a hook on all inputs' gradients without a cycle]
# ``register_multi_grad_hook(mode="all")`` keeps the tensors' autograd nodes in the closure of the hooks it puts on
# those very nodes: a cycle through C++ the garbage collector cannot see, so every module call would leak its graph.
# This hook counts instead: each hooked node adds one when it runs, and ``hook`` runs when all have, holding nothing
# of the graph. The hooks go on the nodes that receive the inputs' gradients (``gradient_node``; a leaf's go on the
# leaf), which run once those gradients are complete. Not tensor hooks: one on a view input is dropped when the view
# is modified in place after the call (see [Note: a call's outputs hooked through in-place ops] in
# tracer/grad_nodes.py), and torch 2.13 segfaults registering one on a view of a Linear's output after
# ``s.mul_(2); s[:, 0].add_(1)``. An input whose gradient this backward never computes (a partial backward) leaves
# the count short: the call is never reported done and its groups are held until their gradients are in, the
# conservative path (see [Note: a group between its uses in backward] in gemini/engine/residency.py).
def hook_all_grads_of(tree, hook: Callable[[], None]) -> bool:
    """``hook()`` once the gradients of all the tensors in ``tree`` that need one are computed, in each graph task
    (see [Note: a hook on all inputs' gradients without a cycle]); False if none needs one."""
    tensors = needing_grad(tree)
    if not tensors:
        return False
    hook_each(tensors, lambda n: _countdown(n, hook))
    return True


def hook_nodes_of(output, hook: Callable[[], None]) -> bool:
    """``hook()`` once every autograd node between ``output`` and the parameters has run, in each graph task: for a
    call whose inputs need no gradient (an embedding), after which nothing of its backward is left to read them.
    False (nothing hooked) when the graph has no such node or more than MAX_NODES_FOLLOWED: such a call is held until
    its groups' gradients are in."""
    nodes: list = []
    seen: set = set()
    stack = [gradient_node(t) for t in unbatched(tree_flatten(output)[0])
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen or hasattr(node, "variable"):  # AccumulateGrad: a parameter
            continue
        seen.add(node)
        nodes.append(node)
        if len(nodes) > MAX_NODES_FOLLOWED:
            return False
        stack.extend(fn for fn, _ in node.next_functions)
    if not nodes:
        return False
    one = _countdown(len(nodes), hook)
    for node in nodes:
        node.register_hook(one)
    return True


# [Note: the graph's own gradient accumulators]
# Torch tells whether a graph task will compute a parameter's gradient by asking its AccumulateGrad node
# (``torch._C._will_engine_execute_node``), and it must be the node the graph holds, which ``get_gradient_edge(p)``
# does not always give: a tensor caches its accumulator weakly, and ``p.data = t`` with ``t`` on another device drops
# the cache (``VariableHooks::set_data``). On a GPU fetches and releases move ``p.data`` between devices, so after
# the forward ``get_gradient_edge(p)`` makes a new accumulator no graph uses (on the CPU stand-in the cache stays).
# So the accumulators are looked up in the graph itself, depth first from the node whose hook begins the pass
# (``torch._C._current_autograd_node``): the first accumulator of a trainable parameter decides, a few nodes from the
# loss in an ordinary backward (only a task computing input gradients alone walks the whole graph).
def task_computes_gradient_of(params: list[torch.nn.Parameter]) -> bool:
    """Whether the running graph task will compute the gradient of one of ``params`` (see [Note: the graph's own
    gradient accumulators])."""
    wanted = {id(p) for p in params}
    start = torch._C._current_autograd_node()
    found = False
    for node in _accumulators(start):
        if id(node.variable) in wanted:
            found = True
            if _will_execute(node):
                return True
    if found:
        return False
    # No hook's node to start from (a leaf's tensor hook), or a graph holding none of them: the accumulators the
    # parameters name now, which no move has replaced in that case.
    return any(_will_execute(get_gradient_edge(p).node) for p in params if p.requires_grad)


def _accumulators(start):
    """The AccumulateGrad nodes reachable from ``start`` (a leaf's), depth first; none from None."""
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "variable", None) is not None:
            yield node
        else:
            stack.extend(fn for fn, _ in node.next_functions)


def _will_execute(node) -> bool:
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # torch.autograd.grad(..., inputs=[p]): captured for the caller to assign to p.grad,
        return True  # the step's gradient all the same


def graph_inputs(root: torch.Tensor, inputs: list, params: list[torch.nn.Parameter]) -> list:
    """``inputs`` of ``backward(inputs=...)`` with each of ``params`` replaced by the gradient edges of its
    accumulators in ``root``'s graph. ``p`` itself names the accumulator it has now, which after a device move is none
    of the graph's, and torch would silently compute no gradient for it (see [Note: the graph's own gradient
    accumulators]). A parameter the graph does not use stays as it is (torch ignores it)."""
    managed = {id(p) for p in params}
    wanted = {id(t) for t in inputs if id(t) in managed}
    if not wanted:
        return inputs
    edges: dict[int, list] = {}
    for node in _accumulators(root.grad_fn):
        if id(node.variable) in wanted:
            edges.setdefault(id(node.variable), []).append(GradientEdge(node, 0))
    return [e for t in inputs for e in edges.get(id(t), [t])]


# [Note: one accumulator per forward]
# Two forwards before one backward (a GAN's discriminator on real and fake data): on the CPU stand-in a parameter
# keeps one AccumulateGrad node for both, autograd holds the second forward's gradient in that node's input buffer
# until the first's arrives, and the gradient arrives once. On a GPU a parameter released between the forwards
# (``p.data`` to the host copy and back) gets a new node in the second forward while the others keep theirs, so
# which gradients arrive twice, and which wait in a buffer, depends on what stayed on the device: auto's warm-up,
# which releases every group, would measure a backward its own plan no longer runs. So where moves drop accumulators
# (a GPU, a placement that moves parameters), every forward after the first before a backward gives every parameter
# a new one: the same backward whatever stays, each gradient accumulated at once (less memory than torch's buffers).
# The price: a parameter used more than once in a forward (a tied embedding) sums its gradients per forward first,
# in another order than torch; the rounding difference is within a GPU's bounds anyway, see
# [Note: equal to torch on a GPU] in tests/helpers.py.
def moves_drop_accumulators(device: torch.device) -> bool:
    """Whether moving ``p.data`` between a chunk's device and host copies changes its device (and drops its
    accumulator): not on the CPU stand-in, whose copies are both CPU tensors."""
    return device.type != "cpu"


def renew_accumulators(groups: list[ChunkGroup]) -> None:
    """Make the next use in a graph of each trainable parameter of ``groups`` create a new AccumulateGrad node (torch
    drops the cached one when ``p.data`` changes type; see [Note: one accumulator per forward]). ``p`` views the same
    memory as before."""
    others: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    for p in (p for g in groups for p in g.params if p.requires_grad):
        data = p.data
        other = torch.float32 if data.dtype == torch.float64 else torch.float64
        key = (data.device, other)
        if key not in others:
            others[key] = torch.empty(0, dtype=other, device=data.device)
        p.data = others[key]
        p.data = data


# [Note: torch.func's gradient transforms]
# Inside torch.func.grad / vjp / jacrev / jvp every tensor an operator makes is wrapped for the transform, gemini's
# fetched chunks included (a wrapper has no storage), and the gradients are not the autograd accumulations gemini's
# hooks follow: the chunks' bookkeeping cannot survive a forward there. It is refused at the root's first hook,
# before anything moves. torch.func.vmap wraps only what derives from its inputs and works as without gemini.
_GRADIENT_TRANSFORMS = ("Grad", "Jvp")


def refuse_function_transforms() -> None:
    """Raise ``RuntimeError`` inside a torch.func gradient transform (see [Note: torch.func's gradient
    transforms]); one C call when there is none."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    names = [i.key().name for i in retrieve_all_functorch_interpreters()]
    if any(n in _GRADIENT_TRANSFORMS for n in names):
        raise RuntimeError(
            f"gemini's model was called inside torch.func's {'/'.join(names)} transform "
            f"(torch.func.grad, vjp, jacrev, jacfwd, jvp or hessian), which gemini's chunks do not support: nothing "
            f"was changed. Compute gradients with autograd (loss.backward() or torch.autograd.grad; per-sample "
            f"gradients with one backward per sample); torch.func.vmap and functional_call alone work")
