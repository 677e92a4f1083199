import functools
import itertools
import random

import pytest

from tracer.belady import NEVER, AccessOrder, EvictionError, EvictionRule, choose_victims, next_use

CHUNK_BYTES = 1000


def test_next_use_is_strictly_after_the_period():
    order = [{1, 2}, {3}, {1}, set(), {2, 3}]
    access = AccessOrder(order)
    assert [access.next_use(1, p) for p in (-1, 0, 1, 2, 3)] == [0, 2, 2, NEVER, NEVER]
    assert [access.next_use(2, p) for p in (-1, 0, 3, 4)] == [0, 4, 4, NEVER]
    assert access.next_use(99, 0) == NEVER
    assert next_use(order, 3, 1) == 4  # the plain-list form indexes on the fly
    assert access.uses_of(3) == (1, 4)
    assert access.chunk_ids == {1, 2, 3}
    assert len(access) == 5 and access[4] == {2, 3}


def test_evicts_furthest_next_use_first_and_never_needed_chunks():
    order = [{0, 1, 2, 3}, {4}, {2}, {1}, {3}]
    sizes = dict.fromkeys(range(5), CHUNK_BYTES)
    # At period 1: 0 is never used again, then 3 (period 4), 1 (period 3), 2 (period 2).
    victims = choose_victims({0, 1, 2, 3}, {4}, order, 1, 3 * CHUNK_BYTES, sizes)
    assert victims == [0, 3, 1]
    assert choose_victims({0, 1, 2, 3}, {4}, order, 1, 1, sizes) == [0]
    assert choose_victims({0, 1, 2, 3}, {4}, order, 1, 0, sizes) == []
    # Chunks the period needs are pinned even when they are the furthest.
    assert choose_victims({0, 1, 2, 3}, {0, 3}, order, 1, 2 * CHUNK_BYTES, sizes) == [1, 2]


def test_chunks_wanted_last_go_after_every_other_the_last_of_them_first():
    """``last``: chunks the period still wants (soonest needed first), evicted only when the
    others are not enough, whatever their next use after the period (auto's decisions at a
    period's boundary, see [Note: what a decision keeps] in gemini/policies/auto.py)."""
    order = [{0, 1, 2, 3}, {4}, {2}, {1}, {3}]
    sizes = dict.fromkeys(range(5), CHUNK_BYTES)
    # 0 and 3 are wanted; by next use alone 0 (never again) and 3 (period 4) would go first.
    assert choose_victims({0, 1, 2, 3}, set(), order, 1, 2 * CHUNK_BYTES, sizes, last=[3, 0]) == [1, 2]
    assert choose_victims({0, 1, 2, 3}, set(), order, 1, 3 * CHUNK_BYTES, sizes, last=[3, 0]) == [1, 2, 0]
    assert choose_victims({0, 1, 2, 3}, {1}, order, 1, 3 * CHUNK_BYTES, sizes, last=[3, 0]) == [2, 0, 3]
    with pytest.raises(EvictionError, match="hold only 3000 bytes"):
        choose_victims({0, 1, 2, 3}, {1}, order, 1, 3 * CHUNK_BYTES + 1, sizes, last=[3, 0])
    # Under LRU too.
    assert choose_victims({0, 1, 2, 3}, set(), order, 1, CHUNK_BYTES, sizes, last=[0, 1, 2],
                          rule=EvictionRule.LRU) == [3]


def test_ties_prefer_larger_chunks_then_lower_ids():
    order = [{5, 6, 7}]
    sizes = {5: 100, 6: 300, 7: 300}
    assert choose_victims({5, 6, 7}, set(), order, 0, 250, sizes) == [6]
    assert choose_victims({5, 6, 7}, set(), order, 0, 301, sizes) == [6, 7]


def test_impossible_eviction_raises_with_the_numbers():
    order = [{1, 2}, {3}]
    sizes = {1: 100, 2: 100, 3: 100}
    with pytest.raises(EvictionError, match=r"cannot free 250 bytes at period 1.*hold only 200 bytes"):
        choose_victims({1, 2}, {3}, order, 1, 250, sizes)
    with pytest.raises(EvictionError, match=r"1 resident chunk\(s\) are needed"):
        choose_victims({1, 2}, {2}, order, 0, 150, sizes)


def test_bad_arguments():
    with pytest.raises(ValueError, match="no size for resident chunk 2"):
        choose_victims({1, 2}, set(), [{1}], 0, 10, {1: 5})
    with pytest.raises(TypeError, match="bytes_needed"):
        choose_victims({1}, set(), [{1}], 0, 1.5, {1: 5})
    with pytest.raises(TypeError, match="order"):
        AccessOrder("123")


