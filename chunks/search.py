"""Chunk-size search: the size whose chunks tensors fill best, over a range of candidates.

Chunks are allocated for their content (see [Note: chunks sized to their content] in
chunks/layout.py), so the room a size leaves free is no longer memory; it still measures how
well the tensors fill chunks of that size: less of it means fewer chunks closed early, so fewer
and fuller transfers, and modules split over fewer chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from chunks.layout import aligned_start
from offload import round_up

__all__ = ["ChunkSizeSearch", "search_chunk_size", "waste_for", "default_search_range"]

# Candidate sizes are multiples of this many elements (4 KiB of fp32): aligned views and a
# search that stays fast on models with thousands of tensors.
DEFAULT_STEP_ELEMENTS = 1024
# At most this many candidates are scored; the step grows for wider ranges.
MAX_CANDIDATES = 4096


@dataclass(frozen=True)
class ChunkSizeSearch:
    chunk_size: int  # elements
    waste: int  # room (elements) chunks of this size leave free, summed over every group
    n_chunks: int
    candidates: int  # how many sizes were scored


def waste_for(groups: Sequence[Sequence[int]], chunk_size: int) -> tuple[int, int]:
    """(waste, chunk count) of next-fit packing each group's tensors into ``chunk_size``.

    Mirrors :func:`chunks.layout.plan_layout` without building the layout: a tensor larger
    than the chunk gets a chunk of exactly its size (no waste); every other chunk wastes the
    room its tensors leave free of ``chunk_size``, the gaps before aligned slots included.
    """
    waste = count = 0
    for numels in groups:
        fill = None  # elements used in the open chunk; None when no chunk is open
        for n in numels:
            if n > chunk_size:
                count += 1
                if fill is not None:
                    waste += chunk_size - fill
                fill = None
            elif fill is None or aligned_start(fill, n) + n > chunk_size:
                if fill is not None:
                    waste += chunk_size - fill
                count += 1
                fill = n
            else:
                start = aligned_start(fill, n)
                waste += start - fill  # the gap before an aligned slot
                fill = start + n
        if fill is not None:
            waste += chunk_size - fill
    return waste, count


def default_search_range(groups: Sequence[Sequence[int]], *, min_chunks: int = 8) -> tuple[int, int]:
    """A range that keeps the model in several chunks while fitting its regular tensors.

    [Note: the search range]
    Waste alone favours one chunk as large as the model (no padding at all), which would
    defeat moving chunks between tiers. The lower end is the largest tensor that is not an
    outlier (more than mean + 3 std, as Colossal-AI does: outliers get chunks of their own);
    the upper end keeps the model in at least ``min_chunks`` chunks where possible.
    """
    sizes = [n for g in groups for n in g]
    if not sizes:
        raise ValueError("no parameters to pack into chunks")
    mean = sum(sizes) / len(sizes)
    std = math.sqrt(sum((n - mean) ** 2 for n in sizes) / len(sizes))
    regular = [n for n in sizes if n <= mean + 3 * std] or sizes
    lo = round_up(max(max(regular), 1), DEFAULT_STEP_ELEMENTS)  # one step where every tensor is empty
    hi = max(lo, round_up(math.ceil(sum(sizes) / min_chunks), DEFAULT_STEP_ELEMENTS))
    return lo, hi


def search_chunk_size(
    groups: Sequence[Sequence[int]],
    *,
    min_size: int | None = None,
    max_size: int | None = None,
    step: int | None = None,
) -> ChunkSizeSearch:
    """The chunk size in ``[min_size, max_size]`` (multiples of ``step``) with the least waste.

    ``groups`` lists, per param group, the element counts of its tensors in registration
    order. Ties go to the smallest size: finer chunks move in smaller units.
    """
    if min_size is None or max_size is None:
        lo, hi = default_search_range(groups)
        min_size = lo if min_size is None else min_size
        max_size = hi if max_size is None else max_size
    if min_size <= 0 or max_size < min_size:
        raise ValueError(f"chunk size range [{min_size}, {max_size}] is empty or not positive")
    if step is None:
        step = DEFAULT_STEP_ELEMENTS if min_size >= DEFAULT_STEP_ELEMENTS else 1
        span = (max_size - min_size) // step + 1
        if span > MAX_CANDIDATES:
            step *= math.ceil(span / MAX_CANDIDATES)
    if step <= 0:
        raise ValueError(f"step={step} must be positive")
    best: tuple[int, int, int] | None = None  # (waste, size, count)
    candidates = 0
    for size in range(min_size, max_size + 1, step):
        waste, count = waste_for(groups, size)
        candidates += 1
        if best is None or waste < best[0]:
            best = (waste, size, count)
    assert best is not None
    return ChunkSizeSearch(chunk_size=best[1], waste=best[0], n_chunks=best[2], candidates=candidates)
