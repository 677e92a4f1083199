"""The planner: before training, where parameters, gradients and optimizer states will live.

From a model (its parameters may be on the meta device, so a model larger than this machine can be planned) and a
:class:`GeminiConfig`, :func:`plan_placement` lays out the chunk groups exactly as :func:`gemini.initialize` will,
applies the placement's rule and the NVMe tier's choice, and says how many bytes of each chunk kind sit on the
device, in host memory and on NVMe at the end of a step (what ``MemoryReport.model_bytes_by_tier`` then measures) and
whether the budgets hold them. What differs between placements is answered per placement in gemini/tools/forecast.py.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import dataclasses
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch
from torch import nn

from chunks import ChunkKind, ChunkManager, ChunkStorage, Tier, missing_bytes
from gemini.config import GeminiConfig
from gemini.policies import check_supported, device_groups
from gemini.policies.footprint import chunk_bytes, named_bytes
from gemini.initialize import resolve_chunk_size, split_param_groups
from gemini.parallel.zero import resolve_group
from gemini.tools.forecast import PlacementForecast, forecast_for, forecast_type
from gemini.tools.meta_run import meta_peaks
from gemini.policies.nvme_choice import NvmeLayout, choose_nvme_groups, offloaded_bytes, shallower_pipeline, undo_ratio
from gemini.tools.summary import readable_unit
from offload import format_size

logger = logging.getLogger(__name__)

__all__ = ["PlacementPlan", "plan_placement"]

# Rows of the plan's table: what a person asks about, and the chunk kinds behind it.
_ROWS = (
    ("parameters", (ChunkKind.PARAM, ChunkKind.PARAM_SHARD)),
    ("gradients", (ChunkKind.GRAD, ChunkKind.GRAD_SHARD)),
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
    # The step's copies aside of the streamed groups' parameters (gemini/engine/transaction.py): host bytes at most,
    # and bytes of their NVMe files when cpu_memory sends them there.
    nvme_undo_bytes: int = 0
    nvme_undo_file_bytes: int = 0
    device_budget_bytes: int | None
    cpu_memory_bytes: int | None
    host_available_bytes: int
    nvme_free_bytes: int | None
    # With example inputs (see gemini/tools/meta_run.py): the activations' and temporaries' peak of one forward and
    # backward, and the device's predicted peak (model data held then + that + the reserve the warm-up would keep).
    # None: not counted.
    non_model_peak_bytes: int | None = None
    device_peak_bytes: int | None = None  # every step after the first
    # The first step's: under "auto" it is the warm-up, which holds only what it computes with.
    first_step_peak_bytes: int | None = None
    # placement "auto" with example inputs and a budget: the margin the warm-up will leave (budget - reserve - the
    # warm-up's peak), of which gpu_margin_mem_ratio holds whole groups.
    margin_bytes: int | None = None
    # ZeRO: every figure above is one of ``world_size`` ranks'; ``ranks_per_host`` of them share one host's memory
    # (see [Note: a plan under ZeRO]).
    world_size: int = 1
    ranks_per_host: int = 1
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


def plan_placement(model: nn.Module, config: GeminiConfig | None, *,
                   param_groups: list[dict[str, Any]] | None = None,
                   example_inputs: Sequence[Any] | None = None,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None,
                   world_size: int | None = None, ranks_per_host: int | None = None) -> PlacementPlan:
    """Where ``initialize(model, config, param_groups=...)`` will put every chunk, before it runs.

    With ``example_inputs`` (the model's positional arguments: tensors, or ``(shape, dtype)`` pairs) one forward and
    backward runs on the meta device (no memory, no compute) and the verdict counts the activations
    (``non_model_peak_bytes``, ``first_step_peak_bytes``, ``device_peak_bytes``; see
    [Note: the predicted device peak] in gemini/tools/forecast.py). Under "auto" they also predict the margin the
    warm-up will leave, and ``gpu_margin_mem_ratio``'s groups in it are chosen by the engine's rule
    (:func:`gemini.policies.footprint.margin_choice`); without them (or without ``device_memory``) auto's host and
    NVMe figures are those of ratio 0 and the notes say so. ``loss_fn(output)`` gives the scalar to differentiate
    (default: the sum of the first output). Without example inputs the verdict says activations were not counted.

    Under ZeRO the figures are one rank's: ``world_size`` ranks (default: as ``initialize`` resolves
    ``GeminiConfig.process_group``, torch.distributed's world where it is initialized), ``ranks_per_host`` of them on
    each host (default: torchrun's ``LOCAL_WORLD_SIZE``, or all of ``world_size`` when it is given); see
    [Note: a plan under ZeRO].
    """
    config = GeminiConfig() if config is None else config  # as initialize takes it
    if not isinstance(config, GeminiConfig):
        raise TypeError(f"config must be a GeminiConfig or None, got {type(config).__name__}")
    config = config.checked()  # as initialize checks it: fields set after construction too
    if loss_fn is not None and example_inputs is None:
        raise ValueError("loss_fn is given but example_inputs is not: the loss runs on the model's output for "
                         "example_inputs; pass both (or neither: activations are then not counted)")
    check_supported(config)  # what initialize refuses, the plan does not call fitting
    world, per_host = _ranks(config, world_size, ranks_per_host)
    _, named_groups, frozen = split_param_groups(model, param_groups)
    numels = [[p.numel() for _, p in g] for g in named_groups] + [[p.numel() for _, p in frozen]]
    chunk_size = resolve_chunk_size(config, numels, world=world)
    # The manager's layout needs no memory: the same groups register() will build.
    manager = ChunkManager(ChunkStorage(torch.device("cpu")), chunk_size=chunk_size, param_dtype=config.param_dtype,
                           world=world, shard_params=config.shard_params)
    layout = manager.layout(named_groups, frozen)
    # The forecasts read shard_params as ZeRO-3 in effect (with one rank it shards nothing).
    config = dataclasses.replace(config, shard_params=manager.shard_params)
    trainable = [i for i, (_, pg, _) in enumerate(layout) if pg >= 0]
    elem = config.param_dtype.itemsize
    buffer_bytes = sum(b.numel() * (elem if b.is_floating_point() else b.element_size()) for b in model.buffers())
    working_set = max((capacity * elem * (2 if pg >= 0 else 1) for _, pg, capacity in layout), default=0)
    non_model = peaks = None
    run = None
    if example_inputs is not None:
        group_of = {named[m][0]: i for i, (members, pg, _) in enumerate(layout)
                    for named in [named_groups[pg] if pg >= 0 else frozen] for m in members}
        run = functools.partial(
            meta_peaks, model, example_inputs, loss_fn=loss_fn, param_dtype=config.param_dtype,
            device_type=config.resolved_device().type, residents=forecast_type(config).residents(config, layout),
            offload_min_bytes=config.activation_offload_min_bytes if config.offload_activations else None,
            group_of=group_of, group_bytes=[capacity * elem for _, _, capacity in layout])
        peaks = run()
        non_model = peaks.non_model_bytes
    forecast = forecast_for(config, layout, buffer_bytes=buffer_bytes, peaks=peaks)
    if (keep_from := forecast.activations_kept_from()) is not None:
        forecast.later_peaks = run(offload_keep_from=keep_from)  # auto's later steps keep the last ones
    forecast.settle()
    choice = forecast.choice
    os_on_device = [i for i in trainable if i in choice.whole]
    problems: list[str] = []
    notes: list[str] = []
    nvme = _nvme_layout(config, layout, trainable, [i for i in trainable if i not in choice.whole], problems,
                        world=world)
    by_tier = named_bytes(chunk_bytes(layout, choice, param_dtype=config.param_dtype, nvme_groups=nvme.nvme_groups,
                                      world=world, shard_params=manager.shard_params))
    plan = PlacementPlan(
        placement=config.placement, precision=config.precision, chunk_size=chunk_size,
        n_params=sum(n for group in numels for n in group), chunk_groups=len(layout),
        trainable_groups=len(trainable), os_groups_on_device=len(os_on_device), nvme_groups=len(nvme.nvme_groups),
        model_bytes_by_tier=by_tier, buffer_bytes=buffer_bytes, device_working_set_bytes=working_set,
        nvme_staging_bytes=nvme.staging_bytes, nvme_undo_bytes=nvme.undo_bytes,
        nvme_undo_file_bytes=_undo_file_bytes(nvme, layout, config, world), device_budget_bytes=config.device_memory,
        cpu_memory_bytes=config.cpu_memory, host_available_bytes=psutil.virtual_memory().available,
        nvme_free_bytes=_free_disk_bytes(config.nvme_dir), non_model_peak_bytes=non_model,
        margin_bytes=forecast.margin_bytes, world_size=world, ranks_per_host=per_host, problems=problems, notes=notes,
    )
    if world > 1:
        plan.notes.append(
            f"ZeRO across {world} ranks ({per_host} on this host): every figure is one rank's (1/{world} of the "
            f"gradients and optimizer states{', and of the parameters' if manager.shard_params else ''}); the "
            f"host's memory and drive are counted for its {per_host} ranks; the predicted device peak leaves out "
            f"ZeRO's reduce-scatter buckets in flight"
            f"{' and the chunk group gathered ahead of its use' if manager.shard_params else ''}")
    _check_device(plan, forecast)
    _check_host_and_nvme(plan, forecast)
    return plan


# [Note: a plan under ZeRO]
# Under ZeRO each rank keeps 1/world of every chunk group's gradients (its reduced shard) and optimizer states, and
# with shard_params of its parameters; capacities are rounded up to a multiple of the world so shards are equal
# (chunks/manager.py). The plan lays the chunks out as initialize will on each rank and counts one rank's bytes, the
# same as that rank's report's model_bytes_by_tier. The ranks on one host share its memory and drive, so the host and
# NVMe checks count ranks_per_host ranks against them. Under shard_params auto caches no parameters after its warm-up
# (ZeRO-3 gathers them for each use); the forecasts read ``config.shard_params`` as ZeRO-3 in effect. The predicted
# device peak is one rank's without ZeRO's own buffers (the reduce-scatter buckets in flight; under shard_params the
# group gathered ahead of its use: [Note: the warm-up plans the prefetch] in gemini/engine/warmup.py): the plan's
# note says so.
def _ranks(config: GeminiConfig, world_size: int | None, ranks_per_host: int | None) -> tuple[int, int]:
    """(the ranks ZeRO shards across, those sharing one host): see [Note: a plan under ZeRO]."""
    for name, value in (("world_size", world_size), ("ranks_per_host", ranks_per_host)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive int, or None (default: as initialize resolves "
                             f"GeminiConfig.process_group)")
    if world_size is None:
        zero = resolve_group(config.process_group)  # as initialize resolves it
        world = zero.world if zero is not None else 1
        local = os.environ.get("LOCAL_WORLD_SIZE", "1")  # torchrun's ranks on this host
        per_host = int(local) if world > 1 and local.isdigit() and int(local) > 0 else 1
    else:
        world = per_host = world_size  # planned ahead: on one host unless told otherwise
    if ranks_per_host is not None and ranks_per_host > world:
        raise ValueError(f"ranks_per_host={ranks_per_host} must be at most the {world} rank(s) ZeRO shards across "
                         f"(world_size={world_size}, else the process group's)")
    return world, min(world, per_host) if ranks_per_host is None else ranks_per_host


def _nvme_layout(config: GeminiConfig, layout, trainable: list[int], host_groups: list[int],
                 problems: list[str], *, world: int) -> NvmeLayout:
    """The NVMe tier's choice among the groups whose optimizer states are on the host tier."""
    os_bytes = offloaded_bytes(layout, host_groups, config.param_dtype, world=world)
    if config.cpu_memory is None and config.nvme_dir is None:
        return NvmeLayout(frozenset(), sum(b for _, b in os_bytes), 0, 0)

    def choose(indices: list[int]) -> NvmeLayout:
        return choose_nvme_groups(offloaded_bytes(layout, indices, config.param_dtype, world=world),
                                  cpu_memory=config.cpu_memory,
                                  fraction=config.nvme_offload_fraction, depth=config.nvme_pipeline_depth,
                                  nvme_available=config.nvme_dir is not None, undo_ratio=undo_ratio(config.param_dtype))

    try:
        # initialize() chooses while registering, among the groups the placement leaves on the host from the layout
        # alone (all under auto, before its margin takes some), then again among those left on the host tier.
        choose([i for i in trainable if i not in device_groups(config, layout).whole])
        chosen = choose(host_groups)
        warning = shallower_pipeline(chosen, cpu_memory=config.cpu_memory, wanted=config.nvme_pipeline_depth)
        if warning is not None:
            logger.warning(warning)
        return chosen
    except ValueError as e:
        problems.append(str(e))
        return NvmeLayout(frozenset(), sum(b for _, b in os_bytes), 0, 0)


def _check_device(plan: PlacementPlan, forecast: PlacementForecast) -> None:
    """The device's verdict: the predicted peak against the budget with example inputs, else the model data kept."""
    config = forecast.config
    plan.notes.extend(forecast.notes(plan))
    if config.offload_activations:
        plan.notes.append(
            f"offload_activations: saved activations of at least {format_size(config.activation_offload_min_bytes)} "
            "wait in host memory between forward and backward (their bytes are measured at warm-up and reported as "
            "activation_offload_bytes)" + forecast.activation_offload_note)
    if plan.non_model_peak_bytes is not None:
        _check_predicted_peak(plan, forecast)
    else:
        _check_model_data(plan, forecast)


def _check_predicted_peak(plan: PlacementPlan, forecast: PlacementForecast) -> None:
    """With example inputs: each step's predicted peak, and the budget's verdict on it."""
    budget, reserve = forecast.config.device_memory, forecast.reserve_bytes
    first, later = forecast.predict_peaks(plan)
    first_step, later_step = forecast.step_peak_bytes(plan)  # every step ends with the optimizer's
    plan.first_step_peak_bytes, plan.device_peak_bytes = max(first, first_step), max(later, later_step)
    peak = max(plan.first_step_peak_bytes, plan.device_peak_bytes)
    plan.notes.append(f"predicted device peak {format_size(plan.device_peak_bytes)} (first step "
                      f"{format_size(plan.first_step_peak_bytes)}): {forecast.holds}, buffers, and activations and "
                      f"temporaries (at most {format_size(plan.non_model_peak_bytes)} at once: one forward and "
                      f"backward on the meta device)"
                      + f"; {format_size(reserve)} of {'reserve the warm-up keeps' if forecast.traces else 'slack'} besides")
    if budget is None:
        return
    needed, why = peak, "at its peak"
    planned = forecast.planned_peak_bytes
    if planned is not None and planned > peak:
        # The warm-up refuses a budget its planned peak does not fit (MemoryPlan.planned_peak_bytes).
        needed, why = planned, "for the warm-up's plan, each period's chunks with its activations"
    missing = missing_bytes(budget, needed, reserve)
    if missing:
        plan.problems.append(
            f"the device needs {format_size(needed + reserve)} {why} ({format_size(needed)} predicted, "
            f"{format_size(reserve)} of {'reserve' if forecast.traces else 'slack'}) but device_memory is "
            f"{format_size(budget)}: "
            f"{format_size(missing)} are missing; raise device_memory, use activation checkpointing"
            f"{'' if forecast.config.offload_activations else ' or offload_activations'}, or a smaller batch"
            f"{forecast.peak_advice}")


def _check_model_data(plan: PlacementPlan, forecast: PlacementForecast) -> None:
    """Without example inputs: only the model data and buffers against the budget."""
    budget, device_bytes, what = forecast.config.device_memory, forecast.device_need_bytes(plan), forecast.needs
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


def _check_host_and_nvme(plan: PlacementPlan, forecast: PlacementForecast) -> None:
    config = forecast.config
    host_bytes = plan.tier_bytes("host") + plan.nvme_staging_bytes + plan.nvme_undo_bytes
    if config.resolved_device().type == "cpu":
        host_bytes += plan.tier_bytes("device")  # the CPU stand-in's "device" is host memory too
    ranks = plan.ranks_per_host  # they share the host and its drive: [Note: a plan under ZeRO]
    each = f" ({ranks} ranks of {format_size(host_bytes)})" if ranks > 1 else ""
    if host_bytes * ranks > plan.host_available_bytes:
        plan.problems.append(
            f"host memory: {format_size(host_bytes * ranks)} needed{each}, {format_size(plan.host_available_bytes)} "
            f"available now; {forecast.host_memory_advice(plan.nvme_staging_bytes)}")
    if plan.nvme_staging_bytes:
        plan.notes.append(f"the NVMe pipeline stages up to {format_size(plan.nvme_staging_bytes)} in host memory")
    nvme_bytes = plan.tier_bytes("nvme")
    if nvme_bytes:
        undo = (f"{format_size(plan.nvme_undo_file_bytes)} of files and {format_size(plan.nvme_undo_bytes)} of host "
                f"memory" if plan.nvme_undo_file_bytes else f"{format_size(plan.nvme_undo_bytes)} of host memory")
        plan.notes.append(f"a step is all or nothing: it holds the NVMe files from before it while writing new ones "
                          f"(up to {format_size(2 * nvme_bytes + plan.nvme_undo_file_bytes)} on the drive) and "
                          f"copies the streamed groups' parameters aside ({undo})")
        nvme_bytes = (2 * nvme_bytes + plan.nvme_undo_file_bytes) * ranks  # at the peak of a step
    if config.nvme_dir is not None and not os.path.isdir(config.nvme_dir):
        plan.problems.append(f"nvme_dir {os.fspath(config.nvme_dir)!r} is not a folder: create it (or mount the "
                             f"drive) first")
    elif config.nvme_dir is not None and not os.access(config.nvme_dir, os.W_OK | os.X_OK):  # as initialize checks
        plan.problems.append(f"nvme_dir {os.fspath(config.nvme_dir)!r} is not writable by this process")
    elif plan.nvme_free_bytes is not None and nvme_bytes > plan.nvme_free_bytes:
        plan.problems.append(f"NVMe: {format_size(nvme_bytes)} of files{each and f' ({ranks} ranks)'} but "
                             f"{format_size(plan.nvme_free_bytes)} free under {os.fspath(config.nvme_dir)}")


def _undo_file_bytes(nvme: NvmeLayout, layout, config: GeminiConfig, world: int) -> int:
    """Bytes of the NVMe files holding the step's copies aside, when they go to files."""
    if not nvme.undo_on_nvme:
        return 0
    ratio = undo_ratio(config.param_dtype)
    return sum(math.ceil(b * ratio) for _, b in offloaded_bytes(layout, sorted(nvme.nvme_groups), config.param_dtype,
                                                                 world=world))


def _free_disk_bytes(folder: str | os.PathLike | None) -> int | None:
    """Free space in ``folder``; None without one (or when it does not exist yet)."""
    if folder is None or not os.path.isdir(folder):
        return None
    return shutil.disk_usage(folder).free
