"""`HybridAdam`: Adam/AdamW over chunk groups, each updated on the tier where its states lie."""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from chunks import Chunk, ChunkGroup, Tier
from gemini.optim.adam import adam_update
from gemini.optim.clipping import clip_coefficient, grad_norm
from gemini.optim.loss_scaler import DynamicLossScaler
from gemini.report import MemoryReport, WarmupTimeline
from gemini.engine.transaction import UNDO_KIND, StepTransaction
from gemini.parallel.zero import agree_grad_ready, gather_params, gather_state
from offload.profiling import trace_range

if TYPE_CHECKING:
    from gemini.engine.runtime import GeminiRuntime

logger = logging.getLogger(__name__)

__all__ = ["HybridAdam"]

@dataclass
class _Batch:
    """One fused Adam call: same tier, same param group (see ``HybridAdam._prepare``)."""

    tier: Tier
    members: list[ChunkGroup]
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    grad_scale: torch.Tensor | None = None  # the fp16 loss scale, divided out in the kernel
    coef: torch.Tensor | None = None  # the clipping coefficient, on the batch's device
    scratch: torch.Tensor | None = None  # fp32 room for one gradient (low precision, or clipped aside)
    whole: list[ChunkGroup] = field(default_factory=list)  # updated as one flat tensor: counts re-synced
    bump: list[tuple[ChunkGroup, int]] = field(default_factory=list)  # gradients wholly on other ranks' shards


