"""The fused Adam calls of a step over chunk groups, one per (tier, param group), prepared with every temporary
before any runs (phase 1 of [Note: a step is all or nothing] in gemini/engine/transaction.py), so that running them
allocates nothing and cannot fail part-way."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from chunks import ChunkGroup, Tier
from gemini.optim.adam import adam_update
from offload.profiling import trace_range

if TYPE_CHECKING:
    from gemini.engine.runtime import GeminiRuntime

__all__ = ["AdamBatch", "AdamClock", "device_first", "prepare_batches", "recheck_uniform", "run_batch"]


@dataclass
class AdamBatch:
    """One fused Adam call: same tier, same param group."""

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
    tails: list[torch.Tensor] = field(default_factory=list)  # their step counts after the first, one per group
    bump: list[tuple[ChunkGroup, int]] = field(default_factory=list)  # gradients wholly on other ranks' shards


def _quiet(rt: GeminiRuntime, tier: Tier):
    """Host-tier work is host memory, even when the CPU stands in for the device."""
    return rt.memory.quiet() if tier is Tier.HOST else contextlib.nullcontext()


# [Note: host groups updated as their gradients land]
# A group whose optimizer states live on the host sends its gradients there as soon as its backward is over
# (``Residency.after_backward``, an asynchronous copy), and the CPU launches the backward's kernels ahead of the GPU,
# so ``step()`` may begin while the GPU still computes the backward of the first layers (``p.grad`` waits only when
# torch code touches it: [Note: gradients still crossing to the host] in gemini/engine/grad_views.py). So the host's
# Adam is one fused call per run of consecutive groups holding at least HOST_BATCH_ELEMENTS, not one per param group;
# the runs go from the last group to the first (the order a backward finishes them: groups follow the forward's
# order); their views are cut without waiting for the copies (``Chunk.payload(wait=False)``), each run waiting for its
# own groups' copies just before its kernel (``run_batch``); and a run's device parameters start back right after it
# (``HybridAdam._step``). On a GPU the CPU's Adam then overlaps the rest of the backward and the copies both ways, as
# torchao's CPUOffloadOptimizer does per parameter, instead of waiting for every gradient before the first update.
# Runs are not cut smaller: a fused call costs tens of microseconds, more than a smaller run hides. Elementwise math
# gives the same bits however the runs are cut.
HOST_BATCH_ELEMENTS = 4 << 20  # 16 MiB of fp32


def prepare_batches(rt: GeminiRuntime, groups: list[ChunkGroup], tiers: dict[int, Tier],
                    param_groups: list[dict[str, Any]], *, adamw_mode: bool, loss_scale: float,
                    clip_coef: torch.Tensor | None, keep_grads: bool) -> list[AdamBatch]:
    """The fused Adam calls over ``groups`` (each updated on ``tiers[g.index]``), every temporary allocated: one per
    param group on the device, one per run of at least HOST_BATCH_ELEMENTS on the host (see [Note: host groups updated
    as their gradients land]). ``keep_grads``: clip into scratch, leaving the gradient chunks as they are (a streamed
    group's step may be undone and retried)."""
    by_key: dict[tuple[Tier, int], list[ChunkGroup]] = defaultdict(list)
    for g in groups:
        by_key[(tiers[g.index], g.param_group)].append(g)
    batches = []
    scalars: dict[Tier, tuple[torch.Tensor | None, torch.Tensor | None]] = {}  # one per tier, shared by its runs
    for (tier, pg), all_members in by_key.items():
        if tier not in scalars:
            device = rt.storage.tier_device(tier)
            with _quiet(rt, tier):
                scalars[tier] = (torch.tensor(loss_scale, dtype=torch.float32, device=device) if loss_scale != 1.0
                                 else None, clip_coef.to(device) if clip_coef is not None else None)
        cuts = _host_runs(all_members[::-1], HOST_BATCH_ELEMENTS) if tier is Tier.HOST else [all_members]
        runs = [_prepare(rt, tier, members, param_groups[pg], adamw_mode=adamw_mode, scalars=scalars[tier])
                for members in cuts]
        scratch = max(_scratch_numel(b, keep_grads) for b in runs)
        if scratch:
            # bf16/fp16 gradients become fp32 one tensor at a time: at most one tensor of fp32 scratch (maybe on
            # the device), shared by the runs in turn.
            with _quiet(rt, tier):
                shared = torch.empty(scratch, dtype=torch.float32, device=rt.storage.tier_device(tier))
            for b in runs:
                b.scratch = shared if _scratch_numel(b, keep_grads) else None
        batches += runs
    return batches


def _scratch_numel(batch: AdamBatch, keep_grads: bool) -> int:
    """The fp32 room ``batch`` needs for one gradient at a time (low-precision, or clipped aside under
    ``keep_grads``); 0 when none."""
    low = [t.numel() for t in batch.grads if t.dtype != torch.float32 or (keep_grads and batch.coef is not None)]
    return max(low, default=0)


def _host_runs(members: list[ChunkGroup], min_elements: int) -> list[list[ChunkGroup]]:
    """``members`` cut into runs of consecutive groups holding at least ``min_elements`` each (the last run takes
    what is left)."""
    runs: list[list[ChunkGroup]] = [[]]
    held = 0
    for g in members:
        if held >= min_elements:
            runs.append([])
            held = 0
        runs[-1].append(g)
        held += g.os_numel
    return runs


def _prepare(rt: GeminiRuntime, tier: Tier, members: list[ChunkGroup], hp: dict[str, Any], *, adamw_mode: bool,
             scalars: tuple[torch.Tensor | None, torch.Tensor | None]) -> AdamBatch:
    """One batch over ``members`` on ``tier``; ``scalars``: (loss scale, clipping coefficient) on the tier's device,
    or None."""
    batch = AdamBatch(tier=tier, members=members)
    batch.grad_scale, batch.coef = scalars
    with _quiet(rt, tier):  # the host's step counts: see [Note: step counts are where the states are]
        for g in members:
            _add_member(batch, g, tier)
    beta1, beta2 = hp["betas"]
    batch.kwargs = dict(lr=hp["lr"], beta1=beta1, beta2=beta2, eps=hp["eps"], weight_decay=hp["weight_decay"],
                        decoupled_weight_decay=adamw_mode)
    return batch


# [Note: step counts are where the states are]
# Adam's step counts (``ChunkGroup.steps``, a small tensor per group) live with the group's optimizer states. On the
# CPU stand-in the accounting monitor counts for good every device-type storage an operator touches, and host-tier
# step counts are CPU tensors too, so every operator on them (indexing, increment, uniformity check, copy aside) runs
# quiet, as host-tier payloads do. Device-tier ones are counted from the first window on
# (``gemini.engine.memory.model_tensors_on``), so the first iteration's peak has them as every later one does (see
# [Note: what every step keeps is there from the first] in gemini/engine/residency.py).
def _add_member(batch: AdamBatch, g: ChunkGroup, tier: Tier) -> None:
    """``g``'s tensors and step counts into ``batch``, updated on ``tier``."""
    master = g.master_chunk
    if g.steps.device != master.payload(tier, wait=False).device:
        g.steps = g.steps.to(master.payload(tier, wait=False).device)  # step counts live with the states
    if g.all_grads_ready and g.steps_uniform:
        batch.whole.append(g)
        views = g.step_views(tier)  # cut without waiting: [Note: host groups updated as their gradients land]
        first, tail = g.count_views()
        batch.steps.append(first)
        if len(g.slots) > 1:
            batch.tails.append(tail)
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


class AdamClock:
    """Seconds in the Adam kernels, per tier of the update.

    [Note: both halves of a hybrid step at once]
    On CUDA the device's fused Adam is launched, not waited for: the step runs the device batches first
    (``device_first``) and the host's kernels then run on the CPU while the GPU is busy, so a hybrid step costs about
    the longer half, not the sum. The device half is timed by CUDA events, read once at the end of the step
    (:meth:`seconds`); the host half, and every batch on the CPU stand-in, by the clock around the call.
    """

    def __init__(self) -> None:
        self._seconds = {Tier.HOST: 0.0, Tier.DEVICE: 0.0}
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def add(self, tier: Tier, seconds: float) -> None:
        self._seconds[tier] += seconds

    def add_events(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """A device call between two recorded events, read at :meth:`seconds`."""
        self._events.append((start, end))

    def seconds(self) -> dict[Tier, float]:
        """Per tier; waits for the device's kernels to end."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds[Tier.DEVICE] += sum(a.elapsed_time(b) for a, b in self._events) / 1000  # events say ms
            self._events.clear()
        return dict(self._seconds)


def device_first(batches: list[AdamBatch]) -> list[AdamBatch]:
    """The order to run ``batches`` in (see [Note: both halves of a hybrid step at once])."""
    return sorted(batches, key=lambda b: b.tier is not Tier.DEVICE)


def run_batch(rt: GeminiRuntime, batch: AdamBatch, clock: AdamClock) -> None:
    """One prepared Adam call (allocates nothing), timed on ``clock``."""
    tier, device = batch.tier, rt.storage.tier_device(batch.tier)
    events = None
    if device.type == "cuda":
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    if tier is Tier.HOST:  # the copies its views were cut before ([Note: host groups updated as their gradients land])
        for g in batch.members:
            for chunk in g.step_chunks:
                chunk.wait_host()
    start = time.perf_counter()
    with trace_range(f"gemini::adam_{tier.value}"), _quiet(rt, tier):
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
    if events is not None:
        events[1].record()
        clock.add_events(*events)
    else:
        clock.add(tier, time.perf_counter() - start)
    with _quiet(rt, tier):  # see [Note: step counts are where the states are]
        if batch.tails:
            # The kernel added 1 to each whole group's first count; the others were equal to it.
            torch._foreach_add_(batch.tails, 1.0)
        for g, i in batch.bump:
            g.steps[i] += 1


def recheck_uniform(rt: GeminiRuntime, batch: AdamBatch) -> None:
    """A group stepped in parts may have become uniform. Reading that waits for the kernel: on CUDA, done once every
    batch is launched (see [Note: both halves of a hybrid step at once])."""
    whole = set(batch.whole)
    with _quiet(rt, batch.tier):  # see [Note: step counts are where the states are]
        for g in batch.members:
            if g not in whole:
                g.steps_uniform = bool((g.steps == g.steps[0]).all())
