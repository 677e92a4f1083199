"""The planner: before training, where parameters, gradients and optimizer states will live.

From a model (its parameters may be on the meta device, so a model larger than this machine
can be planned) and a :class:`GeminiConfig`, :func:`plan_placement` lays out the chunk groups
exactly as :func:`gemini.initialize` will, applies the placement's rule and the NVMe tier's
choice, and says how many bytes of each chunk kind sit on the device, in host memory and on
NVMe at the end of a step — the figures ``MemoryReport.model_bytes_by_tier`` then measures —
and whether the budgets hold them.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch
from torch import nn

from chunks import ChunkKind, ChunkManager, ChunkStorage, Tier, missing_bytes
from gemini.config import GeminiConfig
from gemini.policies.footprint import (DeviceGroups, chunk_bytes, device_groups, margin_choice, margin_room_bytes, named_bytes,
                              whole_group_bytes)
from gemini.initialize import resolve_chunk_size, split_param_groups
from gemini.engine.memory import planned_reserve_bytes
from gemini.tools.meta_run import meta_peaks
from gemini.policies.nvme_choice import NvmeLayout, choose_nvme_groups, offloaded_bytes, undo_ratio
from gemini.tools.summary import readable_unit
from offload import format_size

__all__ = ["PlacementPlan", "plan_placement"]

# Rows of the plan's table: what a person asks about, and the chunk kinds behind it.
_ROWS = (
    ("parameters", (ChunkKind.PARAM,)),
    ("gradients", (ChunkKind.GRAD,)),
    ("optimizer states (fp32 master, m, v)", (ChunkKind.MASTER, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)),
)


@dataclass(kw_only=True)
class PlacementPlan:
    """Chunk bytes per tier and kind at the end of a step, and whether the budgets hold them."""

    placement: str
    precision: str
    chunk_size: int  # elements
    n_params: int
    chunk_groups: int
    trainable_groups: int
    os_groups_on_device: int  # trainable groups whose optimizer states live on the device
    nvme_groups: int  # trainable groups whose optimizer states live in NVMe files
    # tier ("device", "host", "nvme") -> chunk kind -> bytes, as in MemoryReport
    model_bytes_by_tier: dict[str, dict[str, int]]
    buffer_bytes: int  # module buffers, kept on the device
    device_working_set_bytes: int  # the largest chunk group's parameters and gradients
    nvme_staging_bytes: int  # host memory the NVMe pipeline uses while streaming
    # The step's copies aside of the streamed groups' parameters (gemini/engine/transaction.py): host
    # bytes at most, and bytes of their NVMe files when cpu_memory sends them there.
    nvme_undo_bytes: int = 0
    nvme_undo_file_bytes: int = 0
    device_budget_bytes: int | None
    cpu_memory_bytes: int | None
    host_available_bytes: int
    nvme_free_bytes: int | None
    # With example inputs (see gemini/tools/meta_run.py): the activations' and temporaries' peak of one
    # forward and backward, and the device's predicted peak (model data held then + that + the
    # safety reserve's share the warm-up would keep). None: not counted.
    non_model_peak_bytes: int | None = None
    device_peak_bytes: int | None = None  # every step after the first
    # The first step's: under "cuda"/"static" the device's gradient chunks do not exist yet at
    # its activation peak; under "auto" it is the warm-up, which holds only what it computes with.
    first_step_peak_bytes: int | None = None
    # placement "auto" with example inputs and a budget: the margin the warm-up will leave
    # (budget - reserve - the warm-up's peak), of which gpu_margin_mem_ratio holds whole groups.
    margin_bytes: int | None = None
    problems: list[str] = field(default_factory=list)  # why it does not fit; empty: it fits
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def tier_bytes(self, tier: str) -> int:
        return sum(self.model_bytes_by_tier[tier].values())

    def table(self) -> str:
        """Where each kind of model data goes, the totals, and the verdict."""
        tiers = [t.value for t in Tier]
        unit, scale = readable_unit(max(self.tier_bytes(t) for t in tiers))
        width = max(len(label) for label, _ in _ROWS)

        def row(label: str, cells: list[int]) -> str:
            return f"{label:<{width}}  " + "  ".join(f"{c / scale:>10.2f}" for c in cells)

        lines = [
            f"{self.n_params:,} parameters in {self.chunk_groups} chunk groups of {self.chunk_size:,} elements "
            f"({self.trainable_groups} trainable); placement={self.placement!r}, precision={self.precision!r}",
            f"{unit:<{width}}  " + "  ".join(f"{t:>10}" for t in tiers),
        ]
        for label, kinds in _ROWS:
            if kinds[0] is ChunkKind.MASTER and self.precision == "fp32":
                label = "optimizer states (m, v)"  # under fp32 the parameters are the master
            lines.append(row(label, [sum(self.model_bytes_by_tier[t][k.value] for k in kinds) for t in tiers]))
        lines.append(row("total", [self.tier_bytes(t) for t in tiers]))
        lines.append(
            f"optimizer-state chunk groups: {self.os_groups_on_device} on the device, {self.nvme_groups} on NVMe, "
            f"{self.trainable_groups - self.os_groups_on_device - self.nvme_groups} in host memory"
        )
        lines += [f"note: {n}" for n in self.notes]
        if self.fits and self.device_peak_bytes is not None:
            budget = "" if self.device_budget_bytes is None else f" of device_memory {format_size(self.device_budget_bytes)}"
            lines.append(f"fits: yes, predicted device peak {format_size(self.device_peak_bytes)}{budget}, "
                         f"activations included")
        elif self.fits:
            lines.append("fits: yes, for model data and buffers; activations and other non-model memory are not "
                         "counted (pass example_inputs to count them; the warm-up step measures them and refuses "
                         "a budget they do not fit)")
        else:
            lines.append("fits: NO")
            lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def plan_placement(model: nn.Module, config: GeminiConfig, *,
                   param_groups: list[dict[str, Any]] | None = None,
                   example_inputs: Sequence[Any] | None = None,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None) -> PlacementPlan:
    """Where ``initialize(model, config, param_groups=...)`` will put every chunk, before it runs.

    With ``example_inputs`` (the model's positional arguments: tensors, or ``(shape, dtype)``
    pairs) one forward and backward runs on the meta device — no memory, no compute — and the
    verdict counts the activations (``non_model_peak_bytes``, ``first_step_peak_bytes``,
    ``device_peak_bytes``; see [Note: the predicted device peak]). Under "auto" they also
    predict the margin the warm-up will leave, and ``gpu_margin_mem_ratio``'s groups in it are
    chosen by the engine's own rule (:func:`gemini.policies.footprint.margin_choice`); without them (or
    without ``device_memory``) auto's host and NVMe figures are those of ratio 0 and the notes
    say so. ``loss_fn(output)`` gives the scalar to differentiate (default: the
    sum of the first output). Without them the verdict says that activations were not counted.
    """
    _, named_groups, frozen = split_param_groups(model, param_groups)
    numels = [[p.numel() for _, p in g] for g in named_groups] + [[p.numel() for _, p in frozen]]
    chunk_size = resolve_chunk_size(config, numels)
    # The manager's layout needs no memory: the same groups register() will build.
    layout = ChunkManager(ChunkStorage(torch.device("cpu")), chunk_size=chunk_size,
                          param_dtype=config.param_dtype).layout(named_groups, frozen)
    trainable = [i for i, (_, pg, _) in enumerate(layout) if pg >= 0]
    elem = torch.empty((), dtype=config.param_dtype).element_size()
    buffer_bytes = sum(b.numel() * (elem if b.is_floating_point() else b.element_size()) for b in model.buffers())
    working_set = max((capacity * elem * (2 if pg >= 0 else 1) for _, pg, capacity in layout), default=0)
    non_model = peaks = None
    if example_inputs is not None:
        group_of = {named[m][0]: i for i, (members, pg, _) in enumerate(layout)
                    for named in [named_groups[pg] if pg >= 0 else frozen] for m in members}
        peaks = meta_peaks(model, example_inputs, loss_fn=loss_fn, param_dtype=config.param_dtype,
                           group_of=group_of, group_bytes=[capacity * elem for _, _, capacity in layout])
        non_model = peaks.non_model_bytes
    choice = device_groups(config, layout)
    margin = None
    if config.placement == "auto" and peaks is not None and config.device_memory is not None:
        margin = _auto_margin(config, layout, trainable, planned_peak_bytes=buffer_bytes + peaks.planned_peak_bytes,
                              non_model_bytes=non_model)
        choice = margin.choice
    os_on_device = [i for i in trainable if i in choice.whole]
    problems: list[str] = []
    notes: list[str] = []
    nvme = _nvme_layout(config, layout, trainable, [i for i in trainable if i not in choice.whole], problems)
    by_tier = named_bytes(chunk_bytes(layout, choice, param_dtype=config.param_dtype, nvme_groups=nvme.nvme_groups))
    plan = PlacementPlan(
        placement=config.placement, precision=config.precision, chunk_size=chunk_size,
        n_params=sum(n for group in numels for n in group), chunk_groups=len(layout),
        trainable_groups=len(trainable), os_groups_on_device=len(os_on_device), nvme_groups=len(nvme.nvme_groups),
        model_bytes_by_tier=by_tier, buffer_bytes=buffer_bytes, device_working_set_bytes=working_set,
        nvme_staging_bytes=nvme.staging_bytes, nvme_undo_bytes=nvme.undo_bytes,
        nvme_undo_file_bytes=_undo_file_bytes(nvme, layout, config), device_budget_bytes=config.device_memory,
        cpu_memory_bytes=config.cpu_memory, host_available_bytes=psutil.virtual_memory().available,
        nvme_free_bytes=_free_disk_bytes(config.nvme_dir), non_model_peak_bytes=non_model,
        margin_bytes=None if margin is None else margin.margin_bytes, problems=problems, notes=notes,
    )
    warmup_peak = None if peaks is None else buffer_bytes + peaks.warmup_peak_bytes
    planned_peak = buffer_bytes + peaks.planned_peak_bytes if peaks is not None and config.placement == "auto" else None
    _check_device(plan, config, warmup_peak, _auto_cached_bytes(layout, choice, config.param_dtype), planned_peak,
                  (0, 0) if peaks is None else (peaks.forward_non_model_bytes, peaks.backward_non_model_bytes))
    _check_host_and_nvme(plan, config)
    return plan


def _nvme_layout(config: GeminiConfig, layout, trainable: list[int], host_groups: list[int],
                 problems: list[str]) -> NvmeLayout:
    """The NVMe tier's choice among the groups whose optimizer states are on the host tier."""
    os_bytes = offloaded_bytes(layout, host_groups, config.param_dtype)
    if config.cpu_memory is None and config.nvme_dir is None:
        return NvmeLayout(frozenset(), sum(b for _, b in os_bytes), 0, 0)

    def choose(indices: list[int]) -> NvmeLayout:
        return choose_nvme_groups(offloaded_bytes(layout, indices, config.param_dtype), cpu_memory=config.cpu_memory,
                                  fraction=config.nvme_offload_fraction, depth=config.nvme_pipeline_depth,
                                  nvme_available=config.nvme_dir is not None, undo_ratio=undo_ratio(config.param_dtype))

    try:
        # initialize() chooses among every trainable group while registering (before a placement
        # takes some onto the device), then again among those left on the host tier.
        choose(trainable)
        return choose(host_groups)
    except ValueError as e:
        problems.append(str(e))
        return NvmeLayout(frozenset(), sum(b for _, b in os_bytes), 0, 0)


