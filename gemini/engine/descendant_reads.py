"""Parameters of a descendant module read by an ancestor's call without a call of their own.

[Note: parameters of a descendant read by its ancestor]
The module hooks fetch a module's own parameters around its calls (``recurse=False``), but some modules read a
child's parameters without calling it: ``nn.MultiheadAttention`` passes ``out_proj.weight`` to
``F.multi_head_attention_forward`` (or the fused ``torch._native_multi_head_attention``) and never calls ``out_proj``.
Such a read would see an unfetched chunk (the host copy, or under ZeRO-3 an empty shard). Nothing cheap tells these
reads apart beforehand, so the first root forward of each kind (training or not, grad or not: fused paths are an
evaluation's) runs under a mode that sees every torch call's arguments. A parameter whose owners were not called yet
in this forward, read inside a call of an ancestor (the innermost running module containing an owner), is fetched
there for that call and its backward, and from then on that ancestor's hooks fetch its group with their own. With
grad the mode is a torch function mode, so the parameter is fetched before autograd records it (under ZeRO-3 a node
recording the empty shard's shape would refuse its gradient); without grad a dispatch mode, since a torch function
mode turns the fused fast paths off (``has_torch_function``), and with them the reads to find.
(``nn.TransformerEncoderLayer``'s fused path is off anyway while modules in it have hooks.) Reads after the owner's
call is over (a tied output projection ``F.linear(h, self.emb.weight)``, layer scale by a child's parameter, a
user's hook reading an earlier module's bias) are found the same way: only a read inside a call of an owner (or of a
module within one) is the owner's own. Metadata reads (``p.shape``, ``p.device``, the engine's ``p.data = ...``)
fetch nothing. Other forwards pay nothing.

[Note: the search forward runs uncompiled]
A compiled model (whole, before or after initialize, or block by block) is searched too: the search forward runs
eagerly, and later forwards compile as usual. Under the mode, dynamo would guard every graph on the torch function
mode stack (recompiling everything at the next forward) or, under a dispatch mode, mark every frame "skip" for good.
So that forward runs with dynamo's callback off (``torch._disable_dynamo``) and the compiler stance "force_eager",
which the entry of every compiled function reads: no frame is compiled or marked. The stance is taken where the
forward begins eagerly: in ``GeminiModel.__call__``, whose frame dynamo skips (``skip_call_frame``) so it decides in
plain Python without a guard on the engine's state, even where the wrapped model is compiled (its root pre-hook would
run inside the traced frame, too late); and in the root's pre-hook, for a forward begun elsewhere. A root pre-hook
reached inside a traced frame (an inner module called under compile, not the model initialize returned) cannot
search: reads there still see the unfetched copy. The price: the first forward of each kind runs uncompiled, and
under auto the warm-up measures eager code.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from chunks import ChunkGroup, ChunkManager
from gemini.engine.backward_uses import hook_first_grad_of

logger = logging.getLogger(__name__)

__all__ = ["DescendantReadHooks", "DescendantReads", "run_uncompiled", "skip_call_frame"]

# Torch calls on a parameter that read no values: attribute access and sizes.
_METADATA = frozenset({"__get__", "__set__", "__hash__", "size", "dim", "numel", "nelement", "stride",
                       "element_size", "is_contiguous", "data_ptr", "untyped_storage", "storage_offset",
                       "register_hook", "register_post_accumulate_grad_hook", "requires_grad_"})
# The same at the dispatch level: under inference_mode ``p.data = view`` (the engine re-pointing every parameter of
# a chunk it fetched, a later module's too) dispatches the first of these.
_METADATA_OPS = frozenset({"_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel",
                           "sym_storage_offset", "is_same_size"})


class DescendantReads:
    """One root forward that finds reads of descendants' parameters (see [Note: parameters of a descendant read by
    its ancestor]). ``fetch(groups)`` / ``release(groups, output)`` bracket a call's extra groups (compute and
    backward); ``found`` maps each ancestor to the groups its hooks take on."""

    def __init__(self, root: nn.Module, manager: ChunkManager, *, own_groups: Callable[[nn.Module], list[ChunkGroup]],
                 fetch: Callable[[list[ChunkGroup]], None],
                 release: Callable[[list[ChunkGroup], object], None]) -> None:
        self._root = root
        self._manager = manager
        self._own_groups = own_groups
        self._fetch = fetch
        self._release = release
        self._owners: dict[int, list[nn.Module]] = {}  # id(parameter) -> modules owning it
        self._ancestors: dict[int, set[int]] = {}  # id(module) -> ids of the modules containing it
        self._stack: list[tuple[nn.Module, list[ChunkGroup]]] = []  # running calls, their extra groups
        self._called: set[int] = set()  # modules called so far in this forward
        self.late_reads = 0  # groups found read after a call of their owner was over
        self._handles: list = []
        self.found: dict[nn.Module, list[ChunkGroup]] = {}

    def begin(self) -> None:
        """The root's forward begins (in its pre-hook, after the engine's own)."""
        self._map_tree()
        self.found = {}
        self._called = {id(self._root)}
        self._stack = [(self._root, [])]
        for sub in self._root.modules():
            if sub is not self._root:
                # First: the module's own pre-hooks (weight_norm's) read its parameters, no descendant's.
                self._handles.append(sub.register_forward_pre_hook(self._enter, prepend=True))
                self._handles.append(sub.register_forward_hook(self._leave, always_call=True))
        self._mode = _FunctionReads(self) if torch.is_grad_enabled() else _DispatchReads(self)
        self._mode.__enter__()

    def end(self, output) -> dict[nn.Module, list[ChunkGroup]]:
        """The root's forward is over: what was found (``found``)."""
        self._mode.__exit__(None, None, None)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        _, extra = self._stack.pop()
        self._release(extra, output)
        self._stack.clear()
        return self.found

    def _map_tree(self) -> None:
        if self._owners:
            return
        parents: dict[int, set[int]] = {id(self._root): set()}
        for sub in self._root.modules():
            for child in sub.children():
                parents.setdefault(id(child), set()).update(parents[id(sub)] | {id(sub)})
            for p in sub.parameters(recurse=False):
                self._owners.setdefault(id(p), []).append(sub)
        self._ancestors = parents

    def _enter(self, module: nn.Module, args) -> None:
        self._called.add(id(module))
        self._stack.append((module, []))

    def _leave(self, module: nn.Module, args, output) -> None:
        if self._stack and self._stack[-1][0] is module:
            _, extra = self._stack.pop()
            self._release(extra, output)

    def read_args(self, args, kwargs) -> None:
        """A torch call with these arguments runs now: fetch what it reads of descendants."""
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, nn.Parameter) and id(t) in self._owners:
                    self._read(t)

    def _running(self) -> set[int]:
        return {id(module) for module, _ in self._stack}

    def _read(self, param: nn.Parameter) -> None:
        owners = self._owners[id(param)]
        if any(id(o) in self._running() for o in owners):
            return  # read inside its own module's call (or a descendant's of it)
        for module, extra in reversed(self._stack):
            if any(id(module) in self._ancestors.get(id(o), ()) for o in owners):
                break
        else:
            return
        group, _ = self._manager.locate(param)
        if any(g.index == group.index for g in self._own_groups(module)):
            return  # fetched by its own hooks already
        found = self.found.setdefault(module, [])
        if all(g.index != group.index for g in found):
            found.append(group)
            self.late_reads += any(id(o) in self._called for o in owners)
        if all(g.index != group.index for g in extra):
            extra.append(group)
            self._fetch([group])


