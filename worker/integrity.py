"""The worker's integrity check: every pool and index, and the worker's own books against them."""

from __future__ import annotations

from collections.abc import Callable, Set

from kvtier.domain.errors import IntegrityError
from kvtier.domain.records import IntegrityReport, IntegrityResult
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine
from kvtier.worker.page_events import PageEvents


def check_integrity(engine: Engine, run_ids: Set[str], page_events: PageEvents) -> IntegrityResult:
    """One report per component (engine thread); ``run_ids``: the generations the worker has in
    the engine, which must be exactly the requests its scheduler holds."""

    def check_runs() -> None:
        in_engine = engine.request_ids()
        if in_engine != run_ids:
            raise IntegrityError(
                f"{len(in_engine)} requests in the scheduler but {len(run_ids)} runs in flight "
                f"({len(in_engine - run_ids)} without a run, {len(run_ids - in_engine)} without a request)"
            )
        page_events.check_integrity()

    checks: list[tuple[str, Tier | None, Callable[[], None]]] = [
        ("pool", Tier.HBM, engine.pool.check_integrity),
        ("radix", Tier.HBM, engine.index.check_integrity),
        ("engine", None, engine.check_integrity),  # includes the DRAM/NVMe tiers
        ("engine_loop", None, check_runs),
    ]
    reports = []
    for component, tier, check in checks:
        try:
            check()
        except (IntegrityError, AssertionError) as exc:
            reports.append(IntegrityReport(component=component, tier=tier, problem=str(exc)))
        else:
            reports.append(IntegrityReport(component=component, tier=tier))
    return IntegrityResult(reports=tuple(reports))