@dataclass(frozen=True)
class _AutoMargin:
    margin_bytes: int
    choice: DeviceGroups


def _auto_margin(config: GeminiConfig, layout, trainable: list[int], *, planned_peak_bytes: int,
                 non_model_bytes: int) -> _AutoMargin:
    """The margin the warm-up will leave (``MemoryPlan.margin_bytes``, from the warm-up replayed
    on meta) and the groups ``gpu_margin_mem_ratio`` keeps in it, by the engine's own rule
    (``AutoPlacement.adopt``)."""
    reserve = planned_reserve_bytes(non_model_bytes, config.resolved_device())
    margin = config.device_memory - reserve - planned_peak_bytes
    room = margin_room_bytes(margin, config.gpu_margin_mem_ratio, param_dtype=config.param_dtype,
                             largest_capacity=max((layout[i][2] for i in trainable), default=0))
    costs = [(i, whole_group_bytes(layout[i][2], param_dtype=config.param_dtype)) for i in trainable]
    return _AutoMargin(margin, DeviceGroups(whole=margin_choice(costs, room)))


def _auto_cached_bytes(layout, choice: DeviceGroups, param_dtype: torch.dtype) -> int:
    """What placement "auto" holds on the device once nothing presses it: the margin's whole
    groups, every other group's parameters, and one gradient chunk being filled."""
    elem = torch.empty((), dtype=param_dtype).element_size()
    pinned = sum(whole_group_bytes(cap, param_dtype=param_dtype) for i, (_, _, cap) in enumerate(layout)
                 if i in choice.whole)
    params = sum(cap * elem for i, (_, _, cap) in enumerate(layout) if i not in choice.whole)
    grad = max((cap * elem for i, (_, pg, cap) in enumerate(layout) if pg >= 0 and i not in choice.whole), default=0)
    return pinned + params + grad


