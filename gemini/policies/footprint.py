"""Where a placement's chunks lie at the end of a step, in bytes per tier and chunk kind, from the chunk layout
alone: before any chunk exists, so that a plan or a budget check costs no memory.

[Note: the footprint of a placement]
A chunk layout (``ChunkManager.layout``: per chunk group, its tensors, its param group (-1 for frozen parameters) and
its capacity in elements) and a placement's choice of groups on the device (:class:`DeviceGroups`, from each policy's
``layout_choice``) determine where every chunk is once a step is over, by the rules ``ChunkManager.register``, the
policies' ``setup`` and the step follow:
- parameters lie on the device only for a group kept wholly there; on the host with a clean copy on the device for a
  group whose parameters stay cached there; else on the host. Under ZeRO-3 that is this rank's parameter shard (a
  cached group's shard stays on the host); the gathered chunk exists only around compute;
- a trainable group's gradients, fp32 master (bf16/fp16 only: under fp32 the parameters are the master) and Adam's m
  and v lie where Adam updates them: the device for a group kept wholly there, else the host, or NVMe files for the
  master, m and v of a group the NVMe tier holds. Under ZeRO a rank keeps 1/world of each (its shard), and the
  full-size gradient bucket is released once reduce-scattered;
- a frozen group under bf16/fp16 keeps an fp32 copy of its parameters on the host.
A chunk with copies on two tiers counts on both, as the ledger counts it, so these figures equal
``MemoryReport.model_bytes_by_tier`` after a step. The planner, ``initialize``'s budget checks and
``StaticPlacement`` read them from here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from chunks import ChunkKind, Tier, fits
from gemini.policies.nvme_choice import forced_count

__all__ = ["DeviceGroups", "Layout", "chunk_bytes", "margin_choice", "margin_room_bytes", "named_bytes",
           "static_choice", "whole_group_bytes"]

# ChunkManager.layout's rows: (tensor indices, param group index or -1 for frozen, capacity in elements).
Layout = Sequence[tuple[Sequence[int], int, int]]


@dataclass(frozen=True)
class DeviceGroups:
    """A placement's choice of chunk groups (indices into the layout) that stay on the device."""

    whole: frozenset[int] = frozenset()  # every chunk on the device only: Adam updates the group there
    params: frozenset[int] = frozenset()  # the parameters cached on the device next to their host copy


def static_choice(
    groups: Sequence[int], trainable: Sequence[int], *, param_device_fraction: float, optimizer_offload_fraction: float
) -> tuple[set[int], set[int]]:
    """placement="static"'s rule, on chunk-group indices in model order: (groups whose parameters stay on the device,
    trainable groups whose optimizer states do). The first groups stay, the last ones are offloaded. A pure function,
    so the planner applies the same rule before any chunk exists. Counts round as the NVMe share's (halves up)."""
    params_on_device = set(groups[: forced_count(param_device_fraction, len(groups))])
    n_offload = forced_count(optimizer_offload_fraction, len(trainable))
    return params_on_device, set(trainable[: len(trainable) - n_offload])


def whole_group_bytes(capacity: int, *, param_dtype: torch.dtype, trainable: bool = True) -> int:
    """Bytes of every chunk of a group of ``capacity`` elements, the cost of keeping it whole on the device
    (parameters and gradients in ``param_dtype``; fp32 master under bf16/fp16; fp32 m and v)."""
    elem = param_dtype.itemsize
    if not trainable:
        return capacity * elem
    return capacity * (2 * elem + (4 if param_dtype != torch.float32 else 0) + 8)


def margin_room_bytes(margin_bytes: int, ratio: float, *, param_dtype: torch.dtype, largest_capacity: int) -> int:
    """Of the margin the warm-up leaves (``MemoryPlan.margin_bytes``), the bytes ``gpu_margin_mem_ratio`` gives to
    optimizer-state groups kept on the device. Under bf16/fp16 the device Adam converts one gradient chunk at a time to
    fp32: that scratch comes off first."""
    room = int(ratio * max(0, margin_bytes))
    if param_dtype != torch.float32:
        room -= largest_capacity * 4
    return room


def margin_choice(costs: Sequence[tuple[int, int]], room_bytes: int) -> frozenset[int]:
    """placement="auto"'s rule for the margin: ``costs`` are (trainable group index, bytes of the whole group) in
    model order; each group that still fits in what ``room_bytes`` has left is kept on the device. A pure function, so
    the planner applies the engine's own rule."""
    chosen = []
    for index, cost in costs:
        if fits(room_bytes, cost):
            room_bytes -= cost
            chosen.append(index)
    return frozenset(chosen)


def chunk_bytes(layout: Layout, choice: DeviceGroups, *, param_dtype: torch.dtype,
                nvme_groups: Collection[int] = frozenset(), world: int = 1,
                shard_params: bool = False) -> dict[Tier, dict[ChunkKind, int]]:
    """Bytes of chunks per tier and kind at the end of a step, on one of ``world`` data-parallel ranks; see [Note: the
    footprint of a placement]. ``nvme_groups``: trainable groups whose master, m and v the NVMe tier keeps in files."""
    elem = param_dtype.itemsize
    low = param_dtype != torch.float32
    sharded = world > 1
    # Adam's fp32 chunks, which the NVMe tier may hold (see [Note: what goes to NVMe] in gemini/policies/nvme_choice.py).
    state_kinds = ((ChunkKind.MASTER,) if low else ()) + (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)
    out = {tier: {kind: 0 for kind in ChunkKind} for tier in Tier}
    for i, (_, pg, capacity) in enumerate(layout):
        shard = capacity // world  # a rank's range: capacities are multiples of the world size
        home = Tier.DEVICE if i in choice.whole else Tier.HOST
        if sharded and shard_params:
            out[home][ChunkKind.PARAM_SHARD] += shard * elem
        else:
            out[home][ChunkKind.PARAM] += capacity * elem
            if home is Tier.HOST and i in choice.params:
                out[Tier.DEVICE][ChunkKind.PARAM] += capacity * elem  # a clean copy next to the host one
        if pg < 0:
            if low:
                out[Tier.HOST][ChunkKind.MASTER] += shard * 4
            continue
        if sharded:
            out[home][ChunkKind.GRAD_SHARD] += shard * elem
        else:
            out[home][ChunkKind.GRAD] += capacity * elem
        for kind in state_kinds:
            out[Tier.NVME if i in nvme_groups else home][kind] += shard * 4
    return out


def named_bytes(by_tier: Mapping[Tier, Mapping[ChunkKind, int]]) -> dict[str, dict[str, int]]:
    """``by_tier`` keyed by names, as ``MemoryReport.model_bytes_by_tier`` has it."""
    return {tier.value: {kind.value: nbytes for kind, nbytes in kinds.items()} for tier, kinds in by_tier.items()}
