"""Where a paused session's pages wait and when they come back (kvtier/policy/placement.py):
tier costs, the prefetch's start, top-up delays and the hold a Prefetch asks for. Plain numbers
(ms, bytes, pages), no Redis, no worker."""

from __future__ import annotations

import pytest

from kvtier.domain.records import PredictionSource, TierOccupancy, Watermarks
from kvtier.domain.tiers import Tier
from kvtier.policy.placement import (
    HoldPlan,
    HoldTerms,
    ParkPrices,
    choose_tier,
    eta_hold,
    hold_terms,
    lower_tier,
    predicted_hold,
    prefetch_start_ms,
    prefetch_target_ms,
    topup_delay_ms,
)
from kvtier.policy.prediction import Prediction

PAGE_BYTES = 2 << 20  # 8B-class model, 2 MiB pages
GB = 1e9
BANDWIDTH = {
    (Tier.HBM, Tier.DRAM): 25 * GB, (Tier.DRAM, Tier.HBM): 25 * GB,  # PCIe
    (Tier.HBM, Tier.NVME): 4 * GB, (Tier.NVME, Tier.HBM): 6 * GB,
}
RECOMPUTE_S = 0.0659  # 100 pages' prefix on that model


def occupancy(hbm_free_fraction: float, *, dram: bool = True, nvme: bool = False,
              dram_used: int = 0) -> dict[Tier, TierOccupancy]:
    total = 40_000  # 80 GB of 2 MiB pages
    free = round(total * hbm_free_fraction)
    occ = {Tier.HBM: TierOccupancy(Tier.HBM, total, free, total - free, 0)}
    if dram:
        occ[Tier.DRAM] = TierOccupancy(Tier.DRAM, 4000, 4000 - dram_used, dram_used, 0)
    if nvme:
        occ[Tier.NVME] = TierOccupancy(Tier.NVME, 100_000, 100_000, 0, 0)
    return occ


def choose(pause_ms: float, occ: dict[Tier, TierOccupancy], **kw):
    args = dict(num_pages=100, page_bytes=PAGE_BYTES, pause_ms=pause_ms, occupancy=occ,
                bandwidth_bytes_per_s=BANDWIDTH, recompute_s=RECOMPUTE_S, margin_ms=100.0)
    return choose_tier(**{**args, **kw})


@pytest.mark.parametrize(("pause_ms", "occ", "kw", "tier"), [
    # A 2 s pause on an idle GPU: the round trip costs more than holding 0.25 % of HBM.
    (2_000, occupancy(0.9), {}, Tier.HBM),
    # The same pause on a busy GPU: demote.
    (2_000, occupancy(0.05), {}, Tier.DRAM),
    # A long pause even on an idle GPU: demote.
    (30_000, occupancy(0.9), {}, Tier.DRAM),
    # Too short to be back in time (promotion + margin exceed the pause): stay.
    (105, occupancy(0.0), {}, Tier.HBM),
    # ... and the early end the prefetch aims at counts, not the median.
    (30_000, occupancy(0.0), {"earliest_return_ms": 110}, Tier.HBM),
    # No lower tier on the worker: stay.
    (30_000, occupancy(0.0, dram=False), {}, Tier.HBM),
    # Only NVMe: its round trip (52 + 35 ms) is cheaper than holding a busy GPU's HBM.
    (30_000, occupancy(0.05, dram=False, nvme=True), {}, Tier.NVME),
    # Promoting would take longer than recomputing: drop rather than park (keep in HBM here).
    (30_000, occupancy(0.05), {"recompute_s": 0.008}, Tier.HBM),
    # DRAM past its high watermark with these pages (3950 + 100 of 4000 > 0.9): not a choice.
    (30_000, occupancy(0.05, dram_used=3_950), {"watermarks": {Tier.DRAM: Watermarks(0.9, 0.8)}}, Tier.HBM),
    # Copies weigh heavily: holding is the cheaper choice.
    (30_000, occupancy(0.05), {"prices": ParkPrices(copy_weight=1e6)}, Tier.HBM),
])
def test_choose_tier_weighs_holding_against_the_round_trip(pause_ms, occ, kw, tier):
    assert choose(pause_ms, occ, **kw).tier is tier


def test_choose_tier_costs_are_the_module_doc_formulas():
    choice = choose(2_000, occupancy(0.05))
    num_bytes = 100 * PAGE_BYTES
    hbm = num_bytes / (40_000 * PAGE_BYTES) * 2.0 * (0.05 + 0.95)
    round_trip_s = 2 * num_bytes / (25 * GB)
    dram = 0.1 * round_trip_s + num_bytes / (4000 * PAGE_BYTES) * 2.0 * 0.005
    assert choice.costs_s == pytest.approx({Tier.HBM: hbm, Tier.DRAM: dram})
    assert choice.promote_s == pytest.approx(num_bytes / (25 * GB))


