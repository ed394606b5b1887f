"""Where a paused session's pages wait, when their promotion starts, how long it holds them.

Where to wait — the cheapest of the tiers that can be back in time (seconds of GPU time,
per pause; T = predicted pause, B = the session's bytes):

    HBM     B / hbm_bytes × T × (hbm_idle_price + hbm_occupancy)   memory others can't use
    DRAM    copy_weight × (demote_s + promote_s) + B / dram_bytes × T × dram_price
    NVMe    copy_weight × (demote_s + promote_s)
    a lower tier qualifies only when the pages would wait there at all (demote + promote +
    overhead + margin before the low-quantile return: otherwise the prefetch would fire as
    soon as the demotion lands, two copies for nothing), and
    promote_s < recompute_s (otherwise dropping would be cheaper than the round trip), and
    the session's pages leave the tier at or below its policy ``high`` watermark
    (hbm_occupancy counts HBM pages with an intact copy below as free, ``reclaimable_pages``:
    any allocation takes them at no copy, decision 0012)

When the promotion starts::

    prefetch_at = paused_at + target − promote_time − margin

where ``target`` is the prediction's low quantile (the early end a prefetch aims at; a
prefetch that lands a little early costs HBM for a moment, one that lands late costs the user
a transfer on the token path, decision 0008), or the caller's ETA after ``Returning``.

How the promoted pages are held (``hold_terms``): in HBM until the prediction's high quantile
(at most ``max_hold_ms``), ranked against other holds on the worker by when the session is
expected back (the session due back last yields first); once it is overdue, by how long it has
been away and the prediction's spread.

All times are milliseconds on the caller's clock; sizes are bytes and pages.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from kvtier.domain.records import TierOccupancy, Watermarks
from kvtier.domain.tiers import Tier
from kvtier.policy.prediction import Prediction


@dataclass(frozen=True, slots=True)
class ParkPrices:
    """The prices ``choose_tier`` weighs (module doc), in seconds of GPU time per second."""

    hbm_idle_price: float = 0.05  # worth of idle HBM (what holding costs at occupancy 0)
    dram_price: float = 0.005
    copy_weight: float = 0.1  # share of a copy's seconds that slows serving (copy engines overlap)


@dataclass(frozen=True, slots=True)
class TierChoice:
    tier: Tier
    costs_s: dict[Tier, float]  # every qualifying tier's cost
    promote_s: float  # time to bring the pages back from ``tier`` (0 for HBM)


def choose_tier(
    *,
    num_pages: int,
    page_bytes: int,
    pause_ms: float,
    occupancy: Mapping[Tier, TierOccupancy],
    bandwidth_bytes_per_s: Mapping[tuple[Tier, Tier], float],
    recompute_s: float,
    margin_ms: float,
    prices: ParkPrices = ParkPrices(),
    watermarks: Mapping[Tier, Watermarks] | None = None,
    earliest_return_ms: float | None = None,
    overhead_ms: float = 0.0,
) -> TierChoice:
    """Where a paused session's pages should wait (see the module doc for the costs).

    ``pause_ms``: the expected pause; ``earliest_return_ms``: the early end the prefetch aims
    at (default ``pause_ms``); ``recompute_s``: what recomputing the pages' prefix costs;
    ``overhead_ms``: the worker's measured prefetch overhead beyond the copy."""
    pause_s = pause_ms / 1000.0
    earliest_ms = pause_ms if earliest_return_ms is None else min(earliest_return_ms, pause_ms)
    num_bytes = num_pages * page_bytes
    hbm = occupancy.get(Tier.HBM)
    hbm_bytes = max(1, (hbm.total_pages if hbm else num_pages) * page_bytes)
    # Pages with an intact copy below are as good as free: any allocation takes them at no copy.
    hbm_free = hbm.free_pages + hbm.reclaimable_pages if hbm else 0
    hbm_busy = 1.0 - hbm_free / hbm.total_pages if hbm and hbm.total_pages else 0.0
    costs = {Tier.HBM: num_bytes / hbm_bytes * pause_s * (prices.hbm_idle_price + hbm_busy)}
    promote = {Tier.HBM: 0.0}
    for tier in (Tier.DRAM, Tier.NVME):
        occ = occupancy.get(tier)
        if occ is None or occ.total_pages == 0 or num_pages == 0:
            continue
        marks = (watermarks or {}).get(tier)
        if marks is not None and (occ.cached_pages + occ.in_use_pages + num_pages) / occ.total_pages > marks.high:
            continue  # above its high watermark the worker is busy demoting out of it
        demote_s = num_bytes / bandwidth_bytes_per_s[(Tier.HBM, tier)]
        promote_s = num_bytes / bandwidth_bytes_per_s[(tier, Tier.HBM)]
        round_trip_ms = (demote_s + promote_s) * 1000.0 + overhead_ms + margin_ms
        if round_trip_ms >= earliest_ms or promote_s >= recompute_s:
            continue
        hold = num_bytes / (occ.total_pages * page_bytes) * pause_s * prices.dram_price if tier is Tier.DRAM else 0.0
        costs[tier] = prices.copy_weight * (demote_s + promote_s) + hold
        promote[tier] = promote_s
    best = min(costs, key=lambda t: (costs[t], t))
    return TierChoice(tier=best, costs_s=costs, promote_s=promote[best])