def _predict_peaks(plan: PlacementPlan, config: GeminiConfig, reserve: int, warmup_peak_bytes: int,
                   auto_cached_bytes: int, forward_non_model_bytes: int, backward_non_model_bytes: int
                   ) -> tuple[int, int, str]:
    """(first step's peak, later steps' peak, what the model data on the device is) from the
    meta run's non-model peak; see [Note: the predicted device peak]."""
    # [Note: the predicted device peak]
    # The activation peak (the end of forward, the start of backward) meets the model data the
    # placement holds then:
    # - "cuda" and "static": the chunks they keep. Under "static" (and "cuda" with fp16) the
    #   gradient chunks come as the gradients do, so the first step's activation peak lacks
    #   them; under "cuda" they are there as its backward begins;
    # - "cpu": the groups visiting for compute, replayed on meta with the activations (see
    #   [Note: the warm-up replayed on meta] in gemini/tools/meta_run.py);
    # - "auto": its first step is the warm-up, which behaves like "cpu", and then brings the
    #   margin's groups to the device for its optimizer step. Later it keeps every
    #   parameter chunk it fetched, and the margin's whole groups, until the budget less the
    #   reserve makes it evict: the peak is the lesser of all of that and the budget's limit.
    nm = plan.non_model_peak_bytes
    fixed = plan.buffer_bytes + nm
    device = plan.model_bytes_by_tier["device"]
    if config.placement in ("cuda", "static"):
        steady = sum(device.values()) + fixed
        if config.placement == "static" and plan.model_bytes_by_tier["host"][ChunkKind.PARAM.value]:
            steady += plan.device_working_set_bytes  # host-only groups visit for compute
        grads = device[ChunkKind.GRAD.value]
        if config.placement == "cuda" and config.precision != "fp16":
            # Autograd accumulates into the gradient chunks, allocated as the first backward
            # begins (see [Note: autograd accumulates into the chunks] in gemini/engine/grad_views.py):
            # a peak in the forward or the loss comes before them.
            first = steady - nm - grads + max(forward_non_model_bytes, backward_non_model_bytes + grads)
            return first, steady, "the chunks it keeps"
        return steady - grads, steady, "the chunks it keeps"
    first = warmup_peak_bytes
    if config.placement == "cpu":
        return first, first, "the chunk groups visiting it for compute"
    # The first step ends the warm-up: the margin's groups come to the device, whole, and Adam
    # updates them there once the activations are gone.
    first = max(first, sum(device.values()) + plan.buffer_bytes)
    cached = auto_cached_bytes + fixed
    if plan.device_budget_bytes is not None:
        cached = min(cached, plan.device_budget_bytes - reserve)
    return first, max(first, cached), ("the parameter chunks it caches and the margin's whole groups (its "
                                        "warm-up: the chunk groups visiting for compute)")


