"""Replay's Belady policy against a brute-force optimum on small hand-made traces.

The brute force replays the same rules as ``loadtests.replay`` with one tier: a request's hits
are the longest cached prefix of its blocks; its missing blocks are cached in order, each one
needing room when the cache is full, made by dropping a cached leaf that the request does not
hold; with no such leaf the rest of the request is not cached. It tries every choice of victim
and keeps the largest number of hits: the offline optimum under the prefix rule.
"""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests import replay as R


def trace_of(requests: list[list[int]]) -> list[R.TraceRequest]:
    return R.trace_from_records([{"timestamp": i, "hash_ids": ids} for i, ids in enumerate(requests)])


def brute_force_hits(trace: list[R.TraceRequest], capacity: int) -> int:
    parent = {}
    for request in trace:
        for i, key in enumerate(request.keys):
            parent[key] = request.keys[i - 1] if i else None

    @functools.cache
    def best(r: int, cached: frozenset) -> int:
        if r == len(trace):
            return 0
        keys = trace[r].keys
        hits = next((i for i, k in enumerate(keys) if k not in cached), len(keys))
        return hits + fill(r, hits, cached)

    @functools.cache
    def fill(r: int, i: int, cached: frozenset) -> int:
        keys = trace[r].keys
        if i == len(keys):
            return best(r + 1, cached)
        if len(cached) < capacity:
            return fill(r, i + 1, cached | {keys[i]})
        held = set(keys[:i])
        parents = {parent[k] for k in cached}
        leaves = [k for k in cached if k not in parents and k not in held]
        if not leaves:
            return best(r + 1, cached)
        return max(fill(r, i + 1, (cached - {leaf}) | {keys[i]}) for leaf in leaves)

    return best(0, frozenset())


def belady_hits(trace: list[R.TraceRequest], capacity: int) -> int:
    result = R.replay(trace, R.BELADY, hbm_blocks=capacity, check_every=1)
    return sum(result.hits_by_tier.values())


def test_belady_keeps_the_block_used_soonest():
    # Capacity 2. At r3 the cache holds [1] and [2]; [3] needs room: Belady drops [2] (used
    # again only at r5) and keeps [1] (used at r4); at r5 it drops [3] (never used again) for
    # [2]: hits at r4 and r6. LRU drops [1] at r3 and [2] at r4: one hit, at r6.
    trace = trace_of([[1], [2], [3], [1], [2], [1]])
    assert belady_hits(trace, 2) == brute_force_hits(trace, 2) == 2
    assert R.replay(trace, "lru", hbm_blocks=2).hit_rate * 6 < 2


def test_belady_respects_the_prefix_rule():
    # Chains 1-2 and 1-3 share block 1: dropping it would orphan its children, so only leaves go.
    trace = trace_of([[1, 2], [1, 3], [4], [1, 2], [1, 3]])
    assert belady_hits(trace, 3) == brute_force_hits(trace, 3)


REQUESTS = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), min_size=1, max_size=7)


@settings(max_examples=150, deadline=None)
@given(requests=REQUESTS, capacity=st.integers(1, 4))
def test_belady_equals_the_brute_force_optimum(requests, capacity):
    trace = trace_of(requests)
    assert belady_hits(trace, capacity) == brute_force_hits(trace, capacity)