class _FunctionReads(TorchFunctionMode):
    def __init__(self, reads: DescendantReads) -> None:
        super().__init__()
        self._reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) not in _METADATA:
            self._reads.read_args(args, kwargs)
        return func(*args, **kwargs)


class _DispatchReads(TorchDispatchMode):
    def __init__(self, reads: DescendantReads) -> None:
        super().__init__()
        self._reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._opname not in _METADATA_OPS:
            self._reads.read_args(args, kwargs)
        return func(*args, **kwargs)


@torch._disable_dynamo
def run_uncompiled(call: Callable, args: tuple, kwargs: dict):
    """``call(*args, **kwargs)`` with no frame compiled, in compiled functions it calls too (see
    [Note: the search forward runs uncompiled])."""
    with torch.compiler.set_stance("force_eager"):
        return call(*args, **kwargs)


@functools.cache
def skip_call_frame(function: Callable) -> None:
    """Dynamo runs ``function``'s frame as plain Python and compiles the frames it calls (see
    [Note: the search forward runs uncompiled]); once, at the first wrapped model (dynamo is imported by then)."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(function.__code__)


class DescendantReadHooks:
    """The part of :class:`gemini.engine.hooks.ModuleHooks` that runs the search (a base class of it, using its
    hooks, residency and bookkeeping): see [Note: parameters of a descendant read by its ancestor]."""

    _late_reads: int = 0  # groups found read after their owner's call, since take_late_reads()

    def take_late_reads(self) -> int:
        """How many groups the searches found read after their owner's call, since the last call.

        A warm-up whose forward found some traced them fetched at the read, while later iterations fetch them from
        the start of the reading module's call, perhaps the root's (a tied projection: the whole forward): its plan
        is not kept, and the next iteration is traced again. (A descendant read by its ancestor is fetched from the
        start of the ancestor's call in later iterations too, but that call is about as long as the read's span.)"""
        found, self._late_reads = self._late_reads, 0
        return found

    @torch._disable_dynamo  # never compiled: the frame calling it is not (a guard on the state it reads)
    def search_due(self) -> bool:
        """Whether the next forward of the root is searched: the first of its kind (training, grad enabled), while
        modules are followed, outside backward."""
        return ((self._root.training, torch.is_grad_enabled()) not in self._reads_searched
                and self.residency.follows_modules and torch._C._current_graph_task_id() == -1)

    def _begin_descendant_reads(self, root: nn.Module, compiling: bool) -> None:
        """In the root's pre-hook: the first forward of its kind is searched, uncompiled (see [Note: the search
        forward runs uncompiled])."""
        if not self.search_due():
            return
        self._reads_searched.add((root.training, torch.is_grad_enabled()))
        if compiling:
            logger.info("gemini: the first forward runs inside a compiled frame (%s called under torch.compile, "
                        "not the model initialize returned): reads of parameters of a descendant by its "
                        "ancestor are not searched", type(root).__name__)
            return
        self._stance = torch.compiler.set_stance("force_eager")  # compiled parts run eagerly until the end
        self._reads = DescendantReads(root, self.manager, own_groups=lambda m: self._groups_of.get(m, ()),
                                      fetch=self._fetch_read, release=self._release_read)
        self._reads.begin()

    def _fetch_read(self, groups: list[ChunkGroup]) -> None:
        with self._phase("gemini::pre_forward"):
            self.residency.before_compute(groups)

    def _release_read(self, groups: list[ChunkGroup], output) -> None:
        if groups:
            self.residency.after_compute(groups)
            hook_first_grad_of(output, functools.partial(self._pre_backward, groups, None))

    def _end_descendant_reads(self, output) -> None:
        """In the root's post-hook: the ancestors found fetch the groups from the next forward on."""
        reads, self._reads = self._reads, None
        stance, self._stance = self._stance, None
        stance.__exit__(None, None, None)  # the stance before the search
        found = reads.end(output)
        self._late_reads += reads.late_reads
        for module, groups in found.items():
            logger.info("gemini: %s reads parameters of its descendants without calling them: its calls fetch "
                        "them too", type(module).__name__)
            self.residency.count_uses(groups)
            own = self._groups_of.get(module)
            if module is self._root:
                # The root's own post-hook of this forward runs after this one, on the list its hooks hold (torch
                # calls the hooks it listed as the call began), which must not gain the groups this search just
                # released: new hooks on a new list serve the next forwards.
                self._groups_of[module] = own = [*(own or ()), *groups]
                self._hooked.add(module)
                for h in self._root_own_handles:
                    h.remove()
                self._root_own_handles.clear()
                self._install(module, own, into=self._root_own_handles)
                self._root_pre_handle.remove()  # after the root's pre-hook, which goes first again
                self._root_pre_handle = module.register_forward_pre_hook(self._root_pre, with_kwargs=True, prepend=True)
                self._handles.append(self._root_pre_handle)
                continue
            if own is None:
                own = self._groups_of[module] = []
                self._hooked.add(module)
                self._owners.append((module, own))
                if self._module_handles:
                    self._install(module, own, into=self._module_handles)
                    self._periods_first()
            own.extend(groups)