class HybridAdam(torch.optim.Optimizer):
    """Adam / AdamW whose parameters, gradients and states live in chunks.

    A ``torch.optim.Optimizer``, so learning-rate schedulers work on ``param_groups``; but
    the parameters' gradients are kept in gradient chunks (``p.grad`` stays None), and the
    state lives in the chunk groups rather than ``self.state``. ``state_dict()`` has
    ``torch.optim.AdamW``'s format (per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``).
    """

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
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(param_groups, defaults)
        self._rt = runtime
        self.adamw_mode = adamw_mode
        cfg = runtime.config
        self.scaler = (
            DynamicLossScaler(
                initial_scale=cfg.initial_scale,
                min_scale=cfg.min_scale,
                growth_factor=cfg.growth_factor,
                backoff_factor=cfg.backoff_factor,
                growth_interval=cfg.growth_interval,
                hysteresis=cfg.hysteresis,
                max_scale=cfg.max_scale,
            )
            if cfg.precision == "fp16"
            else None
        )
        self.report: MemoryReport | None = None
        self.reports_made = 0
        self._scaled_backwards = 0
        self._backward_passes_at_step = 0
        self._step_started = time.perf_counter()
        # The module's hooks keep the runtime alive as long as the module lives; the NVMe files
        # belong to the optimizer's states, so they go when the optimizer does.
        self._finalizer = weakref.finalize(self, runtime.close)

    # ------------------------------------------------------------------------------- API
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def timeline(self) -> WarmupTimeline | None:
        """The warm-up's per-period timeline in force (placement="auto", after the first step):
        each period's non-model peak and chunk groups, against the budget and reserve. The
        report of the step that ended the warm-up carries the same in ``report.timeline``."""
        plan = self._rt.plan
        return plan.timeline() if plan is not None else None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with the loss scaled under fp16."""
        if self.scaler is not None:
            self._scaled_backwards += 1
            loss = loss * self.scaler.scale
        loss.backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients (the gradient chunks' storage is kept for reuse);
        ``model.zero_grad()`` does the same."""
        self._rt.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step over every chunk group with gradients: all or nothing (see [Note: a step
        is all or nothing] in gemini/engine/transaction.py). If it raises, parameters, m, v, step counts
        and the loss scale are as before the call, and calling it again once the cause is fixed
        gives the uninterrupted result."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rt = self._rt
        rt.grad_views.hide()  # what torch code did to p.grad counts; no view outlives a chunk move
        try:
            if rt.tracing:
                if rt.hooks.backward_passes == rt._backward_passes_at_trace:
                    raise RuntimeError("optimizer.step() before any backward pass: nothing to step on")
                rt.finish_warmup()  # may raise DeviceBudgetError: nothing has been updated yet
            rt.check_step_peak()  # may raise DeviceBudgetError: nothing has been updated yet
            tx = StepTransaction(rt.storage, undo_on_nvme=rt.nvme is not None and rt.nvme.layout.undo_on_nvme)
            self._check_fp16_backward(tx)
            try:
                skipped, norm, seconds, scale = self._step(tx)
            except BaseException:
                tx.rollback()
                raise
            tx.commit()
            self._after_commit(skipped)
        finally:
            rt.grad_views.expose()  # torch keeps p.grad after the step, until zero_grad
        self._finish_report(skipped=skipped, grad_norm=norm, seconds=seconds, scale=scale)
        return loss

    # ------------------------------------------------------------------------- internals
    def _step(self, tx: StepTransaction) -> tuple[bool, float | None, dict[Tier, float], float]:
        """The step's phases 1-3 of [Note: a step is all or nothing]; returns (skipped, gradient
        norm, Adam seconds per tier, loss scale)."""
        rt = self._rt
        zero = rt.zero
        if zero is not None:
            agree_grad_ready(zero, rt.manager.trainable_groups)  # see [Note: the order of collectives]
        groups = [g for g in rt.manager.trainable_groups if g.any_grad_ready]
        nvme = rt.nvme
        streamed = [g for g in groups if nvme is not None and nvme.holds(g)]
        if streamed:
            nvme.begin_step(streamed, tx)
            nvme.prefetch(streamed)  # the first reads overlap the norm
        scale = self.loss_scale
        with trace_range("gemini::gather_for_step"):
            tiers = {g.index: rt.placement.before_step(g) for g in groups}
        norm = None
        if rt.config.clip_grad_norm > 0 or self.scaler is not None:
            with trace_range("gemini::grad_norm"):
                norm = grad_norm(groups, tiers, rt.param_order, zero=zero) / scale
        overflow = self.scaler is not None and not math.isfinite(norm.item())
        if self.scaler is not None:
            saved = self.scaler.state_dict()
            tx.on_rollback(lambda: self.scaler.load_state_dict(saved))
            self.scaler.update(overflow)
        seconds = {Tier.HOST: 0.0, Tier.DEVICE: 0.0}
        norm_value = None if norm is None else norm.item()
        if overflow:
            logger.info("fp16 overflow at step %d: step skipped, loss scale now %s", self.reports_made, self.loss_scale)
            if streamed:
                nvme.settle(streamed)  # the prefetched states are unchanged: their files stay current
            return True, norm_value, seconds, scale
        clip = rt.config.clip_grad_norm
        # torch.nn.utils.clip_grad_norm_'s arithmetic, in fp32, so results match it.
        clip_coef = clip_coefficient(norm, clip) if clip > 0 else None
        streamed_set = set(streamed)
        resident = [g for g in groups if g not in streamed_set]
        # Every temporary of the in-memory update, before anything changes (phase 1).
        batches = self._prepare(resident, tiers, scale, clip_coef, keep_grads=False)
        if streamed:
            stream = nvme.stream(streamed)
            try:
                for g in stream:
                    tx.save_values(g, *self._changed_in_memory(g))
                    for batch in self._prepare([g], tiers, scale, clip_coef, keep_grads=True):
                        seconds[batch.tier] += self._run(batch)
                    rt.placement.after_step(g)
            finally:
                stream.close()  # every write confirmed, or (after an error) every request ended
        for batch in batches:
            seconds[batch.tier] += self._run(batch)
        with trace_range("gemini::params_from_masters"):
            for g in resident:
                rt.placement.after_step(g)
        return False, norm_value, seconds, scale

    @staticmethod
    def _changed_in_memory(g: ChunkGroup) -> tuple[Chunk, int, int]:
        """(chunk, first element, elements) that a streamed group's update changes in memory:
        the parameters it holds (under fp32 the masters themselves; under bf16/fp16 the copy
        cast from the masters, which are on NVMe), this rank's range only under ZeRO-1/2."""
        if g.param_shard is not None:
            return g.param_shard, 0, g.param_shard.used_numel
        if g.shard is not None:
            return g.param, g.shard.start, g.shard.numel
        return g.param, 0, g.param.used_numel

    def _after_commit(self, skipped: bool) -> None:
        """What follows a landed step and changes no value: other ranks' updated ranges arrive,
        placements the step changed are restored."""
        rt = self._rt
        groups = [g for g in rt.manager.trainable_groups if g.any_grad_ready]
        if not skipped:
            if rt.zero is not None and rt.placement.gatherer is None:
                gather_params(rt.zero, groups, rt.storage)  # ZeRO-1/2: every rank's updated range
            for g in groups:
                rt.placement.after_commit(g)
        if rt.placement.gatherer is not None:
            rt.placement.gatherer.end_iteration()

    def _check_fp16_backward(self, tx: StepTransaction) -> None:
        passes = self._rt.hooks.backward_passes - self._backward_passes_at_step
        saved = (self._backward_passes_at_step, self._scaled_backwards)

        def restore() -> None:
            self._backward_passes_at_step, self._scaled_backwards = saved

        tx.on_rollback(restore)
        self._backward_passes_at_step = self._rt.hooks.backward_passes
        scaled, self._scaled_backwards = self._scaled_backwards, 0
        if self.scaler is not None and passes != scaled:
            restore()
            raise RuntimeError(
                f"precision='fp16' needs optimizer.backward(loss) so the loss is scaled; "
                f"{passes} backward pass(es) ran since the last step, {scaled} through optimizer.backward"
            )

    def _prepare(self, groups: list[ChunkGroup], tiers: dict[int, Tier], loss_scale: float,
                 clip_coef: torch.Tensor | None, *, keep_grads: bool) -> list[_Batch]:
        """The fused Adam calls over ``groups``, one per (tier, param group), with every
        temporary they need allocated: running them allocates nothing (see [Note: a step is all
        or nothing]). ``keep_grads``: clip into scratch, leaving the gradient chunks as they are
        (a streamed group's step may be undone and retried)."""
        by_key: dict[tuple[Tier, int], list[ChunkGroup]] = defaultdict(list)
        for g in groups:
            by_key[(tiers[g.index], g.param_group)].append(g)
        batches = []
        for (tier, pg), members in by_key.items():
            hp = self.param_groups[pg]
            device = self._rt.storage.tier_device(tier)
            batch = _Batch(tier=tier, members=members)
            for g in members:
                master = g.master_chunk
                if g.steps.device != master.payload(tier).device:
                    g.steps = g.steps.to(master.payload(tier).device)  # step counts live with the states
                if g.all_grads_ready and g.steps_uniform:
                    batch.whole.append(g)
                    views = g.step_views(tier)
                    batch.steps.append(g.steps[0])
                else:
                    ready = [s for s in g.os_slots if g.grad_ready[s.index]]
                    views = [list(v) for v in zip(*(g.slot_views(s, tier) for s in ready))] or [[], [], [], []]
                    batch.steps.extend(g.steps[s.index] for s in ready)
                    here = {s.index for s in ready}
                    batch.bump.extend((g, i) for i, r in enumerate(g.grad_ready) if r and i not in here)
                for out, got in zip((batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs), views):
                    if isinstance(got, list):
                        out.extend(got)
                    else:
                        out.append(got)
            beta1, beta2 = hp["betas"]
            batch.kwargs = dict(lr=hp["lr"], beta1=beta1, beta2=beta2, eps=hp["eps"], weight_decay=hp["weight_decay"],
                                decoupled_weight_decay=self.adamw_mode)
            # Host-tier work is host memory, even when the CPU stands in for the device.
            with self._rt.memory.quiet() if tier is Tier.HOST else contextlib.nullcontext():
                if loss_scale != 1.0:
                    batch.grad_scale = torch.tensor(loss_scale, dtype=torch.float32, device=device)
                if clip_coef is not None:
                    batch.coef = clip_coef.to(device)
                low = [t.numel() for t in batch.grads if t.dtype != torch.float32]
                if keep_grads and batch.coef is not None:
                    low = [t.numel() for t in batch.grads]
                if low:
                    # bf16/fp16 gradients become fp32 one tensor at a time, so the update holds
                    # at most one tensor of fp32 scratch (it may be on the device).
                    batch.scratch = torch.empty(max(low), dtype=torch.float32, device=device)
            batches.append(batch)
        return batches

    def _run(self, batch: _Batch) -> float:
        """One prepared Adam call (allocates nothing); returns its seconds."""
        tier, device = batch.tier, self._rt.storage.tier_device(batch.tier)
        quiet = self._rt.memory.quiet() if tier is Tier.HOST else contextlib.nullcontext()
        start = time.perf_counter()
        with trace_range(f"gemini::adam_{tier.value}"), quiet:
            if batch.scratch is None:
                calls = [(batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, batch.steps)]
            else:
                calls = [([p], [g], [m], [v], [s]) for p, g, m, v, s in
                         zip(batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, batch.steps)]
            for c_params, c_grads, c_m, c_v, c_steps in calls:
                if batch.scratch is not None:
                    c_grads = [batch.scratch[: g.numel()].view_as(g).copy_(g) for g in c_grads]
                if batch.coef is not None:
                    torch._foreach_mul_(c_grads, batch.coef)
                adam_update(c_params, c_grads, c_m, c_v, c_steps, grad_scale=batch.grad_scale, **batch.kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        for g in batch.whole:
            g.steps[1:].copy_(g.steps[:1].expand(len(g.slots) - 1))
        for g, i in batch.bump:
            g.steps[i] += 1
        whole = set(batch.whole)
        for g in batch.members:
            if g not in whole:  # a group stepped in parts may have become uniform
                g.steps_uniform = bool((g.steps == g.steps[0]).all())
        return seconds

    def _load_group_state(self, g: ChunkGroup, state: dict, saved_index: dict[int, int]) -> None:
        for slot, p in zip(g.slots, g.params):
            entry = state.get(saved_index[id(p)])
            if entry is None:
                g.steps[slot.index] = 0.0
                g.write_value(g.exp_avg, slot, torch.zeros(slot.shape))
                g.write_value(g.exp_avg_sq, slot, torch.zeros(slot.shape))
                continue
            g.steps[slot.index] = float(entry["step"])
            g.write_value(g.exp_avg, slot, entry["exp_avg"])
            g.write_value(g.exp_avg_sq, slot, entry["exp_avg_sq"])
        g.steps_uniform = bool((g.steps == g.steps[0]).all())

    def close(self) -> None:
        """Delete the NVMe files (states that lived only there are gone) and stop the I/O threads.

        Also done when the optimizer is garbage-collected and at interpreter exit.
        """
        self._finalizer()

    def _finish_report(self, *, skipped: bool, grad_norm: float | None, seconds: dict[Tier, float], scale: float) -> None:
        rt = self._rt
        now = time.perf_counter()
        ledger = rt.storage.ledger
        transfers = ledger.transfers
        report = MemoryReport(
            step=self.reports_made,
            device_peak_bytes=rt.device_peak_bytes(),
            device_model_bytes=ledger.bytes_on(Tier.DEVICE),
            device_non_model_peak_bytes=rt.device_non_model_peak_bytes(),
            host_model_bytes=ledger.bytes_on(Tier.HOST),
            nvme_bytes=ledger.bytes_on(Tier.NVME) - ledger.kind_bytes(Tier.NVME, UNDO_KIND),
            h2d_bytes=transfers.h2d_bytes,
            d2h_bytes=transfers.d2h_bytes,
            nvme_read_bytes=transfers.nvme_read_bytes,
            nvme_write_bytes=transfers.nvme_write_bytes,
            chunks_on_device=ledger.payloads(Tier.DEVICE),
            os_chunks_on_device=sum(g.exp_avg.is_on(Tier.DEVICE) for g in rt.manager.trainable_groups),
            step_seconds=now - self._step_started,
            transfer_seconds=transfers.seconds,
            optimizer_cpu_seconds=seconds[Tier.HOST],
            optimizer_device_seconds=seconds[Tier.DEVICE],
            skipped=skipped,
            loss_scale=scale,
            device_model_peak_bytes=ledger.peak_bytes(Tier.DEVICE),
            device_budget_bytes=rt.config.device_memory,
            grad_norm=grad_norm,
            host_rss_bytes=rt.system.host_rss_bytes(),
            nvme_wait_seconds=transfers.nvme_wait_seconds,
            host_pool_bytes=ledger.host_pool_bytes,
            os_chunks_total=len(rt.manager.trainable_groups),
            model_bytes_by_tier=rt.model_bytes_by_tier(),
            host_available_bytes=rt.system.host_available_bytes(),
            device_used_peak_bytes=rt.system.device_used_peak_bytes(),
            timeline=rt.take_timeline(),
            world_size=rt.manager.world,
            rank=rt.manager.rank,
            grad_reduce_bytes=transfers.grad_reduce_bytes,
            param_gathers=rt.placement.gatherer.gathers if rt.placement.gatherer is not None else 0,
            activation_offload_bytes=ledger.transfers.activation_d2h_bytes,
            activation_host_peak_bytes=ledger.activations.peak_bytes,
            activation_kept_bytes=ledger.transfers.activation_kept_bytes,
            nvme_undo_bytes=ledger.kind_bytes(Tier.NVME, UNDO_KIND),
        )
        self.report = report
        self.reports_made += 1
        if rt.report_writer is not None:
            try:
                rt.report_writer.write(report)
            except OSError as e:  # the step has landed: raising would invite a retry that steps twice
                logger.error("step %d landed, but its report could not be written: %s", report.step, e)
        if rt.placement.gatherer is not None:
            rt.placement.gatherer.gathers = 0
        rt.start_new_step()
        self._step_started = time.perf_counter()

    # ------------------------------------------------------------------------ checkpoints
    def _param_index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(p for hp in self.param_groups for p in hp["params"])}

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format: per-parameter step / exp_avg / exp_avg_sq, on the CPU.

        Under ZeRO this is the consolidated state (every rank's shards gathered): call it on
        every rank. It loads into any number of ranks, or into a plain ``torch.optim.AdamW``.
        """
        index = self._param_index()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for g in self._rt.manager.trainable_groups:
            steps = g.steps.cpu()
            if not bool((steps > 0).any()):
                continue  # torch creates state at a parameter's first step
            with self._rt.resident(g, modify=False):
                if g.shard is not None:  # every rank's ranges, gathered (a collective)
                    m, v = (gather_state(self._rt.zero, g, c) for c in (g.exp_avg, g.exp_avg_sq))
                else:
                    m, v = (c.payload() for c in (g.exp_avg, g.exp_avg_sq))
                for slot, p in zip(g.slots, g.params):
                    if steps[slot.index] == 0:
                        continue
                    state[index[id(p)]] = {
                        "step": steps[slot.index].clone(),
                        "exp_avg": m[slot.offset : slot.end].view(slot.shape).detach().cpu().clone(),
                        "exp_avg_sq": v[slot.offset : slot.end].view(slot.shape).detach().cpu().clone(),
                    }
        groups, extra = self._hyper_state()
        for entry, hp in zip(groups, self.param_groups):
            entry["params"] = [index[id(p)] for p in hp["params"]]
        return {"state": state, "param_groups": groups, "gemini": extra}

    # ---------------------------------------------------------------- sharded checkpoints
    def _hyper_state(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        groups = [{k: v for k, v in hp.items() if k != "params"} for hp in self.param_groups]
        extra = {"precision": self._rt.config.precision, "adamw_mode": self.adamw_mode}
        if self.scaler is not None:
            extra["loss_scaler"] = self.scaler.state_dict()
        return groups, extra

    def _load_hyper_state(self, saved_groups: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        for saved, hp in zip(saved_groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    hp[k] = tuple(v) if k == "betas" else v
        if self.scaler is not None and "loss_scaler" in extra:
            self.scaler.load_state_dict(extra["loss_scaler"])

    def _layout_signature(self) -> dict[str, Any]:
        manager = self._rt.manager
        return {"world": manager.world, "rank": manager.rank,
                "capacities": [g.param.capacity for g in self._rt.manager.groups],
                "precision": self._rt.config.precision}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the training state, with no communication: per chunk group this
        rank's range of the fp32 masters (frozen groups too) and, for trainable groups, of m and
        v, with the step counts. Loads (``load_sharded_state_dict``) only into the same world
        size, rank and chunk layout; use ``state_dict()`` to change them."""
        rt = self._rt
        groups = {}
        for g in rt.manager.groups:
            with rt.resident(g, modify=False) if g.trainable else contextlib.nullcontext():
                n = g.os_numel
                entry = {"master": self._master_range(g).detach().cpu().clone()}
                if g.trainable:
                    entry["exp_avg"] = g.exp_avg.payload()[:n].detach().cpu().clone()
                    entry["exp_avg_sq"] = g.exp_avg_sq.payload()[:n].detach().cpu().clone()
                    entry["steps"] = g.steps.detach().cpu().clone()
            groups[g.index] = entry
        hyper, extra = self._hyper_state()
        return {"layout": self._layout_signature(), "groups": groups, "param_groups": hyper, "gemini": extra}

    @staticmethod
    def _master_range(g: ChunkGroup) -> torch.Tensor:
        c = g.master_chunk
        if g.is_shard(c):
            return c.payload()[: g.shard.numel]
        start, end = (g.shard.start, g.shard.end) if g.shard is not None else (0, c.used_numel)
        return c.payload()[start:end].float()

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``sharded_state_dict`` saved on this rank: masters (so the parameters too),
        m, v and step counts. A collective under ZeRO-1/2 (the parameters are all-gathered)."""
        rt = self._rt
        saved, mine = state_dict["layout"], self._layout_signature()
        for key in ("world", "rank", "precision", "capacities"):
            if saved[key] != mine[key]:
                shown = (lambda v: f"{len(v)} chunk groups of capacities {v[:4]}...") if key == "capacities" else repr
                raise ValueError(f"sharded optimizer state has {key} {shown(saved[key])}, this run "
                                 f"{shown(mine[key])}: load the consolidated state_dict() instead")
        with torch.no_grad():
            for g in rt.manager.groups:
                entry = state_dict["groups"][g.index]
                with rt.resident(g, modify=True) if g.trainable else contextlib.nullcontext():
                    c = g.master_chunk
                    start = 0 if g.is_shard(c) else (g.shard.start if g.shard is not None else 0)
                    c.write_range(start, entry["master"])
                    if g.trainable:
                        g.exp_avg.write_range(0, entry["exp_avg"])
                        g.exp_avg_sq.write_range(0, entry["exp_avg_sq"])
                        g.steps.copy_(entry["steps"])
                        g.steps_uniform = bool((g.steps == g.steps[0]).all())
                    rt.placement.after_step(g)  # the parameters from the masters
            if rt.zero is not None and rt.placement.gatherer is None:
                gather_params(rt.zero, rt.manager.groups, rt.storage)
        self._load_hyper_state(state_dict["param_groups"], state_dict.get("gemini", {}))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}"
            )
        for i, (saved, hp) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(hp["params"]):
                raise ValueError(
                    f"param group {i}: the state has {len(saved['params'])} parameters, this optimizer {len(hp['params'])}"
                )
        saved_index = {}
        for saved, hp in zip(saved_groups, self.param_groups):
            for saved_i, p in zip(saved["params"], hp["params"]):
                saved_index[id(p)] = saved_i
        state = state_dict["state"]
        for g in self._rt.manager.trainable_groups:  # every check before the first write
            for slot, p in zip(g.slots, g.params):
                entry = state.get(saved_index[id(p)])
                for key in ("exp_avg", "exp_avg_sq"):
                    if entry is not None and tuple(entry[key].shape) != tuple(slot.shape):
                        raise ValueError(f"state for {slot.name}: {key} shape {tuple(entry[key].shape)} != "
                                         f"parameter shape {tuple(slot.shape)}")
        with torch.no_grad():
            for g in self._rt.manager.trainable_groups:
                # Every element of m and v is written: their files (maybe corrupted) are not read.
                with self._rt.resident(g, modify=True, chunks=(g.exp_avg, g.exp_avg_sq), overwrite=True):
                    self._load_group_state(g, state, saved_index)
        self._load_hyper_state(saved_groups, state_dict.get("gemini", {}))
