"""Route by estimated TTFT from the registry's live numbers (controller/cost_model.py): the
rates each worker measured arrive on heartbeats, and the pick follows the model: the holder
while it is idle, an idle peer plus a fetch plan once the holder's queue is long, recompute
when the prefix is too short to be worth a fetch. The model's arithmetic is in
tests/test_policy_cost_model.py."""

from __future__ import annotations

import pytest

from kvtier.controller.cost_model import FALLBACK_BYTES_PER_TOKEN, entry_bytes_per_token, rank_entries_by_ttft
from kvtier.controller.registry import Registry
from kvtier.controller.router import worker_load
from kvtier.domain.records import (
    BootId,
    Heartbeat,
    ModelIdentity,
    PeerFetch,
    Registration,
    TierCapacity,
    TierOccupancy,
    TokensByTier,
    WorkerCosts,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.policy.routing import Candidate, RouterParams

PAGE = 16
TOKEN_BYTES = 1024  # 64 KiB pages of 16 tokens
PARAMS = RouterParams(rank_by_ttft=True)
# As a worker of the tiny model measures itself: 0.5 ms per prefilled token, fetches at 1 GB/s
# after a 2 ms set-up, 40 ms of wait per request queued ahead.
MEASURED = WorkerCosts(prefill_ms_per_token=0.5, fetch_bytes_per_s=1e9, fetch_setup_ms=2.0,
                       ms_per_queued_request=40.0)


def registry(queues: dict[str, int], costs: WorkerCosts | None = MEASURED) -> Registry:
    reg = Registry(lease_ttl_s=10.0)
    hbm = TierOccupancy(Tier.HBM, total_pages=1000, free_pages=1000, cached_pages=0, in_use_pages=0)
    for link_id, (worker, queue) in enumerate(queues.items()):
        reg.connect(Registration(
            worker_id=WorkerId(worker), address=f"{worker}:1", boot_id=BootId("b"), model=ModelIdentity(model_id="m"),
            page_size=PAGE, capacities=(TierCapacity(Tier.HBM, 1000, 1000 * PAGE * TOKEN_BYTES),),
        ), link_id)
        reg.heartbeat(WorkerId(worker), link_id, Heartbeat(1, (hbm,), queue_depth=queue, costs=costs))
    return reg


def route(reg: Registry, held_by_a: int, prompt: int, affinity=None):
    entries = reg.workers()
    candidates = [Candidate(e.worker_id, e.address, worker_load(e)) for e in entries]
    matched = {WorkerId("a"): TokensByTier(hbm_tokens=held_by_a)}
    return rank_entries_by_ttft(entries, candidates, matched, prompt_tokens=prompt, page_size=PAGE,
                                params=PARAMS, affinity=affinity)


def test_heartbeat_costs_reach_the_registry_and_are_kept_when_a_heartbeat_has_none():
    reg = registry({"a": 0})
    (entry,) = reg.workers()
    assert entry.costs == MEASURED
    reg.heartbeat(WorkerId("a"), 0, Heartbeat(2, (), costs=None))
    assert entry.costs == MEASURED
    assert entry_bytes_per_token(entry) == TOKEN_BYTES


@pytest.mark.parametrize(
    ("queues", "held", "prompt", "winner", "fetch"),
    [
        # The holder is idle: it runs the request, from its own pages.
        ({"a": 0, "b": 0, "c": 0}, 2048, 2049, "a", None),
        # Its queue is long (10 × 40 ms): idle b fetches 128 pages (2 + 2 MiB / 1 GB/s ≈ 4.1 ms)
        # and prefills one token, far below waiting 400 ms.
        ({"a": 10, "b": 0, "c": 3}, 2048, 2049, "b", PeerFetch(WorkerId("a"), 128)),
        # A one-page prefix is still worth a fetch with a 2 ms set-up: ≈ 2.02 ms against 8 ms of
        # prefill for its 16 tokens (the next test raises the set-up).
        ({"a": 10, "b": 0, "c": 3}, 16, 17, "b", PeerFetch(WorkerId("a"), 1)),
    ],
)
def test_the_pick_follows_the_cost_model(queues, held, prompt, winner, fetch):
    ranked = route(registry(queues), held, prompt)
    assert ranked[0].worker_id == winner and ranked[0].fetch == fetch
    assert ranked[0].estimated_ttft_ms == -ranked[0].score
    assert [r.estimated_ttft_ms for r in ranked] == sorted(r.estimated_ttft_ms for r in ranked)


def test_a_prefix_too_short_to_fetch_is_recomputed():
    """With a set-up of 20 ms (as measured across nodes on a slow network), one page of 16
    tokens is prefilled (8.5 ms) rather than fetched (20 ms and more)."""
    slow = WorkerCosts(prefill_ms_per_token=0.5, fetch_bytes_per_s=1e9, fetch_setup_ms=20.0,
                       ms_per_queued_request=40.0)
    ranked = route(registry({"a": 10, "b": 0, "c": 3}, slow), 16, 17)
    assert ranked[0].worker_id == "b" and ranked[0].fetch is None
    assert ranked[0].estimated_ttft_ms == pytest.approx(17 * 0.5)


def test_unmeasured_workers_use_the_stand_ins_and_affinity_stays_first():
    ranked = route(registry({"a": 0, "b": 0}, costs=None), 2048, 2049, affinity=WorkerId("b"))
    assert ranked[0].worker_id == "b" and ranked[0].is_affinity
    assert ranked[0].fetch == PeerFetch(WorkerId("a"), 128), "the sticky worker still fetches what a peer holds"
    assert FALLBACK_BYTES_PER_TOKEN > 0


def test_running_sequences_and_routes_since_the_heartbeat_count_as_work_ahead():
    """A continuous batch admits at once: the holder's queue shows 0 while 8 requests run, and
    Routes between two heartbeats see no queue at all. Running sequences count at the measured
    wait per request ahead; the requests Routes sent since the heartbeat by the tokens they will
    prefill there, until the next heartbeat reports them."""
    reg = registry({"a": 0, "b": 0})
    ranked = route(reg, 2048, 2080)
    assert ranked[0].worker_id == "a" and ranked[0].fetch is None  # idle holder
    hbm = TierOccupancy(Tier.HBM, total_pages=1000, free_pages=1000, cached_pages=0, in_use_pages=0)
    reg.heartbeat(WorkerId("a"), 0, Heartbeat(2, (hbm,), queue_depth=0, num_running_seqs=8, costs=MEASURED))
    busy = route(reg, 2048, 2080)
    assert busy[0].worker_id == "b" and busy[0].fetch == PeerFetch(WorkerId("a"), 128)
    holder = next(r for r in busy if r.worker_id == "a")
    assert holder.estimated_ttft_ms == pytest.approx(8 * 40.0 + 32 * 0.5)

    reg = registry({"a": 0, "b": 0})
    reg.routed(WorkerId("a"), 1024)  # a request on its way will prefill 1,024 tokens on a
    ranked = route(reg, 2048, 2080)
    assert ranked[0].worker_id == "b" and ranked[0].fetch == PeerFetch(WorkerId("a"), 128)
    holder = next(r for r in ranked if r.worker_id == "a")
    assert holder.estimated_ttft_ms == pytest.approx(1024 * 0.5 + 32 * 0.5)
    entry = reg.get(WorkerId("a"))
    assert entry.num_routed == 1 and entry.routed_tokens == 1024
    reg.heartbeat(WorkerId("a"), 0, Heartbeat(2, (hbm,), queue_depth=1, costs=MEASURED))
    assert entry.num_routed == entry.routed_tokens == 0, "the heartbeat's queue shows it from now on"