def _check_device(plan: PlacementPlan, config: GeminiConfig, warmup_peak_bytes: int | None,
                  auto_cached_bytes: int, planned_peak_bytes: int | None = None,
                  split_non_model_bytes: tuple[int, int] = (0, 0)) -> None:
    device_bytes = plan.tier_bytes("device") + plan.buffer_bytes
    budget = config.device_memory
    if config.placement == "auto":
        if config.gpu_margin_mem_ratio == 0:
            share = "optimizer states stay on the host (gpu_margin_mem_ratio=0)"
        elif plan.margin_bytes is not None:
            share = (f"the warm-up will leave a margin of {format_size(max(0, plan.margin_bytes))}; "
                     f"gpu_margin_mem_ratio={config.gpu_margin_mem_ratio:g} of it holds {plan.os_groups_on_device} "
                     f"whole chunk groups (their optimizer states are updated on the device)")
        else:
            share = (f"gpu_margin_mem_ratio={config.gpu_margin_mem_ratio:g} also moves optimizer states into the "
                     f"margin the warm-up measures; without example_inputs and device_memory that margin is "
                     f"unknown, so host and NVMe are shown as at ratio 0 (they shrink by what moves)")
        plan.notes.append("auto: parameter chunks are cached on the device as the budget allows after the warm-up; "
                          + share)
    if config.offload_activations:
        plan.notes.append(
            f"offload_activations: saved activations of at least {format_size(config.activation_offload_min_bytes)} "
            "wait in host memory between forward and backward (their bytes are measured at warm-up and reported as "
            "activation_offload_bytes)" + ("; the margin left by gpu_margin_mem_ratio keeps the last ones on the "
                                            "device" if config.placement == "auto" else ""))
    if config.placement in ("cpu", "auto"):
        # Chunks visit the device for compute: at least the largest group's parameters and gradients.
        device_bytes += plan.device_working_set_bytes
        what = "the largest chunk group's parameters and gradients visiting it"
    else:
        what = "the chunks it keeps"
    if plan.non_model_peak_bytes is not None:
        reserve = planned_reserve_bytes(plan.non_model_peak_bytes, config.resolved_device())
        plan.first_step_peak_bytes, plan.device_peak_bytes, what = _predict_peaks(
            plan, config, reserve, warmup_peak_bytes, auto_cached_bytes, *split_non_model_bytes)
        peak = max(plan.first_step_peak_bytes, plan.device_peak_bytes)
        plan.notes.append(f"predicted device peak {format_size(plan.device_peak_bytes)} (first step "
                          f"{format_size(plan.first_step_peak_bytes)}): {what}, buffers, and activations and "
                          f"temporaries (at most {format_size(plan.non_model_peak_bytes)} at once: one forward and "
                          f"backward on the meta device); the warm-up keeps a reserve of {format_size(reserve)} besides")
        if budget is None:
            return
        needed, why = peak, "at its peak"
        if planned_peak_bytes is not None and planned_peak_bytes > peak:
            # The warm-up refuses a budget its planned peak does not fit (MemoryPlan.planned_peak_bytes).
            needed, why = planned_peak_bytes, "for the warm-up's plan, each period's chunks with its activations"
        missing = missing_bytes(budget, needed, reserve)
        if missing:
            advice = "" if config.placement in ("cpu", "auto") else ", or placement 'cpu'/'auto'"
            plan.problems.append(
                f"the device needs {format_size(needed + reserve)} {why} ({format_size(needed)} predicted, "
                f"{format_size(reserve)} of reserve) but device_memory is {format_size(budget)}: "
                f"{format_size(missing)} are missing; raise device_memory, use activation checkpointing or "
                f"offload_activations, or a smaller batch{advice}")
        return
    if budget is None:
        plan.notes.append(f"no device budget: the whole device; it needs {format_size(device_bytes)} for {what}, "
                          f"plus activations")
        return
    missing = missing_bytes(budget, device_bytes)
    if missing:
        plan.problems.append(
            f"the device needs {format_size(device_bytes)} for {what} (with buffers) but device_memory is "
            f"{format_size(budget)}: {format_size(missing)} are missing; raise device_memory, use a "
            f"smaller chunk_size, or placement 'cpu'/'auto'")
    else:
        plan.notes.append(f"the device keeps {format_size(budget - device_bytes)} of its {format_size(budget)} budget "
                          f"for activations and other non-model memory (measured at warm-up)")


