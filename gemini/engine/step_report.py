"""The per-step `MemoryReport`: the engine's counters over one step, with what only the optimizer's step knows
(`StepOutcome`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunks import ChunkKind, MemoryLedger, Tier
from gemini.engine.transaction import UNDO_KIND
from gemini.report import MemoryReport

if TYPE_CHECKING:
    from gemini.engine.runtime import GeminiRuntime

__all__ = ["StepOutcome", "step_report"]


@dataclass(frozen=True)
class StepOutcome:
    """How a landed step went, as the optimizer saw it."""

    skipped: bool  # fp16 overflow: nothing was updated
    grad_norm: float | None  # None where neither clipping nor fp16 needed it
    adam_seconds: dict[Tier, float]  # time in the Adam kernels, per tier of the update
    loss_scale: float  # the scale the step's gradients carried (1.0 but under fp16)


def step_report(rt: GeminiRuntime, outcome: StepOutcome, *, step: int, step_seconds: float) -> MemoryReport:
    """The report of step number ``step``, read before the counters start again."""
    ledger = rt.storage.ledger
    transfers = ledger.transfers
    return MemoryReport(
        step=step,
        device_peak_bytes=device_peak_bytes(rt),
        device_model_bytes=ledger.bytes_on(Tier.DEVICE),
        device_non_model_peak_bytes=device_non_model_peak_bytes(rt),
        host_model_bytes=ledger.bytes_on(Tier.HOST),
        # The copies aside of a step ([Note: a step is all or nothing]) are not the model's.
        nvme_bytes=ledger.bytes_on(Tier.NVME) - ledger.kind_bytes(Tier.NVME, UNDO_KIND),
        h2d_bytes=transfers.h2d_bytes,
        d2h_bytes=transfers.d2h_bytes,
        nvme_read_bytes=transfers.nvme_read_bytes,
        nvme_write_bytes=transfers.nvme_write_bytes,
        chunks_on_device=ledger.payloads(Tier.DEVICE),
        os_chunks_on_device=sum(g.exp_avg.is_on(Tier.DEVICE) for g in rt.manager.trainable_groups),
        step_seconds=step_seconds,
        transfer_seconds=transfers.seconds,
        optimizer_cpu_seconds=outcome.adam_seconds[Tier.HOST],
        optimizer_device_seconds=outcome.adam_seconds[Tier.DEVICE],
        skipped=outcome.skipped,
        loss_scale=outcome.loss_scale,
        device_model_peak_bytes=ledger.peak_bytes(Tier.DEVICE),
        device_budget_bytes=rt.config.device_memory,
        grad_norm=outcome.grad_norm if outcome.grad_norm is None or math.isfinite(outcome.grad_norm) else math.inf,
        host_rss_bytes=rt.system.host_rss_bytes(),
        nvme_wait_seconds=transfers.nvme_wait_seconds,
        host_pool_bytes=ledger.host_pool_bytes,
        os_chunks_total=len(rt.manager.trainable_groups),
        model_bytes_by_tier=model_bytes_by_tier(ledger),
        host_available_bytes=rt.system.host_available_bytes(),
        device_used_peak_bytes=rt.system.device_used_peak_bytes(),
        timeline=rt.take_timeline(),
        world_size=rt.manager.world,
        rank=rt.manager.rank,
        grad_reduce_bytes=transfers.grad_reduce_bytes,
        param_gathers=transfers.param_gathers,
        param_gather_bytes=transfers.param_gather_bytes,
        activation_offload_bytes=transfers.activation_d2h_bytes,
        activation_host_peak_bytes=ledger.activations.peak_bytes,
        activation_kept_bytes=transfers.activation_kept_bytes,
        nvme_undo_bytes=ledger.kind_bytes(Tier.NVME, UNDO_KIND),
        host_states_peak_bytes=sum(ledger.kind_peak_bytes(Tier.HOST, kind) for kind in _BOUNDED_BY_CPU_MEMORY),
        cpu_budget_bytes=rt.config.cpu_memory,
    )


# What cpu_memory bounds in host memory (see [Note: what goes to NVMe] in gemini/policies/nvme_choice.py).
_BOUNDED_BY_CPU_MEMORY = (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ, ChunkKind.MASTER, UNDO_KIND)


_TIER_NAMES = tuple((tier, tier.value) for tier in Tier)
_KIND_NAMES = tuple((kind, kind.value) for kind in ChunkKind)


def model_bytes_by_tier(ledger: MemoryLedger) -> dict[str, dict[str, int]]:
    """Chunk payload bytes now, from the ledger: tier -> chunk kind -> bytes (a chunk in a file counts on NVMe)."""
    return {tier_name: {kind_name: ledger.kind_bytes(tier, kind) for kind, kind_name in _KIND_NAMES}
            for tier, tier_name in _TIER_NAMES}


def device_peak_bytes(rt: GeminiRuntime) -> int:
    """The compute device's measured peak over the current step."""
    measured = rt.step_peak_bytes()
    if measured is not None:
        return max(measured, rt.warmup_peak_bytes)
    # Not measured (the CPU stand-in without a budget): the chunk ledger's peak.
    return rt.storage.ledger.peak_bytes(Tier.DEVICE) + rt.fixed_bytes


def device_non_model_peak_bytes(rt: GeminiRuntime) -> int | None:
    """The step's most device bytes besides model data: from the warm-up's trace for the step that ended one
    (read before ``take_timeline`` hands that plan over), from the device's meter for every other step."""
    if rt.unreported_plan is not None:
        return rt.unreported_plan.max_non_model_bytes
    return None if rt.evaluation_only else rt.memory.non_model_peak_bytes()
