"""The engine's one set of module hooks: chunks resident before compute, gradients into chunk storage, and the period
boundaries the warm-up traces and the auto policy counts.

Only real PyTorch hooks are used: forward pre/post hooks on every module that owns parameters, a pre-hook on the
autograd nodes of each call's outputs as its pre-backward hook (``hook_first_grad_of``), a gradient hook (before
autograd accumulates) and a post-accumulate-grad hook on every trainable parameter, an autograd-engine callback at
the end of each backward pass, and, while boundaries are wanted, :class:`tracer.PeriodHooks` on every module, feeding
the warm-up's tracer and then the policy through one callback. The backward half (passes begun and ended, gradients
into their chunks) is gemini/engine/backward_hooks.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves

from chunks import ChunkGroup, ChunkManager
from gemini.engine.backward_uses import (BackwardUse, hook_all_grads_of, hook_first_grad_of, hook_nodes_of,
                                         moves_drop_accumulators, refuse_function_transforms, renew_accumulators)
from gemini.engine.backward_hooks import BackwardHooks
from gemini.engine.descendant_reads import DescendantReads, DescendantReadHooks
from gemini.engine.residency import Residency
from gemini.errors import DeviceBudgetError, NotCopyable
from offload.profiling import trace_range
from tracer import Boundary, PeriodHooks, Phase

logger = logging.getLogger(__name__)

__all__ = ["ModuleHooks"]


def _weak_method(method: Callable) -> Callable:
    """``method`` without keeping its object alive (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        if (bound := ref()) is not None:
            bound(*args)

    return call


# [Note: compiled frames between the module hooks]
# Under torch.compile each module hook is a graph break ([Note: hooks under torch.compile]), so dynamo compiles each
# hooked module's forward as a frame of its own, and modules of one class share its code object, whose cache holds
# ``recompile_limit`` entries (8). A frame's guards include its parameters' shapes and the grad mode: a GPT's Linear
# layers of 5 shapes, trained and evaluated, need 10, and past the limit dynamo runs that forward eagerly (a warning;
# the speed-up lost). A plain compiled model is one frame through all of them. So the first compiled forward raises
# the limit (never lowers it) to 4 entries per parameter-shape signature of the class with the most: each grad mode,
# static and then with dynamic shapes (automatic dynamic's one recompile).
def _room_for_compiled_frames(modules: Iterable[nn.Module]) -> None:
    import torch._dynamo.config as dynamo_config  # imported already: a model is being compiled

    signatures: dict[object, set] = {}
    for m in modules:
        signature = tuple((n, None if p is None else tuple(p.shape)) for n, p in m._parameters.items())
        signatures.setdefault(getattr(type(m).forward, "__code__", type(m)), set()).add(signature)
    needed = 4 * max(map(len, signatures.values()), default=0)
    if needed > dynamo_config.recompile_limit:
        logger.info("torch._dynamo.config.recompile_limit %d -> %d: each hooked module's forward is a compiled "
                    "frame of its own", dynamo_config.recompile_limit, needed)
        dynamo_config.recompile_limit = needed


class ModuleHooks(DescendantReadHooks, BackwardHooks, NotCopyable):
    """Installs and owns the hooks that drive chunk movement for one module tree."""

    def __init__(
        self, module: nn.Module, manager: ChunkManager, residency: Residency, *,
        on_root_forward: Callable[[tuple, dict], None],
        on_budget_error: Callable[[], None],
        on_boundary: Callable[[Boundary], None],
        on_backward_begin: Callable[[], None] = lambda: None,
        on_backward_end: Callable[[], None] = lambda: None,
        on_root_forward_end: Callable[[], DeviceBudgetError | None] = lambda: None,
        accumulated_in_place: Callable[[nn.Parameter], bool] = lambda param: False,
    ) -> None:
        self.manager = manager
        self.residency = residency
        self._on_budget_error = on_budget_error
        self._on_backward_begin = on_backward_begin
        self._on_backward_end = on_backward_end
        self._on_root_forward_end = on_root_forward_end
        self._accumulated_in_place = accumulated_in_place
        self._handles: list = []
        self._grad_hooks: list[tuple[nn.Parameter, int]] = []  # (parameter, the key of _on_grad among its post-accumulate hooks)
        self._preloaded: set[nn.Parameter] = set()  # p.grad holds the step's gradient so far (see _hooked_grads_accumulated)
        # gradients moved into a chunk in this pass: whether one came from outside (see [Note: read twice])
        self._arrived: dict[nn.Parameter, bool] = {}
        self._to_preload: set[nn.Parameter] = set()  # ... once its gradient of this pass arrives
        self._open_uses: dict[nn.Module, list[BackwardUse | None]] = {}
        # The autograd graph task whose end-of-backward callback is queued (None: none is), and whether it is the
        # iteration's backward (see [Note: a graph task that accumulates no parameter gradient]).
        self._backward_task: int | None = None
        self._iteration_pass = False
        self._task_seen: int | None = None  # the graph task whose hooks ran last
        # Backward passes that ran to completion (the optimizer checks fp16 ones were scaled).
        self.backward_passes = 0
        # Grad-enabled forwards since the last backward ([Note: one accumulator per forward]).
        self._graph_forwards = 0
        # the host is not the compute device: see [Note: a p.grad on another device than its gradient]
        self._devices_differ = manager.storage.device.type != "cpu"
        self.renews_accumulators = moves_drop_accumulators(manager.storage.device) and (
            manager.shard_params or not residency.policy.keeps_every_chunk_on_device)
        # The root's pre-hook runs first of all, its post-hook before the root's own chunk hooks (see [Note: the
        # engine's hooks around the user's]). Forward hooks are never traced by torch.compile: see [Note: hooks
        # under torch.compile]. Boundaries while follow_periods(True): the root's is announced by root_pre, after
        # on_root_forward may have begun the trace (see [Note: the root's boundary] in tracer/hooks.py).
        self._periods = PeriodHooks(module, functools.partial(self._announce, on_boundary), root_forward_hook=False)
        self._unentered: list[nn.Module] = []  # calls whose boundary raised, innermost last

        moves_chunks = manager.shard_params or not residency.policy.keeps_every_chunk_on_device

        @torch._disable_dynamo
        def root_pre_eager(m, args, kwargs, compiling: bool) -> None:
            refuse_function_transforms()  # see [Note: torch.func's gradient transforms]
            if moves_chunks:
                refuse_tracing(args, kwargs)
            if torch.is_grad_enabled() and self._graph_forwards and self.renews_accumulators:
                renew_accumulators(self.manager.trainable_groups)  # see [Note: one accumulator per forward]
            self._graph_forwards += torch.is_grad_enabled()
            if compiling and not self._frames_made_room:
                self._frames_made_room = True
                _room_for_compiled_frames(self._hooked)
            on_root_forward(args, kwargs)
            self._periods.root_forward()
            self._begin_descendant_reads(m, compiling)

        def root_pre(m, args, kwargs) -> None:  # traced by dynamo in a compiled model: compiling is True
            root_pre_eager(m, args, kwargs, torch.compiler.is_compiling())

        # always_call: the post-hooks run even when the forward raises, so every module entered is left again.
        # Non-reentrant activation checkpointing stops its recompute with an exception (_StopRecomputationError)
        # inside the last module it needs; without always_call that module's compute references would leak, one per
        # iteration, and its chunks could never be evicted again.
        self._handles.append(module.register_forward_hook(self._root_post_forward, always_call=True))
        # Only modules owning parameters get hooks, and only while the policy moves chunks around module calls
        # (never under placement "cuda"; under "auto" until a plan keeps everything on the device): the gradient
        # hooks below are all a policy that moves nothing needs.
        self._owners: list[tuple[nn.Module, list[ChunkGroup]]] = []
        self._module_handles: list = []
        for sub in module.modules():
            groups = manager.groups_of(sub.parameters(recurse=False))
            if groups:
                residency.count_uses(groups)
                self._owners.append((sub, groups))
        self._hooked = {sub for sub, _ in self._owners}  # those with _post_forward (see _announce)
        self._frames_made_room = False  # see [Note: compiled frames between the module hooks]
        self._groups_of = dict(self._owners)  # hooked module -> the groups its hooks fetch
        # See [Note: parameters of a descendant read by its ancestor]: the kinds of forward (training, grad
        # enabled) searched already, and the search under way (None: none is).
        self._reads_searched: set[tuple[bool, bool]] = set()
        self._reads: DescendantReads | None = None
        self._stance = None  # the compiler's stance the search forward replaced (torch.compiler.set_stance)
        # The root's own hooks stay for good: the plan that lets the others go is adopted inside the root's pre-hook
        # (gradient accumulation), while torch iterates over the root's hooks.
        self._root_own_handles: list = []
        if residency.follows_modules and self._owners and self._owners[0][0] is module:
            self._install(*self._owners.pop(0), into=self._root_own_handles)
        self.follow_modules(residency.follows_modules)
        self._root, self._root_pre = module, root_pre
        self._root_pre_handle = module.register_forward_pre_hook(self._root_pre, with_kwargs=True, prepend=True)
        self._handles.append(self._root_pre_handle)
        # A parameter's hooks live in its C++ tensor, where the garbage collector cannot follow them: holding these
        # hooks strongly would keep the whole engine (every chunk) alive for good, even with the model and optimizer
        # dropped. So they hold it weakly; the module hooks above keep it alive as long as the model can run.
        on_grad, arriving = _weak_method(self._on_grad), _weak_method(self._grad_arriving)
        for group in manager.trainable_groups:
            for p in group.params:
                if p.requires_grad:
                    self._handles.append(p.register_hook(functools.partial(arriving, weakref.ref(p))))
                    self._handles.append(p.register_post_accumulate_grad_hook(on_grad))
                    self._grad_hooks.append((p, self._handles[-1].id))  # see [Note: the user's post-accumulate hooks]

    def _announce(self, on_boundary: Callable[[Boundary], None], boundary: Boundary) -> None:
        try:
            on_boundary(boundary)
        except BaseException:
            # Raised in a forward pre-hook before this module's own: its post-hook (always_call) still runs, and
            # must not end another call's use (a module inside itself).
            if boundary.phase is not Phase.BACKWARD and boundary.module in self._hooked:
                self._unentered.append(boundary.module)
            raise

    def follow_modules(self, follow: bool) -> None:
        """Install (``True``) or take off the forward hooks of the modules owning parameters; between iterations,
        when the policy's ``follows_modules`` changed."""
        if follow and not self._module_handles:
            for sub, groups in self._owners:
                self._install(sub, groups, into=self._module_handles)
            self._periods_first()
        elif not follow:
            for h in self._module_handles:
                h.remove()
            self._module_handles.clear()

    def _periods_first(self) -> None:
        """Boundaries before fetches: the period hooks go in again after module hooks were prepended (see [Note: the
        engine's hooks around the user's])."""
        if self._periods.installed:
            self._periods.remove()
            self._periods.install()

    @property
    def follows_periods(self) -> bool:
        return self._periods.installed

    def follow_periods(self, follow: bool) -> None:
        """Announce period boundaries (``True``: during a warm-up, and while the policy counts periods) or not;
        between iterations, or in the root's pre-hook before its boundary."""
        if follow and not self._periods.installed:
            self._periods.install()
        elif not follow and self._periods.installed:
            self._periods.remove()

    # [Note: the engine's hooks around the user's]
    # Forward pre-hooks the model had before initialize may read the parameters (the old ``weight_norm``,
    # ``spectral_norm``, ``torch.nn.utils.prune`` compute ``weight`` from them): run before the engine's, they would
    # read unfetched chunks (the host copy, or under ZeRO-3 an empty shard). So the engine's pre-hooks are prepended,
    # and a module's chunks are on the device before any pre-hook of it runs (the root's own pre-hook, which begins
    # the iteration, runs before even those; the period hooks of tracer/hooks.py, prepended after these, announce a
    # boundary before its module's fetch). Its post-hooks are appended: the model's own run before the release. Hooks
    # added after initialize with ``prepend=True`` (pre) or without it (post) run outside the fetched window, as do
    # full backward pre-hooks, which torch runs before the node that announces the call's backward.
    def _install(self, sub: nn.Module, groups: list[ChunkGroup], *, into: list) -> None:
        into.append(sub.register_forward_pre_hook(functools.partial(self._pre_forward, groups), prepend=True))
        into.append(sub.register_forward_hook(functools.partial(self._post_forward, groups), always_call=True))

    def remove(self) -> None:
        self.follow_modules(False)
        self.follow_periods(False)
        for h in (*self._handles, *self._root_own_handles):
            h.remove()
        self._handles.clear()
        self._root_own_handles.clear()

    @contextlib.contextmanager
    def _phase(self, name: str):
        with trace_range(name):
            try:
                yield
            except DeviceBudgetError:
                self._on_budget_error()
                raise

    # --------------------------------------------------------------------------- forward
    # [Note: hooks under torch.compile]
    # The forward hooks move chunks, re-point parameters (``p.data = view``) and read the placement's Python state.
    # Traced by dynamo, ``p.data = ...`` would become a graph input mutation (``set_``) bumping the parameter's
    # version counter (autograd then finds saved tensors "modified by an inplace operation"), and every change of that
    # state would fail a guard and recompile. So these hooks (and tracer/hooks.py's period hooks) are never traced:
    # each is a graph break and runs eagerly. ``torch._disable_dynamo`` is ``torch.compiler.disable`` importing dynamo
    # lazily (not at ``import gemini``), as torch.optim uses it. Backward hooks run in the autograd engine, outside
    # any compiled frame. See the README's "torch.compile".
    @torch._disable_dynamo
    def _pre_forward(self, groups: list[ChunkGroup], module: nn.Module, args) -> None:
        # Handed to this call's post-hook, which runs even if this hook raises (a stack: a module may run inside
        # itself).
        uses = self._open_uses.setdefault(module, [])
        uses.append(None)
        with self._phase("gemini::pre_forward"):
            self.residency.before_compute(groups)
            # This call's backward is done once its inputs' gradients are (see [Note: a group between its uses in
            # backward]); a recompute's inputs never get gradients.
            if torch._C._current_graph_task_id() == -1 and self.residency.track_backward_uses(groups):
                use = uses[-1] = BackwardUse(groups)
                use.via_inputs = hook_all_grads_of(args, functools.partial(self._backward_use_done, use))

    def _backward_use_done(self, use: BackwardUse) -> None:
        if use.finish():
            with self._phase("gemini::backward_use_done"):
                self.residency.backward_use_done(use.groups)

    @torch._disable_dynamo
    def _post_forward(self, groups: list[ChunkGroup], module: nn.Module, args, output):
        if self._unentered and self._unentered[-1] is module:
            self._unentered.pop()  # its pre-hook never ran (see _announce)
            return None
        with trace_range("gemini::post_forward"):
            use = self._open_uses[module].pop()
            self.residency.after_compute(groups)
            # Under ZeRO-3 a released group's parameters become empty tensors, which the parameters' AccumulateGrad
            # (run after the call's own nodes) cannot take a gradient into: such calls are held until their
            # gradients are in.
            if use is not None and not use.via_inputs and self.residency.gatherer is None:
                hook_nodes_of(output, functools.partial(self._backward_use_done, use))
            hook_first_grad_of(output, functools.partial(self._pre_backward, groups, use))
        return None

    @torch._disable_dynamo
    def _root_post_forward(self, module: nn.Module, args, output) -> None:
        if self._reads is not None:
            self._end_descendant_reads(output)
        error = self._on_root_forward_end()  # an evaluation's budget error, raised last
        self.residency.end_forward()
        # The root's outputs get their gradients before any parameter's (which flow through them), so the
        # backward pass begins here: the gradient views are withdrawn before autograd could accumulate into one.
        hook_first_grad_of(output, self._begin_backward_pass)
        if error is not None:  # the forward's output is dropped: nothing of it was kept
            try:
                raise error
            finally:  # the frame, in the error's traceback, holds no error: no cycle keeps the forward's tensors
                error = None


# [Note: tracing a model whose chunks move]
# torch.jit.trace records the operators a call runs and torch.export runs it on fake tensors: where gemini's hooks
# move chunks around module calls, both would record or run the moves too. jit.trace fails inside them, and export
# under auto would leave fake tensors' symbolic sizes in the memory ledger for good (and on a GPU, parameters no step
# can renew). Under a placement that moves no chunk (cuda) both work; where chunks move, the root's first hook
# refuses, before anything changed.
def refuse_tracing(args, kwargs) -> None:
    """Raise ``RuntimeError`` inside torch.jit.trace or torch.export (fake inputs): see [Note: tracing a model whose
    chunks move]."""
    if torch.jit.is_tracing():
        how = "torch.jit.trace"
    elif torch.compiler.is_exporting() or any(isinstance(t, FakeTensor) for t in tree_leaves((args, kwargs))):
        how = "torch.export (or a trace on fake tensors)"
    else:
        return
    raise RuntimeError(
        f"{how} of gemini's model is not supported under a placement that moves chunks between the device and the "
        f"host (its hooks move them around each module's call); nothing was changed. Export a plain copy: build the "
        f"model again, load model.state_dict() into it, and trace or export that (under placement 'cuda', which "
        f"moves no chunk, tracing gemini's model works)")