def _check_host_and_nvme(plan: PlacementPlan, config: GeminiConfig) -> None:
    host_bytes = plan.tier_bytes("host") + plan.nvme_staging_bytes + plan.nvme_undo_bytes
    if config.resolved_device().type == "cpu":
        host_bytes += plan.tier_bytes("device")  # the CPU stand-in's "device" is host memory too
    if host_bytes > plan.host_available_bytes:
        knob = ("set cpu_memory and nvme_dir to move optimizer states to NVMe" if config.placement != "cuda" else
                "with placement 'cpu', 'auto' or 'static', cpu_memory and nvme_dir move optimizer states to NVMe")
        plan.problems.append(
            f"host memory: {format_size(host_bytes)} needed, {format_size(plan.host_available_bytes)} available now; "
            f"{knob}")
    if plan.nvme_staging_bytes:
        plan.notes.append(f"the NVMe pipeline stages up to {format_size(plan.nvme_staging_bytes)} in host memory")
    nvme_bytes = plan.tier_bytes("nvme")
    if nvme_bytes:
        undo = (f"{format_size(plan.nvme_undo_file_bytes)} of files and {format_size(plan.nvme_undo_bytes)} of host "
                f"memory" if plan.nvme_undo_file_bytes else f"{format_size(plan.nvme_undo_bytes)} of host memory")
        plan.notes.append(f"a step is all or nothing: it holds the NVMe files from before it while writing new ones "
                          f"(up to {format_size(2 * nvme_bytes + plan.nvme_undo_file_bytes)} on the drive) and "
                          f"copies the streamed groups' parameters aside ({undo})")
        nvme_bytes = 2 * nvme_bytes + plan.nvme_undo_file_bytes  # at the peak of a step
    if config.nvme_dir is not None and not os.path.isdir(config.nvme_dir):
        plan.problems.append(f"nvme_dir {os.fspath(config.nvme_dir)!r} is not a folder: create it (or mount the "
                             f"drive) first")
    elif plan.nvme_free_bytes is not None and nvme_bytes > plan.nvme_free_bytes:
        plan.problems.append(f"NVMe: {format_size(nvme_bytes)} of files but {format_size(plan.nvme_free_bytes)} free "
                             f"under {os.fspath(config.nvme_dir)}")


def _undo_file_bytes(nvme: NvmeLayout, layout, config: GeminiConfig) -> int:
    """Bytes of the NVMe files holding the step's copies aside, when they go to files."""
    if not nvme.undo_on_nvme:
        return 0
    ratio = undo_ratio(config.param_dtype)
    return sum(math.ceil(b * ratio) for _, b in offloaded_bytes(layout, sorted(nvme.nvme_groups), config.param_dtype))


def _free_disk_bytes(folder: str | os.PathLike | None) -> int | None:
    """Free space in ``folder``; None without one (or when it does not exist yet)."""
    if folder is None or not os.path.isdir(folder):
        return None
    return shutil.disk_usage(folder).free
