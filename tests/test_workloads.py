"""Workload generators: seeded, prefix-chained, and each with the shape its doc describes."""

from __future__ import annotations

import pytest

from loadtests import replay as R
from loadtests import workloads as W
from loadtests.replay_report import evaluate, gap_closed


def test_same_seed_same_trace_and_another_seed_another():
    assert W.chat(seed=3, num_sessions=50) == W.chat(seed=3, num_sessions=50)
    assert W.chat(seed=3, num_sessions=50) != W.chat(seed=4, num_sessions=50)
    with pytest.raises(ValueError, match="choose one of chat, agent, rag, fewshot"):
        W.generate("video")


@pytest.mark.parametrize(
    "records",
    [W.chat(num_sessions=60), W.agent(num_sessions=20), W.rag(num_requests=300), W.fewshot(num_requests=300)],
    ids=["chat", "agent", "rag", "fewshot"],
)
def test_records_are_mooncake_shaped_and_in_arrival_order(records):
    times = [r["timestamp"] for r in records]
    assert times == sorted(times)
    for r in records:
        assert r["input_length"] == W.BLOCK_TOKENS * len(r["hash_ids"]) > 0
    trace = R.trace_from_records(records)
    assert 0.0 < R.infinite_hit_rate(trace) < 1.0


def test_a_conversation_extends_its_own_prefix():
    # Every chat request but a session's first shares its whole previous turn as a prefix.
    records = W.chat(seed=0, num_sessions=30)
    contexts = [tuple(r["hash_ids"]) for r in records]
    extended = sum(any(c[: len(p)] == p and len(c) > len(p) for p in contexts) for c in contexts)
    assert extended >= len(contexts) - 30


def test_gap_closed():
    assert gap_closed(0.5, 0.4, 0.6) == pytest.approx(0.5)
    assert gap_closed(0.39, 0.4, 0.6) == pytest.approx(-0.05)
    assert gap_closed(0.4, 0.4, 0.4005) is None  # no gap worth a share


def test_evaluate_on_a_hand_made_trace():
    # Capacity 2: [1] [2] [3] [1] [2] [1]. LRU serves 1 of 6 blocks, Belady 2 (test_belady).
    trace = R.trace_from_records([{"timestamp": i, "hash_ids": [b]} for i, b in enumerate([1, 2, 3, 1, 2, 1])])
    row = evaluate(trace, 2, "lru")
    assert (row["lru"], row["belady"], row["policy"]) == (pytest.approx(1 / 6), pytest.approx(2 / 6), row["lru"])
    assert row["gap_closed"] == 0.0


SMALL = {
    "chat": lambda: W.chat(seed=5, num_sessions=600),
    "agent": lambda: W.agent(seed=5, num_sessions=150),
    "rag": lambda: W.rag(seed=5, num_requests=2_500),
    "fewshot": lambda: W.fewshot(seed=5, num_requests=2_500),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_expert_policy_is_never_worse_than_lru_by_more_than_a_fifth_of_a_point(name):
    # A seed and sizes that no choice in the policy was made on; 400 blocks is short of every
    # one of these working sets.
    trace = R.trace_from_records(SMALL[name]())
    experts = R.replay(trace, "experts", hbm_blocks=400)
    lru = R.replay(trace, "lru", hbm_blocks=400)
    assert experts.hit_rate >= lru.hit_rate - 0.002
