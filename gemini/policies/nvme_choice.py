"""Which optimizer-state chunk groups live in NVMe files, and the host memory that leaves.

[Note: what goes to NVMe]
The chunks of a group that only the optimizer reads go to NVMe: Adam's ``exp_avg`` and ``exp_avg_sq``, and the fp32
master under bf16/fp16. Under fp32 the param chunk is the master, which forward and backward need every iteration, so
it stays in memory: NVMe then holds 8 of the 16 bytes per parameter, under bf16/fp16 12 of 16.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from offload import format_size

__all__ = ["NvmeLayout", "choose_nvme_groups", "forced_count", "offloaded_bytes", "offloaded_bytes_per_element",
           "shallower_pipeline", "undo_ratio"]


def offloaded_bytes_per_element(param_dtype: torch.dtype) -> int:
    """Bytes per element of a group's chunks that can live on NVMe (see [Note: what goes to NVMe])."""
    return 8 if param_dtype == torch.float32 else 12


def offloaded_bytes(layout: Sequence[tuple[list[int], int, int]], indices: Iterable[int],
                    param_dtype: torch.dtype, *, world: int = 1) -> list[tuple[int, int]]:
    """(group index, bytes of its offloadable chunks) for ``indices`` of a chunk layout (``ChunkManager.layout``): the
    input of :func:`choose_nvme_groups` before chunks exist. Under ZeRO a rank keeps 1/``world`` of each."""
    per_element = offloaded_bytes_per_element(param_dtype)
    return [(i, layout[i][2] // world * per_element) for i in indices]


@dataclass(frozen=True)
class NvmeLayout:
    """Where the host-tier optimizer states go: which groups to NVMe, and the bytes of each side."""

    nvme_groups: frozenset[int]
    host_bytes: int  # offloadable chunks kept in host memory
    nvme_bytes: int  # offloadable chunks in NVMe files
    staging_bytes: int  # host memory the pipeline uses at most while streaming
    depth: int = 1  # the pipeline's depth: nvme_pipeline_depth, or less where cpu_memory is small
    # The step's copies aside of the streamed groups' parameters (see [Note: a step is all or nothing] in
    # gemini/engine/transaction.py): host bytes they take, and whether they go to NVMe files (one copy in host memory
    # at a time) because cpu_memory cannot hold them all.
    undo_bytes: int = 0
    undo_on_nvme: bool = False


def choose_nvme_groups(
    os_bytes: Sequence[tuple[int, int]],
    *,
    cpu_memory: int | None,
    fraction: float,
    depth: int,
    nvme_available: bool,
    undo_ratio: float = 0.0,
) -> NvmeLayout:
    """Choose the groups whose optimizer states live on NVMe.

    ``os_bytes``: (group index, bytes of its offloadable chunks) of the trainable groups whose optimizer states are on
    the host tier, in model order. The last :func:`forced_count` of them always go to NVMe; of the others, the first
    ones stay in host memory while they fit in ``cpu_memory`` next to the pipeline's staging, and the rest go to NVMe.
    ``undo_ratio``: bytes a step copies aside per offloadable byte of a streamed group (see :func:`undo_ratio`). The
    copies stay in host memory if ``cpu_memory`` holds them after everything else, else they go to NVMe files, one in
    memory at a time.
    """
    undo_of = {i: math.ceil(b * undo_ratio) for i, b in os_bytes}
    n_forced = forced_count(fraction, len(os_bytes))
    forced = os_bytes[len(os_bytes) - n_forced:] if n_forced else []
    candidates = os_bytes[: len(os_bytes) - n_forced]
    total = sum(b for _, b in candidates)
    if cpu_memory is None or (total <= cpu_memory and not forced):
        chosen = {i for i, _ in forced}
        staging = 0
        undo_room = 0  # unused: with no budget the copies stay in memory, with nothing streamed there are none
    else:
        # The pipeline needs room for 2 * depth + 1 groups as soon as anything streams; a small budget gets a
        # shallower pipeline (depth 0: one group at a time, no overlap) before it is refused. The depth asked for
        # comes first, so a budget that just holds its staging keeps fewer groups in memory than a smaller one.
        largest = max(b for _, b in os_bytes)
        largest_undo = max(undo_of.values())  # the one copy aside in memory when they go to NVMe
        while depth > 0 and (2 * depth + 1) * largest + largest_undo > cpu_memory:
            depth -= 1
        staging = (2 * depth + 1) * largest
        if staging + largest_undo > cpu_memory and nvme_available:
            least = staging + largest_undo
            raise ValueError(
                f"GeminiConfig.cpu_memory={cpu_memory} ({format_size(cpu_memory)}) is too small: streaming optimizer "
                f"states from NVMe holds at least one chunk group's states in host memory, and a copy of its "
                f"parameters ({least} bytes, {format_size(least)}); raise cpu_memory to at least {least}, or lower "
                f"chunk_size (a parameter larger than a chunk is a group of its own, which no chunk_size splits)"
            )
        room = cpu_memory - staging - largest_undo if (forced or total > cpu_memory) else cpu_memory
        chosen = {i for i, _ in forced}
        for i, b in candidates:
            if b <= room:
                room -= b
            else:
                chosen.add(i)
        undo_room = room + largest_undo
    if chosen and not nvme_available:
        need = total + sum(b for _, b in forced)
        raise ValueError(
            f"GeminiConfig.cpu_memory={cpu_memory} ({format_size(cpu_memory or 0)}) cannot hold the optimizer states "
            f"kept on the host ({need} bytes, {format_size(need)}) and GeminiConfig.nvme_dir is None; set nvme_dir "
            f"to a folder on a fast drive, or raise cpu_memory"
        )
    host = sum(b for i, b in os_bytes if i not in chosen)
    undo = sum(undo_of[i] for i in chosen)
    on_nvme = cpu_memory is not None and bool(chosen) and undo > undo_room
    if on_nvme:
        undo = largest_undo
    return NvmeLayout(frozenset(chosen), host, sum(b for i, b in os_bytes if i in chosen), staging if chosen else 0,
                      depth, undo, on_nvme)


def forced_count(fraction: float, groups: int) -> int:
    """How many of ``groups`` chunk groups a share ``fraction`` of them is (``nvme_offload_fraction``, static's two
    fractions): the nearest whole count, halves up (not Python's ``round``, which rounds 0.5 of one group to none)."""
    return math.floor(fraction * groups + 0.5)


def undo_ratio(param_dtype: torch.dtype) -> float:
    """Bytes a step copies aside per offloadable byte of a streamed group: its parameters' (fp32: the param chunk is
    the master, 4 of 8 bytes; bf16/fp16: the low-precision copy, 2 of 12)."""
    return param_dtype.itemsize / offloaded_bytes_per_element(param_dtype)


def shallower_pipeline(layout: NvmeLayout, *, cpu_memory: int | None, wanted: int) -> str | None:
    """What to tell the user (once: callers choose several times) when ``cpu_memory`` made the pipeline of ``layout``
    shallower than ``nvme_pipeline_depth=wanted``; None when it did not."""
    if not layout.nvme_groups or layout.depth >= wanted or cpu_memory is None:
        return None
    return (f"GeminiConfig.cpu_memory={format_size(cpu_memory)} holds the states of {2 * layout.depth + 1} chunk "
            f"group(s), not the {2 * wanted + 1} of nvme_pipeline_depth={wanted}: the NVMe pipeline runs at depth "
            f"{layout.depth}{' (no overlap of I/O and compute)' if layout.depth == 0 else ''}")
