"""Belady eviction over a recorded chunk access order: evict what is needed furthest ahead.

The warm-up iteration records, per period, the set of chunks used in it. Since every
iteration repeats that order, the future is known, and evicting the resident chunk whose
next use is furthest away (never again counts as infinitely far) is the optimal offline
policy for chunks of one size [Belady 1966]; with mixed sizes it is the usual heuristic.
``EvictionRule.LRU`` (least recently used first) is there to measure what that knowledge saves.
"""

from __future__ import annotations

import bisect
import enum
import logging
import math
from collections.abc import Collection, Iterable, Mapping, Sequence

logger = logging.getLogger(__name__)

__all__ = ["AccessOrder", "EvictionError", "EvictionRule", "NEVER", "choose_victims", "next_use"]

NEVER = math.inf  # next use of a chunk that is not used again


class EvictionRule(enum.Enum):
    """Which resident chunk goes first."""

    BELADY = "belady"  # the one needed furthest ahead (the engine's rule)
    LRU = "lru"  # the one used longest ago: what a cache that ignores the recorded order does


class EvictionError(RuntimeError):
    """The chunks that may be evicted cannot free the bytes asked for."""


class AccessOrder:
    """A recorded access order indexed for next-use queries in O(log n).

    ``order[p]`` is the collection of chunk ids used in period ``p``.
    """

    def __init__(self, order: Sequence[Iterable[int]]) -> None:
        if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
            raise TypeError(f"order must be a sequence of collections of chunk ids, got {type(order).__name__}")
        periods: list[frozenset[int]] = []
        uses: dict[int, list[int]] = {}
        for p, chunk_ids in enumerate(order):
            period = frozenset(chunk_ids)
            periods.append(period)
            for cid in period:
                # Periods are visited in increasing order, so each list is born sorted.
                uses.setdefault(cid, []).append(p)
        self._periods = tuple(periods)
        self._uses = uses

    def __len__(self) -> int:
        return len(self._periods)

    def __getitem__(self, period: int) -> frozenset[int]:
        return self._periods[period]

    @property
    def chunk_ids(self) -> frozenset[int]:
        """Every chunk used at least once."""
        return frozenset(self._uses)

    def uses_of(self, chunk_id: int) -> tuple[int, ...]:
        """The periods that use ``chunk_id``, in order."""
        return tuple(self._uses.get(chunk_id, ()))

    def next_use(self, chunk_id: int, after_period: int) -> float:
        """The first period strictly after ``after_period`` that uses the chunk, or NEVER."""
        uses = self._uses.get(chunk_id)
        if not uses:
            return NEVER
        i = bisect.bisect_right(uses, after_period)
        return uses[i] if i < len(uses) else NEVER

    def last_use(self, chunk_id: int, at_period: int) -> float:
        """The last period at or before ``at_period`` that used the chunk. Iterations repeat the
        order, so a chunk not used yet in this one was last used in the previous one: its last
        use there, less the order's length. ``-NEVER`` for a chunk never used."""
        uses = self._uses.get(chunk_id)
        if not uses:
            return -NEVER
        i = bisect.bisect_right(uses, at_period)
        return uses[i - 1] if i else uses[-1] - len(self._periods)


def _as_access_order(order: AccessOrder | Sequence[Iterable[int]]) -> AccessOrder:
    # Building the index is O(total accesses): callers that query often build it once.
    return order if isinstance(order, AccessOrder) else AccessOrder(order)


def next_use(order: AccessOrder | Sequence[Iterable[int]], chunk_id: int, after_period: int) -> float:
    """The first period after ``after_period`` in which ``chunk_id`` is used, or NEVER.

    Pass an :class:`AccessOrder` to query in O(log n); a plain list is indexed on each call.
    """
    return _as_access_order(order).next_use(chunk_id, after_period)


def choose_victims(
    resident: Collection[int],
    needed_now: Collection[int],
    order: AccessOrder | Sequence[Iterable[int]],
    period: int,
    bytes_needed: int,
    chunk_bytes: Mapping[int, int],
    *,
    rule: EvictionRule = EvictionRule.BELADY,
    last: Sequence[int] = (),
) -> list[int]:
    """Resident chunks to evict, furthest next use first, until ``bytes_needed`` are freed.

    Under ``rule=EvictionRule.LRU`` the least recently used go first instead. Chunks in
    ``needed_now`` are never chosen; chunks in ``last`` (soonest needed first) only after
    every other, the last of them first. Ties in next use go to the larger chunk
    (fewer evictions), then to the lower id (a deterministic plan). Returns ``[]`` when
    ``bytes_needed <= 0``. Raises :class:`EvictionError` when even evicting every allowed
    chunk frees too little.
    """
    if not isinstance(bytes_needed, int) or isinstance(bytes_needed, bool):
        raise TypeError(f"bytes_needed must be an int, got {type(bytes_needed).__name__} {bytes_needed!r}")
    if bytes_needed <= 0:
        return []
    access = _as_access_order(order)
    needed = set(needed_now)
    after_all = {cid: (1, -pos) for pos, cid in enumerate(last)}  # sorts after every (0, rank)
    candidates = []
    for cid in resident:
        if cid in needed:
            continue
        if cid not in chunk_bytes:
            raise ValueError(f"chunk_bytes has no size for resident chunk {cid!r}")
        nbytes = chunk_bytes[cid]
        if nbytes < 0:
            raise ValueError(f"chunk_bytes[{cid!r}] must be >= 0, got {nbytes}")
        if cid in after_all:
            rank = after_all[cid]
        else:
            rank = (0, -access.next_use(cid, period) if rule is EvictionRule.BELADY else access.last_use(cid, period))
        candidates.append((rank, -nbytes, cid))
    candidates.sort()

    victims: list[int] = []
    freed_bytes = 0
    for _, neg_bytes, cid in candidates:
        if freed_bytes >= bytes_needed:
            break
        victims.append(cid)
        freed_bytes -= neg_bytes
    if freed_bytes < bytes_needed:
        raise EvictionError(
            f"cannot free {bytes_needed} bytes at period {period}: the {len(candidates)} resident "
            f"chunk(s) not needed now hold only {freed_bytes} bytes "
            f"({len(needed & set(resident))} resident chunk(s) are needed by this period)"
        )
    logger.debug("period %s: evict %s to free %s bytes (asked %s)", period, victims, freed_bytes, bytes_needed)
    return victims