def _simulate(order: list[frozenset], capacity: int, choose) -> int:
    """Run a cache of `capacity` equal chunks over the trace; `choose` picks the victims."""
    access = AccessOrder(order)
    sizes = {c: CHUNK_BYTES for period in order for c in period}
    resident: set[int] = set()
    misses = 0
    for p, needed in enumerate(order):
        missing = needed - resident
        misses += len(missing)
        overflow = len(resident) + len(missing) - capacity
        victims = choose(resident, needed, access, p, overflow * CHUNK_BYTES, sizes)
        assert not set(victims) & needed
        assert len(victims) == max(overflow, 0)  # equal sizes: exactly what is needed
        resident = (resident - set(victims)) | needed
        assert len(resident) <= capacity
    return misses


def _belady_misses(order: list[frozenset], capacity: int) -> int:
    return _simulate(order, capacity, choose_victims)


def _nearest_next_use_misses(order: list[frozenset], capacity: int) -> int:
    """The opposite policy, to show the traces tell good choices from bad ones."""

    def choose(resident, needed, access, p, bytes_needed, sizes):
        n = max(bytes_needed, 0) // CHUNK_BYTES
        return sorted(resident - needed, key=lambda c: (access.next_use(c, p), c))[:n]

    return _simulate(order, capacity, choose)


def _optimal_misses(order: list[frozenset], capacity: int) -> int:
    """Fewest misses over every possible choice of evictions (exhaustive search)."""

    @functools.cache
    def best(p: int, resident: frozenset) -> int:
        if p == len(order):
            return 0
        needed = order[p]
        missing = needed - resident
        overflow = len(resident) + len(missing) - capacity
        if overflow <= 0:
            return len(missing) + best(p + 1, resident | needed)
        evictable = sorted(resident - needed)
        return len(missing) + min(
            best(p + 1, (resident - set(victims)) | needed)
            for victims in itertools.combinations(evictable, overflow)
        )

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(4))
def test_belady_misses_equal_the_exhaustive_optimum_on_random_traces(seed):
    rng = random.Random(seed)
    worse_elsewhere = 0
    for _ in range(40):
        n_chunks = rng.randint(3, 6)
        capacity = rng.randint(2, 3)
        n_periods = rng.randint(4, 10)
        order = [
            frozenset(rng.sample(range(n_chunks), rng.randint(1, min(capacity, 2)))) for _ in range(n_periods)
        ]
        optimum = _optimal_misses(order, capacity)
        assert _belady_misses(order, capacity) == optimum, order
        worse_elsewhere += _nearest_next_use_misses(order, capacity) > optimum
    # The traces are hard enough that a wrong policy is caught.
    assert worse_elsewhere >= 5


def _lru_reference_misses(order: list[frozenset], capacity: int, *, rounds: int) -> int:
    """An LRU cache written independently: recency by the step a chunk was last touched, ties
    (chunks of one period) to the lower id, as choose_victims breaks them for equal sizes."""
    last_touch: dict[int, int] = {}  # resident chunk -> the step it was last used
    misses = 0
    for step, needed in enumerate(order * rounds):
        for c in needed:
            if c not in last_touch:
                misses += 1
        while len(last_touch.keys() | needed) > capacity:
            victim = min((c for c in last_touch if c not in needed), key=lambda c: (last_touch[c], c))
            del last_touch[victim]
        for c in needed:
            last_touch[c] = step
    return misses


def _simulate_rounds(order: list[frozenset], capacity: int, rounds: int, rule) -> int:
    """Iterations repeat the order: the cache is carried from one to the next."""
    access = AccessOrder(order)
    sizes = {c: CHUNK_BYTES for period in order for c in period}
    resident: set[int] = set()
    misses = 0
    for _ in range(rounds):
        for p, needed in enumerate(order):
            missing = needed - resident
            misses += len(missing)
            overflow = len(resident) + len(missing) - capacity
            victims = choose_victims(resident, needed, access, p, overflow * CHUNK_BYTES, sizes, rule=rule)
            resident = (resident - set(victims)) | needed
    return misses


def test_last_use_wraps_to_the_previous_iteration():
    access = AccessOrder([{1}, {2}, {1, 3}, {2}])
    assert access.last_use(1, 0) == 0
    assert access.last_use(1, 1) == 0
    assert access.last_use(1, 3) == 2
    assert access.last_use(3, 1) == 2 - 4  # not used yet in this iteration: period 2 of the last one
    assert access.last_use(9, 1) == -NEVER


@pytest.mark.parametrize("seed", range(3))
def test_lru_rule_matches_an_independent_lru_cache_and_never_beats_belady(seed):
    rng = random.Random(seed)
    belady_better = 0
    for _ in range(40):
        n_chunks = rng.randint(3, 7)
        capacity = rng.randint(2, 4)
        order = [frozenset(rng.sample(range(n_chunks), rng.randint(1, 2))) for _ in range(rng.randint(3, 9))]
        lru = _simulate_rounds(order, capacity, 3, EvictionRule.LRU)
        assert lru == _lru_reference_misses(order, capacity, rounds=3), order
        belady = _simulate_rounds(order, capacity, 3, EvictionRule.BELADY)
        assert belady <= lru, order
        belady_better += belady < lru
    assert belady_better >= 5  # the traces tell the rules apart
