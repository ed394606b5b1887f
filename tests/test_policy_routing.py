"""The routing score with hand-computed expectations (kvtier/policy/routing.py): tier weights,
load penalty, ties, affinity stickiness and its overload escape. Plain token counts, no Redis."""

from __future__ import annotations

import pytest

from kvtier.domain.records import TokensByTier, WorkerId
from kvtier.domain.tiers import Tier
from kvtier.policy.routing import (
    Candidate,
    RouterParams,
    WorkerLoad,
    is_overloaded,
    load_penalty,
    prefix_value,
    rank_workers,
)

PARAMS = RouterParams()  # HBM 1.0, DRAM 0.8, NVMe 0.5; 256 / queued, 16 / running, 512 at no HBM left
A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")


def idle(worker: WorkerId, **load) -> Candidate:
    return Candidate(worker, f"{worker}:1", WorkerLoad(**load))


def order(ranked) -> list[str]:
    return [r.worker_id for r in ranked]


def test_prefix_value_weighs_each_tier():
    assert prefix_value(TokensByTier(hbm_tokens=8, dram_tokens=4, nvme_tokens=4), PARAMS) == pytest.approx(
        8 * 1.0 + 4 * 0.8 + 4 * 0.5
    )  # 13.2
    custom = RouterParams(tier_weights={Tier.HBM: 2.0})  # a tier without a weight is worth 0
    assert prefix_value(TokensByTier(hbm_tokens=3, dram_tokens=100), custom) == 6.0


def test_load_penalty_counts_queue_running_and_hbm_pressure():
    # 2 queued, 3 running, 5 of 100 HBM pages available (free 2 + cached 3): 5 % < 10 %,
    # pressure = 1 - 0.05 / 0.10 = 0.5.
    load = WorkerLoad(queue_depth=2, num_running_seqs=3, hbm_total_pages=100, hbm_available_pages=5)
    assert load_penalty(load, PARAMS) == pytest.approx(2 * 256 + 3 * 16 + 0.5 * 512)  # 816
    assert load_penalty(WorkerLoad(hbm_total_pages=100, hbm_available_pages=10), PARAMS) == 0
    assert load_penalty(WorkerLoad(hbm_total_pages=100, hbm_available_pages=0), PARAMS) == 512
    assert load_penalty(WorkerLoad(), PARAMS) == 0  # no heartbeat yet: no HBM figures, no pressure


def test_ranking_by_score_tier_weights_and_load():
    matched = {
        A: TokensByTier(hbm_tokens=8, dram_tokens=4, nvme_tokens=4),  # 13.2
        B: TokensByTier(hbm_tokens=12),  # 12.0
        C: TokensByTier(dram_tokens=16),  # 12.8
    }
    ranked = rank_workers([idle(A), idle(B), idle(C)], matched, PARAMS)
    assert order(ranked) == ["a", "c", "b"]
    assert [r.score for r in ranked] == pytest.approx([13.2, 12.8, 12.0])
    assert ranked[0].matched_tokens == matched[A] and ranked[0].address == "a:1"

    # One queued request (256 tokens) outweighs a 200-token HBM prefix: idle and empty wins.
    matched = {A: TokensByTier(hbm_tokens=200)}
    ranked = rank_workers([idle(A, queue_depth=1), idle(B)], matched, PARAMS)
    assert order(ranked) == ["b", "a"]
    assert [r.score for r in ranked] == pytest.approx([0.0, 200 - 256])


def test_ties_go_to_the_shorter_queue_then_the_worker_id():
    params = RouterParams(queue_penalty_tokens=0.0)
    ranked = rank_workers([idle(C, queue_depth=1), idle(B), idle(A)], {}, params)
    assert order(ranked) == ["a", "b", "c"]


def test_affinity_is_sticky_while_its_worker_is_not_overloaded():
    matched = {A: TokensByTier(hbm_tokens=64), C: TokensByTier(hbm_tokens=32)}
    ranked = rank_workers([idle(A), idle(B), idle(C)], matched, PARAMS, affinity=B)
    assert order(ranked) == ["b", "a", "c"]
    assert [r.is_affinity for r in ranked] == [True, False, False]
    # Some load does not move the session (B scores 7 * -256 and still comes first) ...
    ranked = rank_workers([idle(A), idle(B, queue_depth=7), idle(C)], matched, PARAMS, affinity=B)
    assert order(ranked) == ["b", "a", "c"] and ranked[0].score == -7 * 256


def test_affinity_escapes_an_overloaded_or_missing_worker():
    matched = {A: TokensByTier(hbm_tokens=64)}
    # ... an overloaded worker does: a queue of 8 ...
    assert is_overloaded(WorkerLoad(queue_depth=8), PARAMS)
    ranked = rank_workers([idle(A), idle(B, queue_depth=8)], matched, PARAMS, affinity=B)
    assert order(ranked) == ["a", "b"] and [r.is_affinity for r in ranked] == [False, True]
    # ... or under 2 % of its HBM pages available (1 of 100) ...
    full = idle(B, hbm_total_pages=100, hbm_available_pages=1)
    assert is_overloaded(full.load, PARAMS)
    assert order(rank_workers([idle(A), full], matched, PARAMS, affinity=B)) == ["a", "b"]
    # ... and a worker that is gone is simply not a candidate.
    ranked = rank_workers([idle(A), idle(C)], matched, PARAMS, affinity=B)
    assert order(ranked) == ["a", "c"] and not any(r.is_affinity for r in ranked)
