"""Route's TTFT cost model (kvtier/policy/routing.py: estimate_ttft, choose_by_ttft) with
hand-computed expectations: queue, promotion, fetch and prefill terms, the fetch-or-recompute
choice, and the three routing outcomes (holder, peer plus fetch, recompute)."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.domain.records import TokensByTier, WorkerId
from kvtier.policy.routing import (
    CostCandidate,
    CostParams,
    FetchPlan,
    WorkerCosts,
    WorkerLoad,
    choose_by_ttft,
    estimate_ttft,
)

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
PAGE = 16
# 1,000 bytes per token; prefill 1 ms/token; fetch 1 MB/ms (1e9 B/s) plus 4 ms set-up; a queued
# request costs 100 ms; DRAM promotion 1e8 B/s (10 µs/token); NVMe 1e7 B/s (100 µs/token).
COSTS = WorkerCosts(prefill_ms_per_token=1.0, fetch_bytes_per_s=1e9, fetch_setup_ms=4.0,
                    dram_promote_bytes_per_s=1e8, nvme_promote_bytes_per_s=1e7, ms_per_queued_request=100.0)
PARAMS = CostParams(bytes_per_token=1000.0)


def cand(worker, queue=0, hbm=0, dram=0, nvme=0, costs=COSTS) -> CostCandidate:
    return CostCandidate(worker, WorkerLoad(queue_depth=queue),
                         TokensByTier(hbm_tokens=hbm, dram_tokens=dram, nvme_tokens=nvme), costs)


@pytest.mark.parametrize(
    ("candidate", "holder_tokens", "ttft", "fetch"),
    [
        # Holds nothing, no holder: queue + prefill of all 1,025 tokens.
        (cand(B, queue=2), 0, 200 + 1025, None),
        # Holds 1,024 in HBM: only the last token is computed.
        (cand(A, hbm=1024), 1024, 1.0, None),
        # Holds 512 in DRAM: promotion 512 × 1000 B / 1e8 B/s = 5.12 ms, then 513 tokens.
        (cand(A, dram=512), 512, 5.12 + 513, None),
        # NVMe is 10× slower to promote: 51.2 ms.
        (cand(A, nvme=512), 512, 51.2 + 513, None),
        # A peer holds 1,024: fetch 64 pages (4 + 1,024 × 1000 / 1e6 = 5.024 ms), prefill 1 token.
        (cand(B), 1024, 4 + 1.024 + 1, FetchPlan(A, 0, 64)),
        # Holds 512 itself: fetch the other 32 pages only.
        (cand(B, hbm=512), 1024, 4 + 0.512 + 1, FetchPlan(A, 32, 32)),
        # A 16-token missing stretch: fetching (4.016 ms) beats recomputing it (16 ms) still.
        (cand(B, hbm=1008), 1024, 4 + 0.016 + 1, FetchPlan(A, 63, 1)),
    ],
)
def test_estimate_terms(candidate, holder_tokens, ttft, fetch):
    estimate = estimate_ttft(candidate, 1025, PAGE, PARAMS, A if holder_tokens else None, holder_tokens)
    assert estimate.ttft_ms == pytest.approx(ttft)
    assert estimate.fetch == fetch
    assert estimate.ttft_ms == pytest.approx(
        estimate.queue_ms + estimate.promote_ms + estimate.fetch_ms + estimate.prefill_ms)


def test_short_stretch_is_recomputed_when_setup_dominates():
    slow_setup = WorkerCosts(prefill_ms_per_token=0.1, fetch_bytes_per_s=1e9, fetch_setup_ms=20.0)
    estimate = estimate_ttft(cand(B, costs=slow_setup), 65, PAGE, PARAMS, A, 64)
    assert estimate.fetch is None and estimate.ttft_ms == pytest.approx(6.5)  # 65 × 0.1 < 20 + ...


def test_unmeasured_rates_take_the_stand_ins():
    resolved = PARAMS.resolve(WorkerCosts(prefill_ms_per_token=2.0))
    assert resolved.prefill_ms_per_token == 2.0
    assert resolved.fetch_setup_ms == PARAMS.fetch_setup_ms
    assert resolved.ms_per_queued_request == PARAMS.ms_per_queued_request


@pytest.mark.parametrize(
    ("queues", "prompt", "setup_ms", "winner", "fetch"),
    [
        # The holder is idle: it wins, nothing to fetch.
        ((0, 0, 0), 2049, 4.0, A, None),
        # The holder's queue is long (8 × 100 ms): an idle peer fetches its 2,048 tokens
        # (4 + 2.048 ms) instead of waiting.
        ((8, 0, 1), 2049, 4.0, B, FetchPlan(A, 0, 128)),
        # Same queue, a prefix of one page and a 20 ms fetch set-up: recomputing its 16 tokens
        # (17 ms with the last one) beats fetching (20.016 + 1 ms), so the idle peer recomputes.
        ((8, 0, 1), 17, 20.0, B, None),
    ],
)
def test_choice_follows_the_model(queues, prompt, setup_ms, winner, fetch):
    held = min(prompt - 1, 2048) // PAGE * PAGE
    costs = dataclasses.replace(COSTS, fetch_setup_ms=setup_ms)
    candidates = [cand(A, queue=queues[0], hbm=held, costs=costs), cand(B, queue=queues[1], costs=costs),
                  cand(C, queue=queues[2], costs=costs)]
    ranked = choose_by_ttft(candidates, prompt, PAGE, PARAMS)
    assert ranked[0].worker_id == winner
    assert ranked[0].fetch == fetch
    assert [e.ttft_ms for e in ranked] == sorted(e.ttft_ms for e in ranked)


def test_no_holder_means_least_queue():
    ranked = choose_by_ttft([cand(A, queue=3), cand(B, queue=1), cand(C, queue=1)], 100, PAGE, PARAMS)
    assert [e.worker_id for e in ranked] == [B, C, A]
    assert all(e.fetch is None for e in ranked)
