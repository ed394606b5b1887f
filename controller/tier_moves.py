"""The tier commands the orchestrator sends and what they cost on each worker.

Sending a command (with its timeout, refusals counted by ``<command>:<error code>``), the
anti-thrash token bucket per (worker, lower tier) (``controller/token_bucket.py``), each
worker's page bytes and first lower tier, and the promote time learnt from its Prefetch acks
(``PromoteLatency``, ``controller/prefetch.py``). The park's Demote goes through here too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvtier.controller.orchestrator_params import OrchestratorParams
from kvtier.controller.prefetch import MoveReason, PrefetchStats, PromoteLatency
from kvtier.controller.registry import Registry, WorkerEntry
from kvtier.controller.sessions import SessionRecord
from kvtier.controller.token_bucket import TokenBucket
from kvtier.domain.errors import KvtierError
from kvtier.domain.records import Command, CommandAck, DemoteCommand, PrefetchCommand, WorkerId
from kvtier.domain.tiers import Tier
from kvtier.policy.placement import lower_tier
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.orchestrator")  # its commands log as the orchestrator does

SendCommand = Callable[[WorkerId, Command], Awaitable[CommandAck]]


@dataclass(frozen=True, slots=True)
class SentPrefetch:
    """A Prefetch on its way: what its ack is counted against."""

    worker: WorkerId
    command: PrefetchCommand
    reason: str
    source: Tier
    page_bytes: int
    sent_at_ms: float
    paused_at_ms: int | None  # identifies the pause it serves
    attempt: int = 0  # 0: the pause's prefetch; k > 0: its k-th top-up


class TierMoves:
    """Commands to workers and their costs, for one orchestrator. ``params`` is the
    orchestrator's; ``apply_params`` takes new ones (buckets restart full at the new rates)."""

    def __init__(
        self, registry: Registry, send_command: SendCommand, params: OrchestratorParams, stats: PrefetchStats,
        clock_ms: Callable[[], float],
    ) -> None:
        self.registry = registry
        self._send_command = send_command
        self.params = params
        self.stats = stats
        self.clock_ms = clock_ms
        self._buckets: dict[tuple[WorkerId, Tier], TokenBucket] = {}
        self._latency: dict[WorkerId, PromoteLatency] = {}

    def apply_params(self, params: OrchestratorParams) -> None:
        self.params = params
        self._buckets.clear()

    async def send(self, worker: WorkerId, command: Command) -> CommandAck | None:
        try:
            ack = await asyncio.wait_for(self._send_command(worker, command), self.params.command_timeout_s)
        except (KvtierError, TimeoutError) as exc:
            log.warning("tier command not carried out", extra={
                "worker_id": worker, "command": type(command).__name__, "reason": str(exc)})
            key = f"{type(command).__name__}:{getattr(exc, 'code', 'TIMEOUT')}"
            self.stats.refused[key] = self.stats.refused.get(key, 0) + 1
            return None
        if not ack.ok:
            key = f"{type(command).__name__}:{ack.error_code}"
            self.stats.refused[key] = self.stats.refused.get(key, 0) + 1
            log.warning("tier command refused", extra={
                "worker_id": worker, "command": type(command).__name__, "error_code": ack.error_code,
                "reason": ack.error_message})
        return ack

    def bucket(self, worker: WorkerId, tier: Tier) -> TokenBucket | None:
        """The (worker, tier) link's bucket; None when the tier's budget is unlimited."""
        rate = self.params.budget_bytes_per_s.get(tier)
        if rate is None:
            return None
        bucket = self._buckets.get((worker, tier))
        if bucket is None:
            p = self.params
            bucket = self._buckets[(worker, tier)] = TokenBucket(
                rate, rate * p.budget_burst_s, p.resume_fraction, lambda: self.clock_ms() / 1000.0)
        return bucket

    def entry(self, worker: WorkerId | None) -> WorkerEntry | None:
        return self.registry.get(worker) if worker else None

    def page_bytes(self, worker: WorkerId | None) -> int:
        entry = self.entry(worker)
        if entry is None:
            return 0
        for capacity in entry.registration.capacities:
            if capacity.tier is Tier.HBM and capacity.capacity_pages:
                return capacity.capacity_bytes // capacity.capacity_pages
        return 0

    def latency_of(self, worker: WorkerId) -> PromoteLatency:
        latency = self._latency.get(worker)
        if latency is None:
            p = self.params
            latency = self._latency[worker] = PromoteLatency(p.prefetch_overhead_ms, quantile=p.overhead_quantile)
        return latency

    def prefetch_overheads(self) -> dict[WorkerId, tuple[int, float]]:
        """Per worker: acknowledged prefetches measured, and the overhead planned with (ms)."""
        return {w: (latency.num_samples, latency.overhead_ms()) for w, latency in self._latency.items()}

    def lower_tier_of(self, worker: WorkerId | None) -> Tier | None:
        """The worker's first tier below HBM (where its own demotions go), if it has one."""
        entry = self.entry(worker)
        if entry is None:
            return None
        return lower_tier({o.tier for o in entry.tiers if o.total_pages})  # as of its last heartbeat

    def source_tier(self, record: SessionRecord) -> Tier | None:
        """Where a prefetch of ``record`` brings pages from: the tier they were parked in, or,
        for a session kept in HBM (a guard), the tier the worker's own demotions use."""
        if record.parked_tier is None:
            return None
        return record.parked_tier if record.parked_tier is not Tier.HBM else self.lower_tier_of(record.worker_id)

    def promote_ms(self, record: SessionRecord) -> float:
        """How long a Prefetch of the session's pages takes on their worker, ack included (a
        guard assumes every page of the session's history has to come back)."""
        source = self.source_tier(record)
        entry = self.entry(record.worker_id)
        if source is None or entry is None or record.worker_id is None:
            return 0.0
        num_pages = record.num_parked_pages
        if record.parked_tier is Tier.HBM:
            num_pages = record.num_cached_tokens // max(1, entry.registration.page_size)
        rate = self.params.bandwidth_bytes_per_s[(source, Tier.HBM)]
        return self.latency_of(record.worker_id).estimate_ms(num_pages * self.page_bytes(record.worker_id), rate)

    async def demote(self, record: SessionRecord, worker: WorkerId, tier: Tier, num_pages: int) -> bool:
        """Send the park's Demote within the anti-thrash budget; True when pages moved (counted)."""
        assert record.namespace_digest is not None
        page_bytes = self.page_bytes(worker)
        bucket = self.bucket(worker, tier)
        if bucket is not None and not bucket.try_take(num_pages * page_bytes):
            self.stats.num_throttled += 1
            log.info("demotion throttled", extra={"session_id": record.session_id, "tier": tier.label})
            return False
        ack = await self.send(worker, DemoteCommand(record.namespace_digest, (), tier, session_id=record.session_id))
        if ack is None or not ack.ok or ack.num_pages == 0:
            return False
        record.num_parked_pages = ack.num_pages
        self.stats.num_demoted += 1
        self.stats.demoted_bytes += ack.num_pages * page_bytes
        self.stats.count_move(MoveReason.PARK, Tier.HBM.label, tier.label, ack.num_pages, ack.num_pages * page_bytes)
        return True

    def count_prefetch(self, sent: SentPrefetch, ack: CommandAck) -> float:
        """Count an acknowledged Prefetch's moved pages and teach its worker's ``PromoteLatency``
        the ack's latency; returns that latency (ms)."""
        latency_ms = self.clock_ms() - sent.sent_at_ms
        moved_bytes = ack.num_pages * sent.page_bytes
        rate = self.params.bandwidth_bytes_per_s[(sent.source, Tier.HBM)]
        self.latency_of(sent.worker).observe(latency_ms, moved_bytes, rate)
        if ack.num_pages:  # a guard that found every page still in HBM moved nothing
            self.stats.num_prefetched += 1
            self.stats.prefetched_bytes += moved_bytes
            self.stats.count_move(sent.reason, sent.source.label, Tier.HBM.label, ack.num_pages, moved_bytes)
        return latency_ms
