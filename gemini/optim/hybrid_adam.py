"""`HybridAdam`: Adam/AdamW over chunk groups, each updated on the tier where its states lie.

The optimizer owns the update of values: the step's phases over the chunk groups, the param groups and the state_dict
API. What a step means to the engine (end of the warm-up, budget check, ZeRO's gathers, the report) is the runtime's
(``GeminiRuntime.begin_step`` and what follows); the fused Adam calls are in ``adam_batches``, the checkpoint formats
in ``state_dict``, fp16's checks in ``loss_scaler``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from chunks import Chunk, ChunkGroup, Tier
from gemini.engine.backward_uses import graph_inputs
from gemini.engine.interrupts import HeldInterrupt
from gemini.engine.load_transaction import LoadTransaction
from gemini.engine.step_report import StepOutcome
from gemini.engine.transaction import StepTransaction
from gemini.errors import NotCopyable
from gemini.optim import state_dict as formats
from gemini.optim.adam_batches import AdamClock, device_first, prepare_batches, recheck_uniform, run_batch
from gemini.optim.clipping import clip_coefficient, grad_norm
from gemini.optim.loss_scaler import ScaledBackwards, loss_scaler_for, update_scale
from gemini.optim.state_view import StatesInChunks
from gemini.optim.param_groups import TORCH_FLAGS, GroupLayout, check_flags, check_frozen, check_weight_decay_mode
from gemini.parallel.zero import agree_grad_ready
from gemini.report import MemoryReport, WarmupTimeline
from offload.profiling import trace_range

if TYPE_CHECKING:
    from gemini.engine.runtime import GeminiRuntime

logger = logging.getLogger(__name__)

__all__ = ["HybridAdam"]


class HybridAdam(NotCopyable, torch.optim.Optimizer):
    """Adam / AdamW whose parameters, gradients and states live in chunks.

    A ``torch.optim.Optimizer``, so learning-rate schedulers work on ``param_groups``; but gradients are kept in
    gradient chunks (``p.grad`` is a view of them after backward), and the state lives in the chunk groups, not
    ``self.state`` (read one parameter's with ``param_state(p)``). ``state_dict()`` has ``torch.optim.AdamW``'s
    format (per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``).
    """

    _copied_as = "optimizer"  # NotCopyable's messages

    def __init__(
        self,
        runtime: GeminiRuntime,
        param_groups: list[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        adamw_mode: bool,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **TORCH_FLAGS,
                        decoupled_weight_decay=adamw_mode)  # torch.optim.AdamW's keys
        super().__init__(param_groups, defaults)  # adds each group through add_param_group
        self._layout = GroupLayout(self.param_groups)  # from here on add_param_group refuses
        self.state = StatesInChunks(lambda: any(bool(g.steps.any()) for g in runtime.manager.trainable_groups))
        self._rt = runtime
        self.adamw_mode = adamw_mode
        self.scaler = loss_scaler_for(runtime.config)
        self.scaled_backwards = ScaledBackwards(self.scaler, lambda: runtime.hooks.backward_passes)
        self.report: MemoryReport | None = None
        self.reports_made = 0
        self._step_started = time.perf_counter()
        # The NVMe files hold the only copy of the optimizer's states and, under bf16/fp16, of the masters the
        # model's state_dict reads: they go with the runtime (held by the model's hooks and by this optimizer), or
        # at close().
        self._finalizer = runtime.closer()

    # ------------------------------------------------------------------------------- API
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def timeline(self) -> WarmupTimeline | None:
        """The warm-up's per-period timeline in force (placement="auto", after the first step): each period's
        non-model peak and chunk groups, against the budget and reserve (also ``report.timeline`` of the step that
        ended the warm-up)."""
        plan = self._rt.plan
        return plan.timeline() if plan is not None else None

    def backward(self, loss: torch.Tensor, *, retain_graph: bool | None = None,
                 inputs: torch.Tensor | Sequence[torch.Tensor] | None = None) -> None:
        """``loss.backward(retain_graph=..., inputs=...)``, with the loss scaled under fp16; out of the device budget,
        a ``DeviceBudgetError`` saying what is missing (as the model's forward does). Parameters among ``inputs`` are
        given to autograd as the graph's own accumulators of them, which torch cannot find from ``p`` once ``p.data``
        has moved (see ``graph_inputs``). ``create_graph`` through the parameters is not supported (README's input
        gradients)."""
        if inputs is not None:  # the graph's own accumulators of parameters (see graph_inputs)
            inputs = graph_inputs(loss, [inputs] if isinstance(inputs, torch.Tensor) else list(inputs),
                                  [p for g in self._rt.manager.trainable_groups for p in g.params])
        with self._rt.budget_errors("the backward pass"):
            self.scaled_backwards.backward(loss, retain_graph=retain_graph, inputs=inputs)

    def param_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """What ``optimizer.state[param]`` holds in ``torch.optim.AdamW``: ``step``, ``exp_avg`` and ``exp_avg_sq``,
        as CPU copies (empty before the parameter's first step, or if frozen). Writing into them changes nothing: use
        ``load_state_dict``. Under ZeRO a collective (the group's ranges are gathered): every rank calls it."""
        try:
            return formats.param_state(self._rt, param)
        except KeyError:
            raise KeyError(f"optimizer.param_state: the tensor of shape {tuple(param.shape)} is not a parameter "
                           f"of this optimizer's model") from None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only ``torch.optim.Optimizer.__init__`` adds groups (those ``gemini.initialize`` made); later a
        ``ValueError``: see [Note: param groups are fixed at initialize]."""
        if "_layout" not in self.__dict__:
            super().add_param_group(param_group)
            return
        raise ValueError(
            f"optimizer.add_param_group({_describe_group(param_group)}) is not supported: the parameters the "
            f"optimizer trains are fixed at gemini.initialize, which lays them out in chunks by param group. "
            f"Give every parameter to gemini.initialize(model, ..., param_groups=[...]) instead: make one kept "
            f"outside the model part of it (e.g. an nn.Parameter attribute of a submodule), then initialize again")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients (the chunks' storage is kept for reuse); as ``model.zero_grad()``."""
        self._rt.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step over every chunk group with gradients, all or nothing (see [Note: a step is all or nothing]
        in gemini/engine/transaction.py). If it raises, parameters, m, v, step counts and the loss scale are as before
        the call, and calling it again once the cause is fixed gives the uninterrupted result. A Ctrl-C once the
        in-memory update has begun is raised when the step has completed, saying so ([Note: Ctrl-C during the
        in-memory update] in gemini/engine/interrupts.py)."""
        self._check_param_groups()  # before the closure: a refused step does no work
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rt = self._rt
        rt.manager.adopt_assigned()  # see [Note: parameters whose .data was assigned] in chunks/manager.py
        rt.settle_grad_views()  # what torch code did to p.grad counts; no view outlives a chunk move
        interrupt = HeldInterrupt()  # see [Note: Ctrl-C during the in-memory update]
        try:
            try:
                rt.begin_step()  # may raise DeviceBudgetError: nothing has been updated yet
                tx = StepTransaction(rt.storage, undo_on_nvme=rt.nvme is not None and rt.nvme.layout.undo_on_nvme)
                self.scaled_backwards.check(rt.grads_cleared_at_pass, tx)
                try:
                    outcome = self._step(tx, interrupt)
                except BaseException:
                    tx.rollback()
                    raise
                tx.commit()
                rt.after_commit([g for g in rt.manager.trainable_groups if g.any_grad_ready], skipped=outcome.skipped)
            finally:
                rt.grad_views.expose()  # torch keeps p.grad after the step, until zero_grad
            self.report = rt.step_report(outcome, step=self.reports_made, started=self._step_started)
            self.reports_made += 1
            rt.end_step(self.report)
            self._step_started = time.perf_counter()
        finally:
            interrupt.release()  # a Ctrl-C held since the in-memory update is raised now, the step complete
        return loss

    def close(self) -> None:
        """Delete the NVMe files (states only there are gone) and stop the I/O threads; also done when the optimizer
        and the model are both garbage-collected, and at interpreter exit."""
        self._finalizer()

    # ------------------------------------------------------------------------- internals
    def _check_param_groups(self) -> None:
        """O(param groups), at every step: the groups hold the parameters ``initialize`` gave them and ask for no math
        the update lacks (see [Note: param groups are fixed at initialize])."""
        self._layout.check(self.param_groups)
        check_frozen(self._rt.manager.groups)
        check_flags(self.param_groups, where="optimizer.param_groups",
                    advice="set it back to False or delete it (the step was not taken)")
        check_weight_decay_mode(self.param_groups, adamw_mode=self.adamw_mode, where="optimizer.param_groups",
                                advice=f"set it to {self.adamw_mode} or delete it (the step was not taken)")

    def _step(self, tx: StepTransaction, interrupt: HeldInterrupt) -> StepOutcome:
        """The step's phases 1-3 of [Note: a step is all or nothing]; ``interrupt`` holds Ctrl-C from phase 3 on."""
        rt = self._rt
        zero = rt.zero
        if zero is not None:
            agree_grad_ready(zero, rt.manager.trainable_groups, rt.residency.reducer,  # [Note: the order of collectives]
                             forwards_raised=rt.forwards_raised, step=True)
        groups = [g for g in rt.manager.trainable_groups if g.any_grad_ready]
        nvme = rt.nvme
        streamed = [g for g in groups if nvme is not None and nvme.holds(g)]
        if streamed:
            nvme.begin_step(streamed, tx)
            nvme.prefetch(streamed)  # the first reads overlap the norm
        scale = self.loss_scale
        with trace_range("gemini::gather_for_step"):
            tiers = {g.index: rt.residency.before_step(g) for g in groups}
        rt.residency.merge_param_edits(rt.manager.groups)  # see [Note: edits of low-precision parameters]
        norm = None
        if rt.config.clip_grad_norm > 0 or self.scaler is not None:
            with trace_range("gemini::grad_norm"):
                norm = grad_norm(groups, tiers, rt.param_order, zero=zero) / scale
        # A step without gradients (before any backward, after a NaN guard skipped one) is a no-op for the scaler:
        # counted as good steps, growth_interval of them would grow the scale.
        overflow = update_scale(self.scaler, norm, tx) if groups else False
        clock = AdamClock()
        norm_value = None if norm is None else norm.item()
        if overflow:
            logger.info("fp16 overflow at step %d: step skipped, loss scale now %s", self.reports_made, self.loss_scale)
            if streamed:
                nvme.settle(streamed)  # the prefetched states are unchanged: their files stay current
            return StepOutcome(skipped=True, grad_norm=norm_value, adam_seconds=clock.seconds(), loss_scale=scale)
        clip = rt.config.clip_grad_norm
        # torch.nn.utils.clip_grad_norm_'s arithmetic, in fp32, so results match it.
        clip_coef = clip_coefficient(norm, clip) if clip > 0 else None
        streamed_set = set(streamed)
        resident = [g for g in groups if g not in streamed_set]

        def prepare(members: list[ChunkGroup], *, keep_grads: bool):
            return prepare_batches(rt, members, tiers, self.param_groups, adamw_mode=self.adamw_mode,
                                   loss_scale=scale, clip_coef=clip_coef, keep_grads=keep_grads)

        # Every temporary of the in-memory update, before anything changes (phase 1).
        batches = device_first(prepare(resident, keep_grads=False))
        if streamed:
            stream = nvme.stream(streamed)
            merged = []
            try:
                for g in stream:
                    merged += rt.residency.merge_param_edits([g])  # its master is in memory now
                    tx.save_values(g, *self._changed_in_memory(g))
                    for batch in prepare([g], keep_grads=True):
                        run_batch(rt, batch, clock)
                        recheck_uniform(rt, batch)
                    rt.residency.after_step(g)
            except BaseException:
                for g in merged:  # the step is undone, its files with it: merge again at the next
                    g.param.edits.edited = True
                raise
            finally:
                stream.close()  # every write confirmed, or (after an error) every request ended
        interrupt.hold()  # phase 3 cannot be undone: [Note: Ctrl-C during the in-memory update]
        sent = set()
        for batch in batches:
            run_batch(rt, batch, clock)
            if batch.tier is Tier.HOST and zero is None:
                # This run's parameters start back now, under the next run's CPU work ([Note: host groups updated as
                # their gradients land]); not under ZeRO, whose parameters first need all ranks' updated ranges.
                with trace_range("gemini::params_from_masters"):
                    for g in batch.members:
                        rt.residency.after_step(g)
                        rt.residency.after_commit(g)
                        sent.add(g.index)
        for batch in batches:
            recheck_uniform(rt, batch)
        with trace_range("gemini::params_from_masters"):
            for g in resident:
                if g.index not in sent:
                    rt.residency.after_step(g)
        return StepOutcome(skipped=False, grad_norm=norm_value, adam_seconds=clock.seconds(), loss_scale=scale)

    @staticmethod
    def _changed_in_memory(g: ChunkGroup) -> tuple[Chunk, int, int]:
        """(chunk, first element, elements) a streamed group's update changes in memory: its parameters (under fp32
        the masters themselves; under bf16/fp16 the copy cast from the masters on NVMe), this rank's range only under
        ZeRO-1/2."""
        if g.param_shard is not None:
            return g.param_shard, 0, g.param_shard.used_numel
        if g.shard is not None:
            return g.param, g.shard.start, g.shard.numel
        return g.param, 0, g.param.used_numel

    # ------------------------------------------------------------------------ checkpoints
    # The formats are in gemini/optim/state_dict.py; here only what this optimizer adds to them.
    def _hyper_state(self) -> formats.HyperState:
        return formats.hyper_state(self.param_groups, precision=self._rt.config.precision,
                                   adamw_mode=self.adamw_mode, scaler=self.scaler,
                                   steps_reported=self.reports_made)

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        """What both loads check before changing anything (all or nothing)."""
        self._layout.check(self.param_groups)
        check_flags(state_dict["param_groups"], where="the optimizer state's param_groups",
                    advice="nothing was loaded. Resume that run with the torch optimizer that saved it; gemini "
                           "can only go on from it as plain Adam/AdamW, with the key set to False in the state")
        check_weight_decay_mode(state_dict["param_groups"], adamw_mode=self.adamw_mode,
                                saved_mode=state_dict.get("gemini", {}).get("adamw_mode"),
                                where="the optimizer state's param_groups",
                                advice=f"nothing was loaded; to resume it, initialize with adamw_mode={not self.adamw_mode}")

    def _load_hyper_state(self, state_dict: dict[str, Any]) -> None:
        formats.load_hyper_state(self.param_groups, self.scaler, state_dict["param_groups"],
                                 state_dict.get("gemini", {}))
        self.reports_made = formats.steps_reported(state_dict)
        for hp in self.param_groups:  # as torch.optim.AdamW's __setstate__ after a load
            hp.update({**TORCH_FLAGS, **hp, "decoupled_weight_decay": self.adamw_mode})

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format: per-parameter step / exp_avg / exp_avg_sq, on the CPU.

        Under ZeRO this is the consolidated state (every rank's shards gathered): call it on every rank. It loads into
        any number of ranks, or into a plain ``torch.optim.AdamW``. Hooks registered with
        ``register_state_dict_pre_hook`` / ``_post_hook`` run as in torch.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # torch's hooks, as its state_dict runs them
            pre_hook(self)
        self._layout.check(self.param_groups)
        state_dict = formats.full_state_dict(self._rt, self.param_groups, self._hyper_state())
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = _hook_result(post_hook(self, state_dict), state_dict)
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``'s format, or a ``torch.optim.AdamW`` / ``Adam`` state whose flags this update
        implements (``ValueError`` for amsgrad, maximize, ... set, before any change). Hooks registered with
        ``register_load_state_dict_pre_hook`` / ``_post_hook`` run as in torch (a pre-hook gets a shallow copy and
        may return another)."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = _hook_result(pre_hook(self, state_dict), state_dict)
        with LoadTransaction(self._rt) as tx:  # all or nothing: [Note: a load is all or nothing]
            self._load_full(state_dict, tx)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_full(self, state_dict: dict[str, Any], tx: LoadTransaction) -> None:
        self._check_loadable(state_dict)
        formats.load_full_state_dict(self._rt, self.param_groups, state_dict, tx)  # checks all before writing
        tx.later(lambda: self._load_hyper_state(state_dict))

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing."""
        self._check_loadable(state_dict)
        formats.check_full_state_dict(self._rt, self.param_groups, state_dict)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the training state, with no communication: per chunk group this rank's range of the
        fp32 masters (frozen groups too) and, for trainable groups, of m and v, with the step counts. Loads
        (``load_sharded_state_dict``) only into the same world size, rank and chunk layout; use ``state_dict()`` to
        change them."""
        return formats.sharded_state_dict(self._rt, self._hyper_state())

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``sharded_state_dict`` saved on this rank: masters (so the parameters too), m, v and step
        counts. A collective under ZeRO-1/2 (the parameters are all-gathered)."""
        with LoadTransaction(self._rt) as tx:  # all or nothing: [Note: a load is all or nothing]
            self._load_sharded(state_dict, tx)

    def fits_sharded_state_dict(self, state_dict: dict[str, Any]) -> bool:
        """Whether ``state_dict`` (``sharded_state_dict``'s) was saved with this run's ranks, precision and chunk
        layout, so that it loads as it is."""
        return formats.same_layout(self._rt, state_dict)

    def check_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise what :meth:`load_sharded_state_dict` would raise for ``state_dict``, changing nothing."""
        self._check_loadable(state_dict)
        formats.check_sharded_state_dict(self._rt, state_dict)

    def _load_sharded(self, state_dict: dict[str, Any], tx: LoadTransaction) -> None:
        self._check_loadable(state_dict)
        formats.load_sharded_state_dict(self._rt, state_dict, tx)  # checks all before writing
        tx.later(lambda: self._load_hyper_state(state_dict))


def _hook_result(result: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state-dict hook may return the dict to use from then on; None keeps the one it got."""
    return state_dict if result is None else result


def _describe_group(param_group: Any) -> str:
    """``add_param_group``'s argument in a message: how many parameters, of which shapes."""
    params = param_group.get("params") if isinstance(param_group, dict) else None
    if isinstance(params, torch.Tensor):
        params = [params]
    shapes = [tuple(p.shape) for p in params if isinstance(p, torch.Tensor)] if isinstance(params, Iterable) else []
    return f"a group of {len(shapes)} parameter{'' if len(shapes) == 1 else 's'} of shapes {shapes[:4]}"
