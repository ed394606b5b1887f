"""Tool-call-aware tiering: park a paused session's pages, bring them back in time (DESIGN §5.8).

On Pause the orchestrator predicts the return (``ToolReturnPredictor``), picks where the
session's pages wait, sends ``Demote`` (by session id: only the worker knows the pages
of the last turn's output), and schedules ``Prefetch`` into HBM at

    prefetch_at = paused_at + predicted_return_low_quantile − promote_time − margin

on a timer queue. ``Returning`` pulls the prefetch forward (now, or ``eta − promote −
margin``); ``End`` cancels it and drops the session's private pages. The next Route of
the session (``on_route``) closes the pause: it scores the prefetch and feeds the
measured duration to the predictor.

Where to wait — the cheapest of the tiers that can be back in time (seconds of GPU time,
per pause; T = predicted pause, B = the session's bytes):

    HBM     B / hbm_bytes × T × (hbm_idle_price + hbm_occupancy)   memory others can't use
    DRAM    copy_weight × (demote_s + promote_s) + B / dram_bytes × T × dram_price
    NVMe    copy_weight × (demote_s + promote_s)
    a lower tier qualifies only when promote_s + margin < T (back in time) and
    promote_s < recompute_s (otherwise dropping would be cheaper than the round trip)

Transfer seconds come from configured/measured bandwidth; recompute seconds from the
model geometry (``CostModel``). Anti-thrash: a token bucket of bytes per (worker, lower
tier) shared by demotions and prefetches. A demotion needs tokens (and, once the bucket
ran dry, waits until it refilled to ``resume_fraction`` — hysteresis); a prefetch always
goes (a late session costs more than a busy link) and takes its bytes, possibly into debt.

Prefetch outcomes (``PrefetchStats``): on time (pages back in HBM before the next Route),
late (the Route came first), wasted (prefetched, then the session ended unused).
Pages evicted after an on-time prefetch are not tracked (the worker would have to report
them).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from kvtier.controller.predictor import Prediction, ToolReturnPredictor
from kvtier.controller.registry import Registry, WorkerEntry
from kvtier.controller.sessions import PrefetchState, SessionRecord, SessionStore
from kvtier.errors import KvtierError, NotFound
from kvtier.eviction import CostModel
from kvtier.hashing import NamespaceDigest
from kvtier.log import get_logger
from kvtier.records import (
    Command,
    CommandAck,
    DemoteCommand,
    DropCommand,
    EndRequest,
    PauseRequest,
    PredictionSource,
    PrefetchCommand,
    ReturningRequest,
    SessionId,
    SessionInfo,
    SessionState,
    TierOccupancy,
    WorkerId,
)
from kvtier.tiers import Tier

log = get_logger("kvtier.controller.orchestrator")

SendCommand = Callable[[WorkerId, Command], Awaitable[CommandAck]]


def wall_clock_ms() -> float:
    return time.time() * 1000.0


@dataclass(slots=True)
class OrchestratorParams:
    margin_ms: float = 100.0  # prefetch this much before the predicted return
    prefetch_at_low_quantile: bool = True  # schedule for the predictor's low quantile, not its median
    hbm_idle_price: float = 0.05  # worth of idle HBM (what holding costs at occupancy 0)
    dram_price: float = 0.005
    copy_weight: float = 0.1  # share of a copy's seconds that slows serving (copy engines overlap)
    bandwidth_bytes_per_s: dict[tuple[Tier, Tier], float] = field(
        default_factory=lambda: dict(CostModel().bandwidth_bytes_per_s)
    )
    cost_model: CostModel = field(default_factory=CostModel)  # page_size/page_bytes come from the worker
    budget_bytes_per_s: float = 2e9  # per (worker, lower tier)
    budget_burst_bytes: float = 4e9
    resume_fraction: float = 0.5
    command_timeout_s: float = 5.0
    tick_s: float = 0.01


# --------------------------------------------------------------------------- pieces


class TimerQueue:
    """Callbacks due at wall-clock times (ms), one per key; a new schedule replaces the
    key's old one. ``run`` fires due callbacks every ``tick_s``; tests call ``fire_due``
    with a clock of their own."""

    def __init__(self, clock_ms: Callable[[], float] = wall_clock_ms) -> None:
        self.clock_ms = clock_ms
        self._heap: list[tuple[float, int, str]] = []
        self._entries: dict[str, tuple[int, Callable[[], Awaitable[None]]]] = {}
        self._seq = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def schedule(self, key: str, at_ms: float, callback: Callable[[], Awaitable[None]]) -> None:
        seq = next(self._seq)
        self._entries[key] = (seq, callback)
        heapq.heappush(self._heap, (at_ms, seq, key))

    def cancel(self, key: str) -> bool:
        return self._entries.pop(key, None) is not None

    def is_scheduled(self, key: str) -> bool:
        return key in self._entries

    def pop_due(self, now_ms: float) -> list[Callable[[], Awaitable[None]]]:
        due = []
        while self._heap and self._heap[0][0] <= now_ms:
            _, seq, key = heapq.heappop(self._heap)
            entry = self._entries.get(key)
            if entry is not None and entry[0] == seq:  # not cancelled or replaced since
                del self._entries[key]
                due.append(entry[1])
        return due

    async def fire_due(self) -> int:
        callbacks = self.pop_due(self.clock_ms())
        for callback in callbacks:
            await callback()
        return len(callbacks)

    async def run(self, tick_s: float) -> None:
        while True:
            for callback in self.pop_due(self.clock_ms()):
                task = asyncio.create_task(callback())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(tick_s)


class TokenBucket:
    """Bytes per second with a burst; ``try_take`` for optional moves (with hysteresis),
    ``take`` for moves that must happen (may go into debt)."""

    def __init__(self, rate: float, burst: float, resume_fraction: float, clock_s: Callable[[], float]) -> None:
        self.rate, self.burst, self.resume_fraction = rate, burst, resume_fraction
        self._clock_s = clock_s
        self.level = burst
        self.is_throttled = False
        self._at = clock_s()

    def _refill(self) -> None:
        now = self._clock_s()
        self.level = min(self.burst, self.level + (now - self._at) * self.rate)
        self._at = now

    def try_take(self, num_bytes: float) -> bool:
        self._refill()
        if self.is_throttled and self.level < self.resume_fraction * self.burst:
            return False
        if self.level >= num_bytes:
            self.is_throttled = False
            self.level -= num_bytes
            return True
        self.is_throttled = True
        return False

    def take(self, num_bytes: float) -> None:
        self._refill()
        self.level -= num_bytes
        if self.level < 0:
            self.is_throttled = True


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
    occupancy: dict[Tier, TierOccupancy],
    params: OrchestratorParams,
    cost_model: CostModel,
) -> TierChoice:
    """Where a paused session's pages should wait (see the module doc for the costs)."""
    pause_s = pause_ms / 1000.0
    num_bytes = num_pages * page_bytes
    hbm = occupancy.get(Tier.HBM)
    hbm_bytes = max(1, (hbm.total_pages if hbm else num_pages) * page_bytes)
    hbm_busy = 1.0 - hbm.free_pages / hbm.total_pages if hbm and hbm.total_pages else 0.0
    costs = {Tier.HBM: num_bytes / hbm_bytes * pause_s * (params.hbm_idle_price + hbm_busy)}
    promote = {Tier.HBM: 0.0}
    recompute_s = cost_model.prefix_recompute_s(max(num_pages, 1))
    bandwidth = params.bandwidth_bytes_per_s
    for tier in (Tier.DRAM, Tier.NVME):
        occ = occupancy.get(tier)
        if occ is None or occ.total_pages == 0 or num_pages == 0:
            continue
        demote_s = num_bytes / bandwidth[(Tier.HBM, tier)]
        promote_s = num_bytes / bandwidth[(tier, Tier.HBM)]
        if promote_s * 1000.0 + params.margin_ms >= pause_ms or promote_s >= recompute_s:
            continue
        hold = num_bytes / (occ.total_pages * page_bytes) * pause_s * params.dram_price if tier is Tier.DRAM else 0.0
        costs[tier] = params.copy_weight * (demote_s + promote_s) + hold
        promote[tier] = promote_s
    best = min(costs, key=lambda t: (costs[t], t))
    return TierChoice(tier=best, costs_s=costs, promote_s=promote[best])


