"""The planner's questions to a placement, answered by one class per placement.

:func:`gemini.tools.planner.plan_placement` asks every placement the same things: which chunk groups it keeps on the
device (under auto, from the margin its warm-up will leave), what model data it holds at the activation peak, the
device's peak in the first and later steps, and what to advise when a budget falls short. Each
``GeminiConfig.placement`` answers in its own class; :func:`forecast_for` picks it by the policy class
:func:`gemini.policies.placement_type` names, so nothing tests the placement's name.

Not on the policy classes because the answers read the engine's reserve (``planned_reserve_bytes``), the meta run's
peaks and the plan, and a policy imports nothing of gemini/engine/ or gemini/tools/. What is the policy's own (the
groups kept from the layout alone: ``layout_choice``, as ``initialize`` applies it) the forecast asks its policy
class. Auto's warm-up moves chunks as "cpu" does, so :class:`AutoForecast` is a :class:`CpuForecast`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from chunks import fits
from gemini.config import GeminiConfig
from gemini.engine.activations import kept_on_device
from gemini.engine.memory import planned_reserve_bytes, planned_slack_bytes
from gemini.policies import (AutoPlacement, CpuPlacement, CudaPlacement, PlacementPolicy, StaticPlacement,
                             placement_type)
from gemini.policies.footprint import DeviceGroups, Layout, margin_choice, margin_room_bytes, whole_group_bytes
from gemini.tools.meta_run import MetaPeaks
from offload import format_size

if TYPE_CHECKING:
    from gemini.tools.planner import PlacementPlan

__all__ = ["AutoForecast", "CpuForecast", "CudaForecast", "PlacementForecast", "StaticForecast", "forecast_for",
           "forecast_type"]


class PlacementForecast:
    """One placement's answers for one model and config. The base answers for placements that keep their chunks on
    the device for good ("cuda", "static"); those that fetch chunks for compute ("cpu", "auto") answer in
    :class:`CpuForecast`."""

    policy: type[PlacementPolicy] = PlacementPolicy
    # Words for the plan's notes and advice: the model data on the device at the activation peak (``holds``) and
    # without example inputs (``needs``); the end of a refused peak's advice (placements keeping less on the device);
    # what takes optimizer states out of short host memory; the end of the offload_activations note.
    holds = "the chunks it keeps"
    needs = "the chunks it keeps"
    peak_advice = ", or placement 'cpu'/'auto'"
    host_advice = "set cpu_memory and nvme_dir to move optimizer states to NVMe"
    activation_offload_note = ""

    def host_memory_advice(self, staging_bytes: int) -> str:
        """What takes more out of host memory when it is short (``staging_bytes``: the NVMe pipeline's)."""
        config = self.config
        if config.nvme_dir is None or (config.cpu_memory is None and not config.nvme_offload_fraction):
            return self.host_advice
        return (f"with nvme_dir set, lower cpu_memory or raise nvme_offload_fraction (more optimizer states in "
                f"files), or lower nvme_pipeline_depth (its staging holds {format_size(staging_bytes)} of host memory)")

    @property
    def traces(self) -> bool:
        """Whether the placement plans from a warm-up iteration (auto), which keeps a reserve."""
        return self.policy.plans_from_measurement

    def __init__(self, config: GeminiConfig, layout: Layout, *, buffer_bytes: int, peaks: MetaPeaks | None) -> None:
        self.config = config
        self.layout = layout
        self.buffer_bytes = buffer_bytes
        self.peaks = peaks  # None: no example inputs, activations not counted
        # The safety reserve is the warm-up's (auto's): the other placements check each step's peak against the budget
        # itself, so their verdicts keep only a slack (the reserve would refuse budgets they train under).
        reserve = planned_reserve_bytes if self.traces else planned_slack_bytes
        self.reserve_bytes = None if peaks is None else reserve(peaks.non_model_bytes, config.resolved_device())
        self.choice: DeviceGroups = self.policy.layout_choice(config, layout)
        # Only auto's warm-up plans (with example inputs) and leaves a margin (with a budget too); ``later_peaks``:
        # auto's later steps, replayed when offload_activations keeps some activations on the device.
        self.planned_peak_bytes: int | None = None
        self.margin_bytes: int | None = None
        self.later_peaks: MetaPeaks | None = None

    @classmethod
    def residents(cls, config: GeminiConfig, layout: Layout) -> DeviceGroups | None:
        """The groups this placement keeps on the device while others visit it for compute, for the meta run to
        replay (see [Note: what stays on the device, replayed] in gemini/tools/meta_replay.py); None: no such
        timeline (nothing kept, or everything)."""
        return None

    def notes(self, plan: PlacementPlan) -> list[str]:
        """What this placement says of itself, before the device's figures."""
        return []

    def activations_kept_from(self) -> int | None:
        """Only auto keeps some offloadable activations on the device (see AutoForecast)."""
        return None

    def settle(self) -> None:
        """The meta runs are done (``later_peaks`` too): the last word on ``choice``."""

    def device_need_bytes(self, plan: PlacementPlan) -> int:
        """Model data (``needs``) and buffers on the device, as checked without example inputs."""
        return plan.tier_bytes("device") + plan.buffer_bytes

    def predict_peaks(self, plan: PlacementPlan) -> tuple[int, int]:
        """(The first step's device peak, every later step's), from the meta run's non-model peak (so only with
        example inputs); see [Note: the predicted device peak]."""
        # [Note: the predicted device peak]
        # The activation peak (end of forward, start of backward) meets the model data the placement holds then:
        # - "cuda": the chunks it keeps, its gradient chunks among them from the first step on
        #   ([Note: what every step keeps is there from the first] in gemini/engine/residency.py);
        # - "static": the same, plus the other groups visiting as under "cpu", replayed on meta with the activations;
        # - "cpu": the groups visiting for compute, replayed on meta with the activations (see
        #   [Note: the warm-up replayed on meta] in gemini/tools/meta_replay.py);
        # - "auto": its first step is the warm-up, like "cpu", which then brings the margin's groups to the device
        #   for its optimizer step (and, where it will evict nothing, every parameter chunk after its update:
        #   ``settle``). Later it keeps every parameter chunk it fetched and the margin's whole groups until the
        #   budget less the reserve makes it evict: the peak is the lesser of the two.
        steady = self._kept_peak_bytes(plan)
        return steady, steady

    def step_peak_bytes(self, plan: PlacementPlan) -> tuple[int, int]:
        """The optimizer step's device peak (the first step's, every later one's): the chunks on the device and,
        under bf16/fp16, the fp32 scratch the device's Adam holds for one gradient per param group
        (``AdamBatch.scratch`` in gemini/optim/adam_batches.py), a whole chunk's at most. With few activations (or
        when auto's first step brings the margin's groups) the step is the peak."""
        largest: dict[int, int] = {}
        if self.config.param_dtype != torch.float32:
            for i in self.choice.whole:
                _, pg, capacity = self.layout[i]
                if pg >= 0:
                    largest[pg] = max(largest.get(pg, 0), capacity)
        step = plan.tier_bytes("device") + plan.buffer_bytes + 4 * sum(largest.values())
        return step, step

    def _kept_peak_bytes(self, plan: PlacementPlan) -> int:
        """The peak of a step once every chunk kept on the device exists."""
        return plan.tier_bytes("device") + plan.buffer_bytes + plan.non_model_peak_bytes


class CudaForecast(PlacementForecast):
    """Every chunk on the device."""

    policy = CudaPlacement
    # cuda rejects cpu_memory and nvme_dir (GeminiConfig): the knob is another placement.
    host_advice = "with placement 'cpu', 'auto' or 'static', cpu_memory and nvme_dir move optimizer states to NVMe"


class StaticForecast(PlacementForecast):
    """The fractions' groups kept on the device; the others visit it for compute."""

    policy = StaticPlacement

    @classmethod
    def residents(cls, config: GeminiConfig, layout: Layout) -> DeviceGroups | None:
        return cls.policy.layout_choice(config, layout)

    def predict_peaks(self, plan: PlacementPlan) -> tuple[int, int]:
        # The kept chunks, and the peak of what comes and goes beside them (visiting groups, activations), replayed.
        steady = plan.tier_bytes("device") + plan.buffer_bytes + self.peaks.resident_peak_bytes
        return steady, steady


class CpuForecast(PlacementForecast):
    """Nothing kept on the device: each chunk group visits it for compute."""

    policy = CpuPlacement
    holds = "the chunk groups visiting it for compute"
    needs = "the largest chunk group's parameters and gradients visiting it"
    peak_advice = ""  # already one that fetches only what it computes with

    def device_need_bytes(self, plan: PlacementPlan) -> int:
        # At least the largest group's parameters and gradients, while they visit.
        return super().device_need_bytes(plan) + plan.device_working_set_bytes

    def predict_peaks(self, plan: PlacementPlan) -> tuple[int, int]:
        # Every step moves chunks as the warm-up replayed on meta does.
        warmup = self.buffer_bytes + self.peaks.warmup_peak_bytes
        return warmup, warmup


class AutoForecast(CpuForecast):
    """The warm-up as "cpu"; then parameter chunks cached as the budget allows, and the margin's whole groups on the
    device for good (see [Note: auto placement] in gemini/policies/auto.py)."""

    policy = AutoPlacement
    holds = ("the parameter chunks it caches and the margin's whole groups (its warm-up: the chunk groups visiting "
             "for compute)")
    activation_offload_note = "; the margin left by gpu_margin_mem_ratio keeps the last ones on the device"

    def __init__(self, config: GeminiConfig, layout: Layout, *, buffer_bytes: int, peaks: MetaPeaks | None) -> None:
        super().__init__(config, layout, buffer_bytes=buffer_bytes, peaks=peaks)
        if peaks is None:
            return  # without a meta run the margin is unknown: ratio 0's choice, as the notes say
        self.planned_peak_bytes = buffer_bytes + peaks.planned_peak_bytes
        if config.device_memory is not None:
            # MemoryPlan.margin_bytes, from the warm-up replayed on meta.
            self.margin_bytes = config.device_memory - self.reserve_bytes - self.planned_peak_bytes
            self.choice = self._margin_choice(self.margin_bytes)

    @classmethod
    def residents(cls, config: GeminiConfig, layout: Layout) -> DeviceGroups | None:
        # After the warm-up every parameter chunk stays cached (budget allowing; ZeRO-3 gathers them for each use:
        # [Note: a plan under ZeRO] in planner.py); the margin's whole groups are known only from the warm-up's peak.
        return None if config.shard_params else DeviceGroups(params=frozenset(range(len(layout))))

    def _margin_choice(self, margin_bytes: int) -> DeviceGroups:
        """The groups ``gpu_margin_mem_ratio`` keeps in the margin, by the engine's rule (``AutoPlacement.adopt``)."""
        config, layout = self.config, self.layout
        trainable = [i for i, (_, pg, _) in enumerate(layout) if pg >= 0]
        room = margin_room_bytes(margin_bytes, config.gpu_margin_mem_ratio, param_dtype=config.param_dtype,
                                 largest_capacity=max((layout[i][2] for i in trainable), default=0))
        costs = [(i, whole_group_bytes(layout[i][2], param_dtype=config.param_dtype)) for i in trainable]
        return DeviceGroups(whole=margin_choice(costs, room))

    def notes(self, plan: PlacementPlan) -> list[str]:
        ratio = self.config.gpu_margin_mem_ratio
        if ratio == 0:
            share = "optimizer states stay on the host (gpu_margin_mem_ratio=0)"
        elif plan.margin_bytes is not None:
            share = (f"the warm-up will leave a margin of {format_size(max(0, plan.margin_bytes))}; "
                     f"gpu_margin_mem_ratio={ratio:g} of it holds {plan.os_groups_on_device} "
                     f"whole chunk groups (their optimizer states are updated on the device)")
        else:
            share = (f"gpu_margin_mem_ratio={ratio:g} also moves optimizer states into the "
                     f"margin the warm-up measures; without example_inputs and device_memory that margin is "
                     f"unknown, so host and NVMe are shown as at ratio 0 (they shrink by what moves)")
        return ["auto: parameter chunks are cached on the device as the budget allows after the warm-up; " + share]

    def predict_peaks(self, plan: PlacementPlan) -> tuple[int, int]:
        first, _ = super().predict_peaks(plan)
        # The first step ends the warm-up: the margin's groups come to the device, whole, and Adam updates them there
        # once the activations are gone (the planner adds the step's peak).
        later = self.later_peaks or self.peaks
        cached = self._cached_bytes() + plan.buffer_bytes + later.resident_peak_bytes
        if plan.device_budget_bytes is not None:
            cached = min(cached, plan.device_budget_bytes - self.reserve_bytes)
        return first, max(first, cached)

    def activations_kept_from(self) -> int | None:
        """With ``offload_activations``: the index of the first saved tensor auto keeps on the device after its
        warm-up (in the part of the margin optimizer states leave, by the engine's rule ``kept_on_device``); None when
        all are offloaded as in the warm-up. The planner then replays those later steps on meta (``later_peaks``)."""
        sizes = self.peaks.offloaded_sizes if self.peaks is not None else ()
        if not sizes:
            return None
        if self.margin_bytes is None:
            return 0  # no budget: the whole device's margin, room for all of them
        margin = max(0, self.margin_bytes)
        room = margin - int(self.config.gpu_margin_mem_ratio * margin)  # AutoPlacement.activation_room_bytes
        keep_from, _, _ = kept_on_device(sizes, room, prefetch=self.config.resolved_device().type == "cuda"
                                         and len(sizes) > 1)
        return keep_from if keep_from < len(sizes) else None

    def step_peak_bytes(self, plan: PlacementPlan) -> tuple[int, int]:
        first, later = super().step_peak_bytes(plan)
        if self._evicts_nothing():
            return first, later  # every step sends the parameters back, the warm-up's too
        # The warm-up's step has cached no parameters yet (``settle``): only the margin's groups.
        cached = sum(cap for i, (_, _, cap) in enumerate(self.layout) if i in self.choice.params)
        return first - cached * self.config.param_dtype.itemsize, later

    def settle(self) -> None:
        # Where the plan evicts nothing, every parameter chunk is sent back to the device right after its update
        # ([Note: parameters stay where nothing is evicted] in gemini/policies/auto.py). Else under bf16/fp16 the step
        # casts the masters into the parameter chunks where they lie, so those cached on the device stay (under fp32
        # the chunk is the master, updated on the host, and its device copy is dropped). Auto caches them all unless
        # the budget makes it evict (predict_peaks caps the peak so).
        if self.config.param_dtype != torch.float32 or self._evicts_nothing():
            every = frozenset(range(len(self.layout)))
            self.choice = DeviceGroups(whole=self.choice.whole, params=every - self.choice.whole)

    def _evicts_nothing(self) -> bool:
        """Whether every chunk auto may hold fits on the device at once beside the largest non-model peak and the
        activations it keeps, as ``AutoPlacement.adopt`` decides that periods need not be followed (never under
        ZeRO-3, which keeps no parameters). No budget: taken to fit (the verdict says where it does not); no example
        inputs: model data alone, as the verdict."""
        budget = self.config.device_memory
        if self.config.shard_params:
            return False
        if budget is None:
            return True
        elem = self.config.param_dtype.itemsize
        most = sum(whole_group_bytes(cap, param_dtype=self.config.param_dtype) if i in self.choice.whole
                   else cap * elem * (2 if pg >= 0 else 1) for i, (_, pg, cap) in enumerate(self.layout))
        if self.peaks is None:
            return fits(budget, most, self.buffer_bytes)
        keep_from = self.activations_kept_from()
        kept = sum(self.peaks.offloaded_sizes[keep_from:]) if keep_from is not None else 0
        return fits(budget, most, self.buffer_bytes, self.peaks.non_model_bytes, kept, self.reserve_bytes)

    def _cached_bytes(self) -> int:
        """What auto holds on the device for good once nothing presses it: the margin's whole groups and every other
        group's parameters (gradient chunks come and go with the activations, in ``resident_peak_bytes``, which
        counts the whole groups' ones too)."""
        param_dtype, whole = self.config.param_dtype, self.choice.whole
        elem = param_dtype.itemsize
        pinned = sum(whole_group_bytes(cap, param_dtype=param_dtype) for i, (_, _, cap) in enumerate(self.layout)
                     if i in whole)
        params = sum(cap * elem for i, (_, _, cap) in enumerate(self.layout) if i not in whole)
        return pinned + (0 if self.config.shard_params else params)  # ZeRO-3: gathered for each use


# Each placement's forecast by its policy class: the name was looked up once, by placement_type.
_FORECASTS: dict[type[PlacementPolicy], type[PlacementForecast]] = {
    f.policy: f for f in (CudaForecast, CpuForecast, StaticForecast, AutoForecast)
}


def forecast_type(config: GeminiConfig) -> type[PlacementForecast]:
    """The forecast class of the placement ``config`` names."""
    return _FORECASTS[placement_type(config.placement)]


def forecast_for(config: GeminiConfig, layout: Layout, *, buffer_bytes: int,
                 peaks: MetaPeaks | None) -> PlacementForecast:
    """The forecast of the placement ``config`` names, for the chunk groups of ``layout``,
    ``buffer_bytes`` of module buffers and, with example inputs, the meta run's ``peaks``."""
    return forecast_type(config)(config, layout, buffer_bytes=buffer_bytes, peaks=peaks)