def test_reclaimable_hbm_pages_count_as_free():
    busy = occupancy(0.05)
    reclaimable = {**busy, Tier.HBM: TierOccupancy(Tier.HBM, 40_000, 2_000, 38_000, 0, reclaimable_pages=38_000)}
    assert choose(2_000, busy).tier is Tier.DRAM
    assert choose(2_000, reclaimable).tier is Tier.HBM


def prediction(median_ms: float, lo_ms: float, hi_ms: float) -> Prediction:
    return Prediction(median_ms, lo_ms, hi_ms, 1.0, PredictionSource.HISTORY)


@pytest.mark.parametrize(("median_ms", "lo_ms", "at_low_quantile", "target_ms"), [
    (2_000, 600, True, 600),
    (2_000, 2_500, True, 2_000),  # never past the median
    (2_000, 600, False, 2_000),
])
def test_the_prefetch_aims_at_the_low_quantile(median_ms, lo_ms, at_low_quantile, target_ms):
    assert prefetch_target_ms(prediction(median_ms, lo_ms, 9_000), at_low_quantile=at_low_quantile) == target_ms


@pytest.mark.parametrize(("due_ms", "promote_ms", "margin_ms", "start_ms"), [
    (10_600, 84, 100, 10_416),
    (1_000, 0, 0, 1_000),
    (100, 150, 100, -150),  # already late: the caller starts it at once
])
def test_the_prefetch_starts_a_promotion_and_a_margin_before_it_is_due(due_ms, promote_ms, margin_ms, start_ms):
    assert prefetch_start_ms(due_ms, promote_ms, margin_ms) == start_ms


@pytest.mark.parametrize(("attempt", "delay_ms"), [(1, 100), (2, 200), (3, 400), (8, 12_800)])
def test_top_ups_back_off(attempt, delay_ms):
    assert topup_delay_ms(attempt, 100.0, 2.0) == delay_ms


@pytest.mark.parametrize(("present", "tier"), [
    ({Tier.HBM, Tier.DRAM, Tier.NVME}, Tier.DRAM),
    ({Tier.HBM, Tier.NVME}, Tier.NVME),
    ({Tier.HBM}, None),
])
def test_a_workers_own_demotions_go_to_its_first_lower_tier(present, tier):
    assert lower_tier(present) is tier


def test_holds_last_to_the_high_quantile_or_the_callers_eta():
    assert predicted_hold(1_000, prediction(2_000, 600, 9_000), 0.6) == HoldPlan(10_000, 0.6)
    assert predicted_hold(1_000, prediction(2_000, 600, 1_500), None) == HoldPlan(3_000)  # hi below median
    assert eta_hold(1_000, 500, 100) == HoldPlan(1_600)


@pytest.mark.parametrize(("now", "kw", "terms"), [
    # Paused at 0, expected back at 2 s, held to 9 s, spread 0.6: asked at 500 ms.
    (500, dict(hold_until_ms=9_000, predicted_return_at_ms=2_000, paused_at_ms=0, spread=0.6),
     HoldTerms(deadline_ms=8_500, return_in_ms=1_500, away_ms=500, return_spread=0.6)),
    # The hold is bounded by max_hold_ms (10 s); a return after it is ranked by the hold's end.
    (0, dict(hold_until_ms=60_000, predicted_return_at_ms=30_000, paused_at_ms=0, spread=0.6),
     HoldTerms(deadline_ms=10_000, return_in_ms=10_000)),
    # Overdue: expected back 1 s ago; ranked by how long it has been away and the spread.
    (3_000, dict(hold_until_ms=9_000, predicted_return_at_ms=2_000, paused_at_ms=0, spread=0.6),
     HoldTerms(deadline_ms=6_000, return_in_ms=0, away_ms=3_000, return_spread=0.6)),
    # After a caller's ETA there is no spread to rank by.
    (1_000, dict(hold_until_ms=1_600, predicted_return_at_ms=1_500, paused_at_ms=0, spread=None),
     HoldTerms(deadline_ms=600, return_in_ms=500)),
    # Nothing known: nothing asked.
    (1_000, dict(hold_until_ms=None, predicted_return_at_ms=None, paused_at_ms=None, spread=None), HoldTerms()),
])
def test_the_hold_a_prefetch_asks_for(now, kw, terms):
    assert hold_terms(now, max_hold_ms=10_000, **kw) == terms