def prefetch_target_ms(prediction: Prediction, *, at_low_quantile: bool = True) -> float:
    """How long after the pause the pages must be back: the prediction's low quantile (never
    past its median), or the median itself when ``at_low_quantile`` is off."""
    if not at_low_quantile:
        return prediction.return_in_ms
    return min(prediction.quantile_lo_ms, prediction.return_in_ms)


def prefetch_start_ms(due_ms: float, promote_ms: float, margin_ms: float) -> float:
    """When a promotion of ``promote_ms`` must start for its pages to be in HBM ``margin_ms``
    before ``due_ms``."""
    return due_ms - promote_ms - margin_ms


def lower_tier(present: Collection[Tier]) -> Tier | None:
    """The first tier below HBM among ``present`` (where a worker's own demotions go)."""
    return next((t for t in (Tier.DRAM, Tier.NVME) if t in present), None)


def topup_delay_ms(attempt: int, delay_ms: float, backoff: float) -> float:
    """How long after the last ack the ``attempt``-th top-up (1-based) waits:
    ``delay_ms × backoff^(attempt − 1)``."""
    return delay_ms * backoff ** (attempt - 1)


@dataclass(frozen=True, slots=True)
class HoldPlan:
    """How a paused session's prefetched pages are to be held in HBM: until ``until_ms`` (the
    prediction's high quantile, or the caller's ETA), and the spread of the predicted return
    (sigma of ln duration; None after a caller's ETA), which ranks the hold once the session
    is overdue."""

    until_ms: float
    spread: float | None = None


def predicted_hold(now_ms: float, prediction: Prediction, spread: float | None) -> HoldPlan:
    """The hold of a session paused at ``now_ms``: to the later of the high quantile and the median."""
    return HoldPlan(now_ms + max(prediction.quantile_hi_ms, prediction.return_in_ms), spread)


def eta_hold(now_ms: float, eta_ms: float, margin_ms: float) -> HoldPlan:
    """The hold of a session whose caller said it is back in ``eta_ms``."""
    return HoldPlan(now_ms + eta_ms + margin_ms)


@dataclass(frozen=True, slots=True)
class HoldTerms:
    """What a Prefetch asks of the worker's hold, all relative to its receipt (ms); None: not
    asked (``PrefetchCommand``'s fields of the same names)."""

    deadline_ms: int | None = None
    return_in_ms: int | None = None
    away_ms: int | None = None
    return_spread: float | None = None


def hold_terms(
    now_ms: int,
    *,
    hold_until_ms: float | None,
    predicted_return_at_ms: float | None,
    paused_at_ms: int | None,
    spread: float | None,
    max_hold_ms: float,
) -> HoldTerms:
    """The hold a Prefetch sent at ``now_ms`` asks for.

    The deadline is how long the worker holds the pages in HBM (until the session is expected
    back at the latest, at most ``max_hold_ms``); without it an eviction meanwhile takes them
    first and the prefetch is wasted. When the session is expected back (the prediction's
    median) ranks the hold against others on the worker: the session due back last yields
    first when room is needed. A session expected back after its hold ends is ranked by the
    hold's end; otherwise how long it has been away and the prediction's spread keep its rank
    true once it is overdue."""
    deadline_ms = return_in_ms = away_ms = None
    return_spread = None
    if hold_until_ms is not None:
        deadline_ms = round(min(max(0.0, hold_until_ms - now_ms), max_hold_ms))
    if predicted_return_at_ms is not None:
        return_in_ms = round(max(0.0, predicted_return_at_ms - now_ms))
        if deadline_ms is not None and return_in_ms > deadline_ms:
            return_in_ms = deadline_ms
        elif spread is not None and paused_at_ms is not None:
            away_ms, return_spread = max(0, now_ms - paused_at_ms), spread
    return HoldTerms(deadline_ms, return_in_ms, away_ms, return_spread)
