"""The orchestrator's settings: prefetch timing, parking prices, anti-thrash budgets, holds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier.cache.eviction import CostModel
from kvtier.domain.records import Watermarks
from kvtier.domain.tiers import Tier
from kvtier.policy.lateness import LatenessParams
from kvtier.policy.placement import ParkPrices
from kvtier.runtime.config import DEFAULT_MAX_SESSIONS_PER_TENANT, DEFAULT_SESSION_HOLD_MAX_S


@dataclass(slots=True)
class OrchestratorParams:
    margin_ms: float = 100.0  # prefetch this much before the predicted return
    prefetch_at_low_quantile: bool = True  # schedule for the predictor's low quantile, not its median
    prices: ParkPrices = field(default_factory=ParkPrices)  # what choose_tier weighs
    bandwidth_bytes_per_s: dict[tuple[Tier, Tier], float] = field(
        default_factory=lambda: dict(CostModel().bandwidth_bytes_per_s)
    )
    cost_model: CostModel = field(default_factory=CostModel)  # page_size/page_bytes come from the worker
    # Anti-thrash bucket per (worker, lower tier); a tier without an entry is unlimited. The
    # policy in force (``apply_policy``) replaces these and ``watermarks``.
    budget_bytes_per_s: Mapping[Tier, float] = field(default_factory=lambda: {Tier.DRAM: 2e9, Tier.NVME: 2e9})
    budget_burst_s: float = 2.0  # a bucket holds this many seconds of its rate
    # A lower tier qualifies for parking only while it stays at or below its ``high`` mark.
    watermarks: Mapping[Tier, Watermarks] = field(default_factory=dict)
    resume_fraction: float = 0.5
    command_timeout_s: float = 5.0
    tick_s: float = 0.01
    # Prefetch timing (docs/decisions/0008-prefetch-timing.md): the overhead assumed before a
    # worker's first Prefetch ack, and the quantile of measured overheads planned for after it.
    prefetch_overhead_ms: float = 50.0
    overhead_quantile: float = 0.9
    # The directory hears of a worker's moves up to one event batch (+ a Redis write) after the
    # ack; a Route sooner than this after a prefetch does not judge its pages (no false waste).
    directory_lag_ms: float = 250.0
    # A Prefetch asks the worker to hold the pages in HBM until the predicted return's high
    # quantile (a late return finds them still there), but never longer than this (a controller
    # takes it from ``ControllerConfig.session_hold_max_s``).
    max_hold_ms: float = DEFAULT_SESSION_HOLD_MAX_S * 1000.0
    # Live sessions one tenant may have (``ControllerConfig.max_sessions_per_tenant``).
    max_sessions_per_tenant: int = DEFAULT_MAX_SESSIONS_PER_TENANT
    # A prefetch that left pages below (a page of the chain in the middle of another move, or no
    # room in HBM at that moment) is topped up this much later, each next top-up
    # ``topup_backoff`` times later than the one before, at most ``max_topups`` times and never
    # after the hold would end (``Orchestrator._schedule_topup``).
    topup_delay_ms: float = 100.0
    topup_backoff: float = 2.0
    max_topups: int = 8
    num_outcomes_kept: int = 10_000  # recent PauseOutcomes (benchmarks read them)
    # Which quantile of each tool's predicted return its prefetches aim at: the predictor's
    # lo_quantile spent by equal hazard across the tenant's tools (``kvtier/policy/lateness.py``).
    lateness: LatenessParams = field(default_factory=LatenessParams)
