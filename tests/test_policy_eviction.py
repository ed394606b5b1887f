"""The pure eviction experts and their learner, with plain numbers (ticks, ratios)."""

from __future__ import annotations

import math

import pytest

from kvtier.policy.eviction import (
    DEFAULT_EXPERTS,
    Expert,
    ExpertLearner,
    MiniatureCache,
    Usage,
    UsageHistory,
    expert_scores,
    sample_rate_for,
)


def key(i: int) -> bytes:
    return i.to_bytes(2, "little") + b"\0" * 14  # sampled by any rate: the first bytes are small


def test_history_learns_gaps_and_inherits_the_parents_gap():
    history = UsageHistory(max_keys=8, gap_weight=0.5)
    history.observe(key(1), None, tick=10)
    usage = history.observe(key(1), None, tick=30)
    assert (usage.last, usage.uses, usage.gap, usage.gap_seen) == (30, 2, 20.0, True)
    usage = history.observe(key(1), None, tick=40)
    assert usage.gap == 15.0  # moving mean: 20 + 0.5 × (10 − 20)
    child = history.observe(key(2), key(1), tick=41)
    assert (child.uses, child.gap, child.gap_seen) == (1, 15.0, False)  # the turn after comes as late
    orphan = history.observe(key(3), key(9), tick=42)
    assert orphan.gap == 0.0
    assert history.observe(key(1), None, tick=40).uses == 3  # the same tick is one use


def test_history_forgets_the_least_recently_used_key_past_its_bound():
    history = UsageHistory(max_keys=2)
    for tick, i in enumerate((1, 2, 1, 3)):
        history.observe(key(i), None, tick)
    assert history.get(key(2)) is None and history.get(key(1)) is not None and history.get(key(3)) is not None
    with pytest.raises(ValueError, match="max_keys"):
        UsageHistory(0)


@pytest.mark.parametrize(
    "usage,mean_gap,cost,max_offset,expected",
    [
        # last, last + mean × log2(uses), the same × cost, last − gap, last + max_offset × log2(uses)
        (Usage(last=100, uses=1), 10.0, 1.0, math.inf, (100.0, 100.0, 100.0, 80.0, 100.0)),
        (Usage(last=100, uses=4, gap=5.0, gap_seen=True), 10.0, 2.0, 40.0, (100.0, 120.0, 140.0, 95.0, 180.0)),
        (Usage(last=100, uses=4, gap=500.0, gap_seen=True), 10.0, 2.0, 30.0, (100.0, 120.0, 130.0, 70.0, 160.0)),
        (Usage(last=7, uses=2), 0.0, 1.0, 5.0, (7.0, 8.0, 8.0, 5.0, 12.0)),  # mean gap at least 1 tick
    ],
)
def test_expert_scores(usage, mean_gap, cost, max_offset, expected):
    assert expert_scores(usage, mean_gap=mean_gap, cost_ratio=cost, max_offset=max_offset) == expected
    assert len(expected) == len(Expert)


def test_miniature_evicts_the_lowest_score_but_never_the_key_in_use():
    cache = MiniatureCache(2)
    assert not cache.access(b"a", 1.0)
    assert not cache.access(b"b", 2.0)
    assert cache.access(b"a", 3.0)  # a is now newer than b
    assert not cache.access(b"c", 0.5)  # lowest score, but in use: b leaves instead
    assert len(cache) == 2
    assert cache.access(b"a", 4.0) and cache.access(b"c", 5.0)
    assert not cache.access(b"b", 6.0)


@pytest.mark.parametrize("capacity,rate", [(100, 1.0), (256, 1.0), (1_000, 0.256), (100_000, 1 / 16)])
def test_sample_rate(capacity, rate):
    assert sample_rate_for(capacity) == pytest.approx(rate)


def scan_with_hot_keys(num_rounds: int, *, hot: int, scan: int) -> list[int]:
    """Each round uses ``hot`` keys and then ``scan`` keys never seen again."""
    stream, fresh = [], 10_000
    for _ in range(num_rounds):
        stream += list(range(hot))
        stream += list(range(fresh, fresh + scan))
        fresh += scan
    return stream


def drive(learner: ExpertLearner, stream: list[int]) -> None:
    for tick, i in enumerate(stream):
        learner.observe(key(i), None, tick)


def test_a_scan_over_hot_keys_hands_the_lead_to_frequency():
    # 40 hot keys and a scan of 60 per round through 64 pages: LRU keeps none of the hot keys
    # (each comes back after 100 uses), a frequency-weighted order keeps them.
    learner = ExpertLearner(64, experts=(Expert.LRU, Expert.FREQUENCY), loss_window=200)
    drive(learner, scan_with_hot_keys(60, hot=40, scan=60))
    assert learner.leading is Expert.FREQUENCY
    assert learner.losses[1] < learner.losses[0] - 0.2


def test_a_scan_over_hot_keys_hands_the_default_lead_to_turnover():
    # The same scan with the default experts: only TURNOVER's order keeps the hot keys.
    learner = ExpertLearner(64, loss_window=200)
    assert learner.experts == DEFAULT_EXPERTS
    drive(learner, scan_with_hot_keys(60, hot=40, scan=60))
    assert learner.leading is Expert.TURNOVER
    usage = learner.history.get(key(3))
    assert learner.priority(usage) == usage.last + 64 * math.log2(usage.uses)


def test_lru_keeps_the_lead_where_no_expert_is_better():
    # A loop that fits: every expert hits every use after the first round.
    learner = ExpertLearner(64, loss_window=200)
    drive(learner, list(range(50)) * 40)
    assert learner.leading is Expert.LRU and learner.num_switches == 0
    usage = learner.history.get(key(3))
    assert learner.priority(usage) == usage.last


def test_learner_rejects_bad_arguments():
    with pytest.raises(ValueError, match="capacity_pages"):
        ExpertLearner(0)
    with pytest.raises(ValueError, match="at least one expert"):
        ExpertLearner(10, experts=())