@dataclass(slots=True)
class PrefetchStats:
    num_demoted: int = 0
    demoted_bytes: int = 0
    num_kept_in_hbm: int = 0
    num_throttled: int = 0
    num_on_time: int = 0
    on_time_bytes: int = 0
    num_late: int = 0
    late_bytes: int = 0
    num_wasted: int = 0
    wasted_bytes: int = 0
    abs_error_ms_sum: float = 0.0
    num_errors: int = 0  # pauses whose prediction was scored

    @property
    def on_time_fraction(self) -> float:
        scored = self.num_on_time + self.num_late
        return self.num_on_time / scored if scored else 0.0

    @property
    def mean_abs_error_ms(self) -> float:
        return self.abs_error_ms_sum / self.num_errors if self.num_errors else 0.0


# --------------------------------------------------------------------------- orchestrator


class Orchestrator:
    """Drives session transitions and the tier moves they imply; one lock per session
    serialises Pause/Returning/End/Route/timer work on that session."""

    def __init__(
        self,
        store: SessionStore,
        predictor: ToolReturnPredictor,
        registry: Registry,
        send_command: Callable[[WorkerId, Command], Awaitable[CommandAck]],
        params: OrchestratorParams | None = None,
        *,
        clock_ms: Callable[[], float] = wall_clock_ms,
    ) -> None:
        self.store = store
        self.predictor = predictor
        self.registry = registry
        self._send_command = send_command
        self.params = params or OrchestratorParams()
        self.clock_ms = clock_ms
        self.timers = TimerQueue(clock_ms)
        self.stats = PrefetchStats()
        self._buckets: dict[tuple[WorkerId, Tier], TokenBucket] = {}
        self._locks: dict[SessionId, asyncio.Lock] = {}
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.timers.run(self.params.tick_s), name="kvtier-prefetch-timers")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def recover(self) -> int:
        """Reschedule the prefetches of parked sessions (after a restart or takeover)."""
        num = 0
        async for record in self.store.scan():
            if record.prefetch_state in (PrefetchState.SCHEDULED, PrefetchState.SENT) and record.prefetch_at_ms:
                self._schedule(record.session_id, record.prefetch_at_ms)
                num += 1
        return num

    def _lock(self, session: SessionId) -> asyncio.Lock:
        lock = self._locks.get(session)
        if lock is None:
            lock = self._locks[session] = asyncio.Lock()
        return lock

    async def _get(self, session: SessionId) -> SessionRecord:
        record = await self.store.get(session)
        if record is None:
            raise NotFound(f"no session {session!r}; a Route with its session_id starts one", field="session_id")
        return record

    def _now(self) -> int:
        return round(self.clock_ms())

    # ---- Route ---------------------------------------------------------------------------
    async def on_route(
        self, session: SessionId, *, tenant: str, worker: WorkerId | None, digest: NamespaceDigest,
        num_tokens: int,
    ) -> SessionInfo:
        """The session's next turn is being routed: it is ACTIVE again (a pause closes here)."""
        async with self._lock(session):
            now = self._now()
            record = await self.store.get(session)
            if record is None or record.state is SessionState.ENDED:
                record = SessionRecord(session_id=session, state=SessionState.ACTIVE)
            elif record.state in (SessionState.PAUSED, SessionState.RESUMING):
                await self._close_pause(record, now)
            record.state = SessionState.ACTIVE
            record.tenant, record.namespace_digest, record.num_cached_tokens = tenant, digest, num_tokens
            record.worker_id = worker or record.worker_id
            await self.store.put(record)
            return record.info()

    async def _close_pause(self, record: SessionRecord, now: int) -> None:
        self.timers.cancel(record.session_id)
        num_bytes = record.num_parked_pages * self._page_bytes(record.worker_id)
        if record.parked_tier not in (None, Tier.HBM) and record.num_parked_pages:
            done = record.prefetch_state == PrefetchState.DONE and (record.prefetch_done_at_ms or 0) <= now
            if done:
                self.stats.num_on_time += 1
                self.stats.on_time_bytes += num_bytes
            else:
                self.stats.num_late += 1
                self.stats.late_bytes += num_bytes
            log.info("session returned", extra={
                "session_id": record.session_id, "prefetch": "on_time" if done else "late",
                "num_pages": record.num_parked_pages})
        if record.predicted_return_at_ms is not None:
            self.stats.abs_error_ms_sum += abs(now - record.predicted_return_at_ms)
            self.stats.num_errors += 1
        if not record.is_duration_observed and record.paused_at_ms is not None:
            await self.predictor.observe(record.tenant, record.tool_name or "", now - record.paused_at_ms)
        record.clear_pause()

    # ---- Pause -----------------------------------------------------------------------------
    async def pause(self, request: PauseRequest) -> SessionInfo:
        async with self._lock(request.session_id):
            record = await self._get(request.session_id)
            if record.state is SessionState.PAUSED:
                return record.info()
            record.require(SessionState.ACTIVE, action="Pause")
            now = self._now()
            prediction = self.predictor.predict(record.tenant, request.tool_name, request.expected_ms)
            record.state = SessionState.PAUSED
            record.tool_name = request.tool_name
            record.paused_at_ms = now
            record.predicted_return_at_ms = now + round(prediction.return_in_ms)
            record.prediction_source = prediction.source
            record.parked_tier = Tier.HBM
            await self._park(record, prediction)
            await self.store.put(record)
            return record.info()

    async def _park(self, record: SessionRecord, prediction: Prediction) -> None:
        entry = self.registry.get(record.worker_id) if record.worker_id else None
        if entry is None or record.namespace_digest is None:
            self.stats.num_kept_in_hbm += 1
            return
        page_bytes = self._page_bytes(record.worker_id)
        page_size = entry.registration.page_size
        num_pages = max(1, record.num_cached_tokens // page_size)
        cost_model = replace(self.params.cost_model, page_size=page_size, page_bytes=page_bytes)
        choice = choose_tier(
            num_pages=num_pages, page_bytes=page_bytes, pause_ms=prediction.return_in_ms,
            occupancy={o.tier: o for o in entry.tiers}, params=self.params, cost_model=cost_model,
        )
        if choice.tier is Tier.HBM:
            self.stats.num_kept_in_hbm += 1
            return
        if not self._bucket(entry.worker_id, choice.tier).try_take(num_pages * page_bytes):
            self.stats.num_throttled += 1
            self.stats.num_kept_in_hbm += 1
            log.info("demotion throttled", extra={"session_id": record.session_id, "tier": choice.tier.label})
            return
        ack = await self._send(entry.worker_id, DemoteCommand(
            record.namespace_digest, (), choice.tier, session_id=record.session_id))
        if ack is None or not ack.ok or ack.num_pages == 0:
            self.stats.num_kept_in_hbm += 1
            return
        record.parked_tier = choice.tier
        record.num_parked_pages = ack.num_pages
        self.stats.num_demoted += 1
        self.stats.demoted_bytes += ack.num_pages * page_bytes
        promote_ms = choice.promote_s * 1000.0 * ack.num_pages / num_pages
        # Aim at the early end of the predicted spread (about the 10th percentile), not
        # the median: a prefetch that lands a little early costs HBM for a moment, one
        # that lands late costs the user a transfer on the token path.
        target_ms = prediction.quantile_lo_ms if self.params.prefetch_at_low_quantile else prediction.return_in_ms
        at_ms = record.paused_at_ms + min(target_ms, prediction.return_in_ms) - promote_ms - self.params.margin_ms
        record.prefetch_at_ms = round(at_ms)
        record.prefetch_state = PrefetchState.SCHEDULED
        self._schedule(record.session_id, record.prefetch_at_ms)
        log.info("session parked", extra={
            "session_id": record.session_id, "tier": choice.tier.label, "num_pages": ack.num_pages,
            "num_skipped": ack.num_skipped_pages, "prefetch_in_ms": round(at_ms - self._now())})

    # ---- Returning -------------------------------------------------------------------------
    async def returning(self, request: ReturningRequest) -> SessionInfo:
        async with self._lock(request.session_id):
            record = await self._get(request.session_id)
            record.require(SessionState.PAUSED, SessionState.RESUMING, action="Returning")
            now = self._now()
            eta_ms = request.eta_ms or 0
            if not record.is_duration_observed and record.paused_at_ms is not None:
                await self.predictor.observe(record.tenant, record.tool_name or "", now + eta_ms - record.paused_at_ms)
                record.is_duration_observed = True
            record.state = SessionState.RESUMING
            record.predicted_return_at_ms = now + eta_ms
            record.prediction_source = PredictionSource.CALLER_ETA
            if record.prefetch_state == PrefetchState.SCHEDULED:
                promote_ms = self._promote_ms(record)
                at_ms = now + eta_ms - promote_ms - self.params.margin_ms
                if at_ms <= now:
                    await self._prefetch_locked(record)
                else:
                    record.prefetch_at_ms = round(at_ms)
                    self._schedule(record.session_id, record.prefetch_at_ms)
            await self.store.put(record)
            return record.info()

    # ---- End ---------------------------------------------------------------------------------
    async def end(self, request: EndRequest) -> SessionInfo:
        async with self._lock(request.session_id):
            record = await self._get(request.session_id)
            if record.state is SessionState.ENDED:
                return record.info()
            self.timers.cancel(record.session_id)
            if record.prefetch_state == PrefetchState.DONE and record.state is not SessionState.ACTIVE:
                self.stats.num_wasted += 1
                self.stats.wasted_bytes += record.num_parked_pages * self._page_bytes(record.worker_id)
            if record.worker_id is not None and record.namespace_digest is not None:
                await self._send(record.worker_id, DropCommand(record.namespace_digest, (), record.session_id))
            record.clear_pause()
            record.state = SessionState.ENDED
            await self.store.put(record)
            self.registry.forget_session(record.session_id)
            self._locks.pop(record.session_id, None)
            return record.info()

    # ---- prefetch ------------------------------------------------------------------------------
    def _schedule(self, session: SessionId, at_ms: float) -> None:
        async def fire() -> None:
            try:
                async with self._lock(session):
                    record = await self.store.get(session)
                    if record is not None and record.prefetch_state == PrefetchState.SCHEDULED:
                        await self._prefetch_locked(record)
                        await self.store.put(record)
            except Exception as exc:  # a timer must not die silently
                log.error("scheduled prefetch failed", exc_info=exc, extra={"session_id": session})

        self.timers.schedule(session, at_ms, fire)

    async def _prefetch_locked(self, record: SessionRecord) -> None:
        """Promote the parked session's pages now (the caller holds its lock and saves it)."""
        self.timers.cancel(record.session_id)
        if record.worker_id is None or record.namespace_digest is None or record.parked_tier in (None, Tier.HBM):
            return
        num_bytes = record.num_parked_pages * self._page_bytes(record.worker_id)
        self._bucket(record.worker_id, record.parked_tier).take(num_bytes)
        record.prefetch_state = PrefetchState.SENT
        deadline_ms = None
        if record.predicted_return_at_ms is not None:
            deadline_ms = max(0, record.predicted_return_at_ms - self._now())
        ack = await self._send(record.worker_id, PrefetchCommand(
            record.namespace_digest, (), Tier.HBM, deadline_ms=deadline_ms, session_id=record.session_id))
        if ack is not None and ack.ok:
            record.prefetch_state = PrefetchState.DONE
            record.prefetch_done_at_ms = self._now()
            log.info("session prefetched", extra={
                "session_id": record.session_id, "num_pages": ack.num_pages, "num_skipped": ack.num_skipped_pages})
        else:
            record.prefetch_state = PrefetchState.NONE  # the worker promotes on hit instead

    # ---- helpers -------------------------------------------------------------------------------
    async def _send(self, worker: WorkerId, command: Command) -> CommandAck | None:
        try:
            ack = await asyncio.wait_for(self._send_command(worker, command), self.params.command_timeout_s)
        except (KvtierError, TimeoutError) as exc:
            log.warning("tier command not carried out", extra={
                "worker_id": worker, "command": type(command).__name__, "reason": str(exc)})
            return None
        if not ack.ok:
            log.warning("tier command refused", extra={
                "worker_id": worker, "command": type(command).__name__, "error_code": ack.error_code})
        return ack

    def _bucket(self, worker: WorkerId, tier: Tier) -> TokenBucket:
        bucket = self._buckets.get((worker, tier))
        if bucket is None:
            p = self.params
            bucket = self._buckets[(worker, tier)] = TokenBucket(
                p.budget_bytes_per_s, p.budget_burst_bytes, p.resume_fraction, lambda: self.clock_ms() / 1000.0)
        return bucket

    def _entry(self, worker: WorkerId | None) -> WorkerEntry | None:
        return self.registry.get(worker) if worker else None

    def _page_bytes(self, worker: WorkerId | None) -> int:
        entry = self._entry(worker)
        if entry is None:
            return 0
        for capacity in entry.registration.capacities:
            if capacity.tier is Tier.HBM and capacity.capacity_pages:
                return capacity.capacity_bytes // capacity.capacity_pages
        return 0

    def _promote_ms(self, record: SessionRecord) -> float:
        if record.parked_tier in (None, Tier.HBM):
            return 0.0
        rate = self.params.bandwidth_bytes_per_s[(record.parked_tier, Tier.HBM)]
        return record.num_parked_pages * self._page_bytes(record.worker_id) / rate * 1000.0
