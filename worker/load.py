"""The engine's occupancy and queue lengths, as heartbeats and metrics report them."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.cache.quotas import DEFAULT_TENANT
from kvtier.domain.records import TierOccupancy
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine


@dataclass(frozen=True, slots=True)
class TenantPages:
    """A tenant's cached pages in one tier against its quota (``limit_pages`` None: no limit)."""

    tenant: str
    tier: Tier
    num_pages: int
    limit_pages: int | None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Occupancy and queue lengths as of the end of one engine iteration."""

    tiers: tuple[TierOccupancy, ...]
    queue_depth: int  # admitted to the engine, not yet running
    num_running_seqs: int
    # Configured tenants, and any other tenant over its quota (none without quotas).
    tenant_pages: tuple[TenantPages, ...] = ()


def measure_load(engine: Engine, free_hbm: int) -> EngineLoad:
    """``engine``'s load (engine thread); ``free_hbm``: HBM pages free to take at no copy."""
    counts = engine.pool.counts()
    hbm = TierOccupancy(
        tier=Tier.HBM,
        total_pages=counts.total,
        free_pages=counts.free,
        cached_pages=counts.cached,
        in_use_pages=counts.in_use,
        pinned_pages=counts.pinned,
        reclaimable_pages=free_hbm - counts.free,
    )
    tiers = [hbm]
    manager = engine.tiers
    if manager is not None:
        by_tier = engine.index.count_by_tier()
        # Copies of HBM pages kept below (shadows) count as free: not the directory's pages,
        # and any allocation takes them.
        if manager.dram is not None:
            d = manager.dram.counts()
            shadows = manager.num_shadows(Tier.DRAM)
            tiers.append(TierOccupancy(Tier.DRAM, d.total, d.free + shadows, d.cached - shadows, d.in_use, d.pinned))
        if manager.nvme is not None:
            n = manager.nvme
            cached = by_tier[Tier.NVME]
            free = min(n.num_free + manager.num_shadows(Tier.NVME), n.num_slots - cached)
            tiers.append(TierOccupancy(Tier.NVME, n.num_slots, free, cached, n.num_slots - free - cached, 0))
    return EngineLoad(tiers=tuple(tiers), queue_depth=engine.num_queued, num_running_seqs=engine.num_running,
                      tenant_pages=_tenant_pages(engine))


def _tenant_pages(engine: Engine) -> tuple[TenantPages, ...]:
    quotas = engine.quotas
    if quotas is None:
        return ()
    configured = {q.tenant for q in quotas.table.quotas} - {DEFAULT_TENANT}
    keys = sorted({(tenant, tier) for tenant in configured for tier in Tier} | set(quotas.overage()))
    return tuple(TenantPages(tenant, tier, quotas.num_pages(tenant, tier), quotas.limit(tenant, tier))
                 for tenant, tier in keys)
