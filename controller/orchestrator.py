"""Tool-call-aware tiering: park a paused session's pages, bring them back in time (DESIGN §5.8).

On Pause the orchestrator predicts the return (``ToolReturnPredictor``), picks where the
session's pages wait, sends ``Demote`` (by session id: only the worker knows the pages
of the last turn's output), and schedules ``Prefetch`` into HBM at

    prefetch_at = paused_at + predicted_return_low_quantile − promote_time − margin

on a timer queue. ``promote_time`` is bytes over bandwidth plus the worker's measured
overhead (a high quantile of recent Prefetch ack latencies beyond the copy: the wait for the
engine step in progress and the round trip; ``controller/prefetch.py``); the low quantile is
the predictor's ``lo_quantile`` (5 %) until the tenant has parked sessions of two tools with
a history, then each tool's share of the same expected lateness, spent by equal hazard (long
tools aim later, short ones earlier; ``controller/lateness.py``). The Prefetch's
``deadline_ms`` asks the worker to hold the pages in HBM until the prediction's high quantile
(99 %, at most ``max_hold_ms``): a prefetch lands early by design, and unheld pages are the
first an eviction takes meanwhile. A prefetch that left pages below (a page of the chain in
another move, or no room at that moment) is topped up ``topup_delay_ms`` later, then at
delays growing ``topup_backoff``-fold, up to ``max_topups`` times, while the session is away
and its hold would last. A session kept in HBM gets a *guard*
prefetch at once: it moves nothing, brings back what the worker's own demotion moved down
meanwhile and holds the pages until the return. Why all of these:
``docs/decisions/0008-prefetch-timing.md``.

``Returning`` pulls the prefetch forward (now, or ``eta − promote − margin``); ``End``
cancels it and drops the session's private pages. The next Route of
the session (``on_route``) closes the pause: it scores the prefetch and feeds the
measured duration to the predictor. The Route does not wait for that (``route_seen`` runs it
in the background, as of the Route's time); the session's next Pause, Returning, End or
prefetch waits for it instead.

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
    any allocation takes them at no copy, decision 0012 revision 2)

Transfer seconds come from configured/measured bandwidth; recompute seconds from the
model geometry (``CostModel``). Anti-thrash: a token bucket of bytes per (worker, lower
tier) shared by demotions and prefetches. A demotion needs tokens (and, once the bucket
ran dry, waits until it refilled to ``resume_fraction`` — hysteresis); a prefetch always
goes (a late session costs more than a busy link) and takes its bytes, possibly into debt.
Rates per tier come from the policy in force (``apply_policy``); a tier without one is
unlimited.

Prefetch outcomes (``controller/prefetch.py``): on time (pages back in HBM before the next
Route) or late (the Route came first); wasted bytes apart: prefetched, then the session ended
unused, or its next Route found them below HBM again or gone (read from the directory's
match, once the worker's page events had time to arrive: ``directory_lag_ms``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

from kvtier.cache.eviction import CostModel
from kvtier.controller.lateness import LatenessBudget, LatenessParams
from kvtier.controller.predictor import Prediction, ToolReturnPredictor
from kvtier.controller.prefetch import MoveReason, Outcome, PauseOutcome, PrefetchStats, PromoteLatency
from kvtier.controller.registry import Registry, WorkerEntry
from kvtier.controller.sessions import PrefetchState, SessionRecord, SessionStore
from kvtier.domain.errors import KvtierError, NotFound
from kvtier.domain.hashing import NamespaceDigest
from kvtier.domain.records import (
    Command,
    CommandAck,
    DemoteCommand,
    DropCommand,
    EndRequest,
    PauseRequest,
    Policy,
    PredictionSource,
    PrefetchCommand,
    ReturningRequest,
    SessionId,
    SessionInfo,
    SessionState,
    TierOccupancy,
    TokensByTier,
    Watermarks,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.rpc.auth import Principal
from kvtier.runtime.config import DEFAULT_SESSION_HOLD_MAX_S
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.orchestrator")

SendCommand = Callable[[WorkerId, Command], Awaitable[CommandAck]]
# How often the orchestrator forgets sessions idle past the store's TTL (``forget_idle``).
FORGET_INTERVAL_S = 60.0


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
    # A prefetch that left pages below (a page of the chain in the middle of another move, or no
    # room in HBM at that moment) is topped up this much later, each next top-up
    # ``topup_backoff`` times later than the one before, at most ``max_topups`` times and never
    # after the hold would end (``_schedule_topup``).
    topup_delay_ms: float = 100.0
    topup_backoff: float = 2.0
    max_topups: int = 8
    num_outcomes_kept: int = 10_000  # recent PauseOutcomes (benchmarks read them)
    # Which quantile of each tool's predicted return its prefetches aim at: the predictor's
    # lo_quantile spent by equal hazard across the tenant's tools (``controller/lateness.py``).
    lateness: LatenessParams = field(default_factory=LatenessParams)


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
    earliest_return_ms: float | None = None,
    overhead_ms: float = 0.0,
) -> TierChoice:
    """Where a paused session's pages should wait (see the module doc for the costs).

    ``pause_ms``: the expected pause; ``earliest_return_ms``: the early end the prefetch aims
    at (default ``pause_ms``); ``overhead_ms``: the worker's measured prefetch overhead."""
    pause_s = pause_ms / 1000.0
    earliest_ms = pause_ms if earliest_return_ms is None else min(earliest_return_ms, pause_ms)
    num_bytes = num_pages * page_bytes
    hbm = occupancy.get(Tier.HBM)
    hbm_bytes = max(1, (hbm.total_pages if hbm else num_pages) * page_bytes)
    # Pages with an intact copy below are as good as free: any allocation takes them at no copy.
    hbm_free = hbm.free_pages + hbm.reclaimable_pages if hbm else 0
    hbm_busy = 1.0 - hbm_free / hbm.total_pages if hbm and hbm.total_pages else 0.0
    costs = {Tier.HBM: num_bytes / hbm_bytes * pause_s * (params.hbm_idle_price + hbm_busy)}
    promote = {Tier.HBM: 0.0}
    recompute_s = cost_model.prefix_recompute_s(max(num_pages, 1))
    bandwidth = params.bandwidth_bytes_per_s
    for tier in (Tier.DRAM, Tier.NVME):
        occ = occupancy.get(tier)
        if occ is None or occ.total_pages == 0 or num_pages == 0:
            continue
        marks = params.watermarks.get(tier)
        if marks is not None and (occ.cached_pages + occ.in_use_pages + num_pages) / occ.total_pages > marks.high:
            continue  # above its high watermark the worker is busy demoting out of it
        demote_s = num_bytes / bandwidth[(Tier.HBM, tier)]
        promote_s = num_bytes / bandwidth[(tier, Tier.HBM)]
        round_trip_ms = (demote_s + promote_s) * 1000.0 + overhead_ms + params.margin_ms
        if round_trip_ms >= earliest_ms or promote_s >= recompute_s:
            continue
        hold = num_bytes / (occ.total_pages * page_bytes) * pause_s * params.dram_price if tier is Tier.DRAM else 0.0
        costs[tier] = params.copy_weight * (demote_s + promote_s) + hold
        promote[tier] = promote_s
    best = min(costs, key=lambda t: (costs[t], t))
    return TierChoice(tier=best, costs_s=costs, promote_s=promote[best])


@dataclass(frozen=True, slots=True)
class _HoldPlan:
    """How a paused session's prefetched pages are to be held in HBM: until ``until_ms`` (clock
    ms; the prediction's high quantile, or the caller's ETA), and the spread of the predicted
    return (sigma of ln duration; None after a caller's ETA), which ranks the hold once the
    session is overdue."""

    until_ms: float
    spread: float | None = None


@dataclass(frozen=True, slots=True)
class _SentPrefetch:
    """A Prefetch on its way: what its ack is counted against."""

    worker: WorkerId
    command: PrefetchCommand
    reason: str
    source: Tier
    page_bytes: int
    sent_at_ms: float
    paused_at_ms: int | None  # identifies the pause it serves
    attempt: int = 0  # 0: the pause's prefetch; k > 0: its k-th top-up


# --------------------------------------------------------------------------- orchestrator


@dataclass(slots=True)
class _SessionLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holding or waiting


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
        self.lateness = LatenessBudget(
            self.params.lateness, lambda tenant, tool: predictor.model(tenant, tool, self.params.lateness.min_samples))
        self.outcomes: collections.deque[PauseOutcome] = collections.deque(maxlen=self.params.num_outcomes_kept)
        self.listeners: list[Callable[[PauseOutcome], None]] = []  # called as each pause closes
        self._buckets: dict[tuple[WorkerId, Tier], TokenBucket] = {}
        self._latency: dict[WorkerId, PromoteLatency] = {}
        # One lock per session in use (``_locked``): gone once no one holds or waits for it.
        self._locks: dict[SessionId, _SessionLock] = {}
        # State and last write (clock ms) per session, for counts without a Redis scan; a
        # session untouched for the store's TTL has expired there and is not counted.
        self._states: dict[SessionId, tuple[SessionState, float]] = {}
        # How a prefetch of a paused session should hold its pages in HBM (until the
        # prediction's high quantile). In memory only: after a restart the median is used.
        self._holds: dict[SessionId, _HoldPlan] = {}
        # Pages a session's last prefetch left below HBM (moving, or no room): not its waste.
        self._skipped_pages: dict[SessionId, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._forget_task: asyncio.Task[None] | None = None
        # Route bookkeeping running in the background (``route_seen``), the latest per session.
        self._route_tasks: dict[SessionId, asyncio.Task[None]] = {}

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.timers.run(self.params.tick_s), name="kvtier-prefetch-timers")
        if self._forget_task is None:
            self._forget_task = asyncio.create_task(self._forget_loop(), name="kvtier-session-forget")

    async def stop(self) -> None:
        for task in (self._task, self._forget_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._forget_task = None
        await self.settled()

    async def _forget_loop(self) -> None:
        while True:
            await asyncio.sleep(FORGET_INTERVAL_S)
            self.forget_idle()

    def forget_idle(self) -> int:
        """Forget what this controller keeps in memory about sessions untouched for the store's
        TTL (their records have expired in Redis): sessions nobody ends, or abandoned while
        paused. Without this a controller's memory grows with every such session. Returns how
        many were forgotten."""
        horizon_ms = self.clock_ms() - self.store.ttl_s * 1000.0
        idle = [s for s, (_, at) in self._states.items() if at < horizon_ms]
        for session in idle:
            del self._states[session]
            self._holds.pop(session, None)
            self._skipped_pages.pop(session, None)
        return len(idle)

    async def settled(self) -> None:
        """Wait for the Route bookkeeping still running in the background (``route_seen``)."""
        while self._route_tasks:
            await asyncio.wait(set(self._route_tasks.values()))

    async def recover(self) -> int:
        """Reschedule the prefetches of parked sessions (after a restart or takeover)."""
        num = 0
        async for record in self.store.scan():
            self._states[record.session_id] = (record.state, self.clock_ms())
            if record.prefetch_state in (PrefetchState.SCHEDULED, PrefetchState.SENT) and record.prefetch_at_ms:
                self._schedule(record.session_id, record.prefetch_at_ms)
                num += 1
        return num

    def apply_policy(self, policy: Policy) -> None:
        """Budgets and watermarks of ``policy`` from now on (``controller/policy_store.py``).
        Buckets restart full at the new rates."""
        self.params = replace(self.params, budget_bytes_per_s=dict(policy.budget_bytes_per_s),
                              watermarks=dict(policy.watermarks))
        self._buckets.clear()

    @contextlib.asynccontextmanager
    async def _locked(self, session: SessionId) -> AsyncIterator[None]:
        """Hold ``session``'s lock: Route, Pause, Returning, End and timer work on a session go
        one at a time. The lock exists while someone holds or waits for it, so sessions that
        are never ended leave no lock behind."""
        entry = self._locks.get(session)
        if entry is None:
            entry = self._locks[session] = _SessionLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if not entry.users:
                del self._locks[session]

    async def _get(self, session: SessionId, caller: Principal | None = None) -> SessionRecord:
        """The session's record; NOT_FOUND when there is none or it belongs to a tenant the
        caller may not act for (the same answer, so ids of other tenants' sessions leak nothing)."""
        record = await self.store.get(session)
        if record is None or (caller is not None and record.tenant and not caller.may_act_for(record.tenant)):
            raise NotFound(f"no session {session!r}; a Route or Pause naming it starts one", field="session_id")
        return record

    def _now(self) -> int:
        return round(self.clock_ms())

    async def _save(self, record: SessionRecord) -> None:
        await self.store.put(record)
        self._states[record.session_id] = (record.state, self.clock_ms())

    def session_counts(self) -> dict[SessionState, int]:
        """Sessions per state, as this controller last wrote them (ENDED ones are forgotten)."""
        self.forget_idle()
        counts = dict.fromkeys(SessionState, 0)
        for state, _ in self._states.values():
            counts[state] += 1
        return counts

    def _record_outcome(self, outcome: PauseOutcome) -> None:
        self.stats.count_outcome(outcome)
        self.outcomes.append(outcome)
        for listener in self.listeners:
            try:
                listener(outcome)
            except Exception as exc:  # metrics must never break a session transition
                log.warning("pause outcome listener failed", extra={"reason": str(exc)})

    # ---- Route ---------------------------------------------------------------------------
    def route_seen(
        self, session: SessionId, *, tenant: str, worker: WorkerId | None, digest: NamespaceDigest,
        num_tokens: int, matched: TokensByTier | None = None,
    ) -> None:
        """The Router's hook (``Router.on_session_route``): ``on_route`` in the background, as
        of now. A Route does not wait for the session's bookkeeping (Redis round trips: ~0.5 ms
        of a resume's time to first token in the agent workload, and however long a slow Redis
        takes); the session's next Pause, Returning, End or prefetch waits for it instead
        (``_after_route``), so each still sees the turn."""
        bookkeeping = self.on_route(session, tenant=tenant, worker=worker, digest=digest, num_tokens=num_tokens,
                                    matched=matched, now_ms=self._now())
        task = asyncio.create_task(self._logged(session, bookkeeping), name="kvtier-session-route")
        self._route_tasks[session] = task
        task.add_done_callback(functools.partial(self._route_task_done, session))

    def _route_task_done(self, session: SessionId, task: asyncio.Task[None]) -> None:
        if self._route_tasks.get(session) is task:
            del self._route_tasks[session]

    @staticmethod
    async def _logged(session: SessionId, bookkeeping: Awaitable[object]) -> None:
        try:
            await bookkeeping
        except Exception as exc:  # session bookkeeping must never fail a Route
            log.warning("session bookkeeping on Route failed", extra={"session_id": session, "reason": str(exc)})

    async def _after_route(self, session: SessionId) -> None:
        """Wait for the session's Route bookkeeping, if some is still running."""
        task = self._route_tasks.get(session)
        if task is not None:
            await asyncio.wait({task})

    async def on_route(
        self, session: SessionId, *, tenant: str, worker: WorkerId | None, digest: NamespaceDigest,
        num_tokens: int, matched: TokensByTier | None = None, now_ms: int | None = None,
    ) -> SessionInfo:
        """The session's next turn is being routed: it is ACTIVE again (a pause closes here).

        ``matched``: where the directory has the request's prefix on ``worker`` (None when
        unknown, e.g. a degraded Route); it tells whether prefetched pages were still in HBM.
        ``now_ms``: when the Route came (default: now), which a prefetch's ack must precede to
        be on time."""
        async with self._locked(session):
            now = self._now() if now_ms is None else now_ms
            record = await self.store.get(session)
            if record is not None and record.state is not SessionState.ENDED and record.tenant != tenant:
                # Another tenant's live session under the same id: its record is not ours to
                # change (the Route itself still answers; only the bookkeeping is skipped).
                log.warning("Route names a session of another tenant; session left as it is",
                            extra={"session_id": session})
                return record.info()
            if record is None or record.state is SessionState.ENDED:
                record = SessionRecord(session_id=session, state=SessionState.ACTIVE)
            elif record.state in (SessionState.PAUSED, SessionState.RESUMING):
                await self._close_pause(record, now, matched if worker == record.worker_id else None)
            record.state = SessionState.ACTIVE
            record.tenant, record.namespace_digest, record.num_cached_tokens = tenant, digest, num_tokens
            record.worker_id = worker or record.worker_id
            await self._save(record)
            return record.info()

    async def _close_pause(self, record: SessionRecord, now: int, matched: TokensByTier | None) -> None:
        self.timers.cancel(record.session_id)
        self._holds.pop(record.session_id, None)
        skipped = self._skipped_pages.pop(record.session_id, 0)
        page_bytes = self._page_bytes(record.worker_id)
        num_pages = record.num_parked_pages
        outcome, wasted_bytes, lead_ms = Outcome.KEPT, 0, None
        done = record.prefetch_state == PrefetchState.DONE and (record.prefetch_done_at_ms or 0) <= now
        if record.parked_tier not in (None, Tier.HBM) and record.num_parked_pages:
            outcome = Outcome.ON_TIME if done else Outcome.LATE
        elif record.parked_tier not in (None, Tier.HBM) and done and skipped:
            # Parked, and the prefetch was acknowledged having brought none of the pages back
            # (each in another move, or no room; its top-ups none either): the turn promotes
            # them on the request path, as after a late prefetch.
            outcome, num_pages = Outcome.LATE, skipped
        num_bytes = num_pages * page_bytes
        if done and record.num_parked_pages:  # parked and prefetched, or a guard that moved pages
            lead_ms = float(now - (record.prefetch_done_at_ms or now))
            wasted_bytes = self._evicted_since_prefetch(record, now, matched, skipped) * page_bytes
            self.stats.count_waste("evicted", wasted_bytes)
        if outcome != Outcome.KEPT or lead_ms is not None:
            log.info("session returned", extra={
                "session_id": record.session_id, "prefetch": outcome, "num_pages": num_pages,
                "lead_ms": lead_ms, "wasted_bytes": wasted_bytes})
        actual_ms = float(now - record.paused_at_ms) if record.paused_at_ms is not None else None
        predicted_ms = None
        if record.predicted_return_at_ms is not None and record.paused_at_ms is not None:
            predicted_ms = float(record.predicted_return_at_ms - record.paused_at_ms)
        self._record_outcome(PauseOutcome(
            record.session_id, record.tool_name or "", record.parked_tier or Tier.HBM, num_pages,
            num_bytes, outcome, wasted_bytes, predicted_ms, actual_ms, record.prediction_source, lead_ms))
        if not record.is_duration_observed and actual_ms is not None:
            await self.predictor.observe(record.tenant, record.tool_name or "", actual_ms)
        record.clear_pause()

    def _evicted_since_prefetch(
        self, record: SessionRecord, now: int, matched: TokensByTier | None, skipped: int
    ) -> int:
        """Prefetched pages of ``record`` the directory no longer has in HBM on its worker: below
        HBM again (beyond the ``skipped`` ones the prefetch left there), or gone (the prefix it
        matches is shorter than the previous turn's). 0 when the directory cannot tell yet (no
        match given, or the prefetch is too recent)."""
        entry = self._entry(record.worker_id)
        done_at = record.prefetch_done_at_ms
        if matched is None or entry is None or done_at is None or now - done_at < self.params.directory_lag_ms:
            return 0
        page_size = entry.registration.page_size
        below = max(0, (matched.dram_tokens + matched.nvme_tokens) // page_size - skipped)
        missing = max(0, record.num_cached_tokens // page_size - matched.total_tokens // page_size)
        return min(record.num_parked_pages, below + missing)

    # ---- Pause -----------------------------------------------------------------------------
    async def pause(self, request: PauseRequest, *, caller: Principal | None = None) -> SessionInfo:
        await self._after_route(request.session_id)
        async with self._locked(request.session_id):
            record = await self.store.get(request.session_id)
            if record is None:  # a Pause starts the session (sessions.proto): no worker, nothing to park
                record = SessionRecord(session_id=request.session_id, state=SessionState.ACTIVE,
                                       tenant=_own_tenant(caller, request.session_id))
            else:
                record = await self._get(request.session_id, caller)
            if record.state is SessionState.PAUSED:
                return record.info()
            record.require(SessionState.ACTIVE, action="Pause")
            now = self._now()
            prediction = self.predictor.predict(record.tenant, request.tool_name, request.expected_ms,
                                                aim=self.lateness.aim(record.tenant, request.tool_name or ""))
            record.state = SessionState.PAUSED
            record.tool_name = request.tool_name
            record.paused_at_ms = now
            record.predicted_return_at_ms = now + round(prediction.return_in_ms)
            record.prediction_source = prediction.source
            self._holds[record.session_id] = _HoldPlan(now + max(prediction.quantile_hi_ms, prediction.return_in_ms),
                                                       self.predictor.spread(prediction))
            record.parked_tier = Tier.HBM
            await self._park(record, prediction)
            await self._save(record)
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
        overhead_ms = self._latency_of(entry.worker_id).overhead_ms()
        choice = choose_tier(
            num_pages=num_pages, page_bytes=page_bytes, pause_ms=prediction.return_in_ms,
            occupancy={o.tier: o for o in entry.tiers}, params=self.params, cost_model=cost_model,
            earliest_return_ms=self._target_ms(prediction), overhead_ms=overhead_ms,
        )
        if choice.tier is Tier.HBM or not await self._demote(record, entry.worker_id, choice.tier, num_pages):
            self.stats.num_kept_in_hbm += 1
            self._guard(record)
            return
        record.parked_tier = choice.tier
        self.lateness.note_park(record.tenant, record.tool_name or "")
        # Aim at the early end of the predicted spread (the predictor's lo_quantile, 5 %, or
        # the tool's share of the tenant's lateness: controller/lateness.py), not the median:
        # a prefetch that lands a little early costs HBM for a moment, one that lands late costs
        # the user a transfer on the token path (decision 0008).
        at_ms = record.paused_at_ms + self._target_ms(prediction) - self._promote_ms(record) - self.params.margin_ms
        record.prefetch_at_ms = round(at_ms)
        record.prefetch_state = PrefetchState.SCHEDULED
        self._schedule(record.session_id, record.prefetch_at_ms)
        log.info("session parked", extra={
            "session_id": record.session_id, "tier": choice.tier.label, "num_pages": record.num_parked_pages,
            "prefetch_in_ms": round(at_ms - self._now())})

    async def _demote(self, record: SessionRecord, worker: WorkerId, tier: Tier, num_pages: int) -> bool:
        """Send the park's Demote within the anti-thrash budget; True when pages moved (counted)."""
        assert record.namespace_digest is not None
        page_bytes = self._page_bytes(worker)
        bucket = self._bucket(worker, tier)
        if bucket is not None and not bucket.try_take(num_pages * page_bytes):
            self.stats.num_throttled += 1
            log.info("demotion throttled", extra={"session_id": record.session_id, "tier": tier.label})
            return False
        ack = await self._send(worker, DemoteCommand(record.namespace_digest, (), tier, session_id=record.session_id))
        if ack is None or not ack.ok or ack.num_pages == 0:
            return False
        record.num_parked_pages = ack.num_pages
        self.stats.num_demoted += 1
        self.stats.demoted_bytes += ack.num_pages * page_bytes
        self.stats.count_move(MoveReason.PARK, Tier.HBM.label, tier.label, ack.num_pages, ack.num_pages * page_bytes)
        return True

    def _guard(self, record: SessionRecord) -> None:
        """A guard prefetch for a session kept in HBM, at once (from the timer task: Pause
        does not wait for its ack).

        Kept is not staying: under pressure the worker's own watermark demotion moves idle
        pages down during the pause, and the next turn pays their promotion (what a reactive
        policy pays). Kept has to mean held: the guard's Prefetch moves nothing (the pages
        are in HBM) and holds them until the predicted return's high quantile, like a
        prefetched session's; whatever already left comes back."""
        if self._lower_tier(record.worker_id) is None:
            return
        record.prefetch_at_ms = self._now()
        record.prefetch_state = PrefetchState.SCHEDULED
        self._schedule(record.session_id, record.prefetch_at_ms)

    # ---- Returning -------------------------------------------------------------------------
    async def returning(self, request: ReturningRequest, *, caller: Principal | None = None) -> SessionInfo:
        await self._after_route(request.session_id)
        async with self._locked(request.session_id):
            record = await self._get(request.session_id, caller)
            record.require(SessionState.PAUSED, SessionState.RESUMING, action="Returning")
            now = self._now()
            eta_ms = request.eta_ms or 0
            if not record.is_duration_observed and record.paused_at_ms is not None:
                await self.predictor.observe(record.tenant, record.tool_name or "", now + eta_ms - record.paused_at_ms)
                record.is_duration_observed = True
            record.state = SessionState.RESUMING
            record.predicted_return_at_ms = now + eta_ms
            record.prediction_source = PredictionSource.CALLER_ETA
            self._holds[record.session_id] = _HoldPlan(now + eta_ms + self.params.margin_ms)
            if record.prefetch_state == PrefetchState.SCHEDULED:
                promote_ms = self._promote_ms(record)
                at_ms = now + eta_ms - promote_ms - self.params.margin_ms
                if at_ms <= now:
                    await self._prefetch_locked(record, MoveReason.RETURNING)
                else:
                    record.prefetch_at_ms = round(at_ms)
                    self._schedule(record.session_id, record.prefetch_at_ms)
            await self._save(record)
            return record.info()

    # ---- End ---------------------------------------------------------------------------------
    async def end(self, request: EndRequest, *, caller: Principal | None = None) -> SessionInfo:
        await self._after_route(request.session_id)
        async with self._locked(request.session_id):
            record = await self._get(request.session_id, caller)
            if record.state is SessionState.ENDED:
                return record.info()
            self.timers.cancel(record.session_id)
            self._holds.pop(record.session_id, None)
            self._skipped_pages.pop(record.session_id, None)
            page_bytes = self._page_bytes(record.worker_id)
            if record.prefetch_state == PrefetchState.DONE and record.state is not SessionState.ACTIVE:
                self.stats.count_waste("ended", record.num_parked_pages * page_bytes)
            if record.worker_id is not None and record.namespace_digest is not None:
                # Without ``drop`` the worker forgets the session and its hold; the pages stay as
                # ordinary cache entries (sessions.proto, End).
                ack = await self._send(record.worker_id, DropCommand(
                    record.namespace_digest, (), record.session_id, keep_pages=not request.drop))
                if ack is not None and ack.num_pages:
                    self.stats.count_move(MoveReason.END, "any", "none", ack.num_pages, ack.num_pages * page_bytes)
            record.clear_pause()
            record.state = SessionState.ENDED
            await self.store.put(record)
            self._states.pop(record.session_id, None)
            self.registry.forget_session(record.session_id)
            return record.info()

    # ---- prefetch ------------------------------------------------------------------------------
    def _schedule(self, session: SessionId, at_ms: float) -> None:
        async def fire() -> None:
            await self._run_prefetch(
                session, attempt=0,
                may_start=lambda r: r.prefetch_state == PrefetchState.SCHEDULED,
                may_finish=lambda r: r.prefetch_state == PrefetchState.SENT,
            )

        self.timers.schedule(session, at_ms, fire)

    def _schedule_topup(self, session: SessionId, attempt: int) -> None:
        """Bring up, later, what the pause's prefetch left below. The pause stays scored by its
        first prefetch (on time: its ack came before the Route); the top-up adds its pages to
        those the Route judges, and a Route or End meanwhile cancels it (same timer key).

        The ``attempt``-th top-up waits ``topup_delay_ms × topup_backoff^(attempt − 1)``: the
        first ones catch a page that was in another move; the later ones, spread over the pause,
        catch the room that a prefetch ranked behind every hold in HBM could not take (it comes
        back as turns finish and sessions due sooner return; decision 0008, revision 22). None
        is scheduled past the hold's end (``_holds``): the pages would be unheld, the first an
        eviction takes."""
        at_ms = self.clock_ms() + self.params.topup_delay_ms * self.params.topup_backoff ** (attempt - 1)
        plan = self._holds.get(session)
        if plan is not None and at_ms > plan.until_ms:
            return

        async def fire() -> None:
            await self._run_prefetch(session, attempt=attempt, may_start=self._is_topping_up,
                                     may_finish=self._is_topping_up)

        self.timers.schedule(session, at_ms, fire)

    async def _run_prefetch(
        self, session: SessionId, *, attempt: int,
        may_start: Callable[[SessionRecord], bool], may_finish: Callable[[SessionRecord], bool],
    ) -> None:
        """A timer's prefetch (``attempt`` 0) or top-up, if the session is still where ``may_start``
        expects; the ack applies to it only if it is still that pause and ``may_finish`` holds.

        The session's lock is held to start and to finish the prefetch, not while the worker
        carries it out: a Route meanwhile must not wait for the ack (its TTFT would pay the
        transfer, and the prefetch would be scored on time). It closes the pause as late; the
        ack then finds the pause gone and only its traffic is counted."""
        try:
            await self._after_route(session)
            async with self._locked(session):
                record = await self.store.get(session)
                if record is None or not may_start(record):
                    return
                sent = self._prefetch_begin(record, MoveReason.PREFETCH, attempt=attempt)
                await self._save(record)
            if sent is None:
                return
            ack = await self._send(sent.worker, sent.command)
            async with self._locked(session):
                record = await self.store.get(session)
                if record is not None and may_finish(record) and record.paused_at_ms == sent.paused_at_ms:
                    self._prefetch_end(sent, ack, record)
                    await self._save(record)
                else:
                    self._prefetch_end(sent, ack, None)
        except Exception as exc:  # a timer must not die silently
            log.error("scheduled prefetch failed", exc_info=exc, extra={"session_id": session, "attempt": attempt})

    @staticmethod
    def _is_topping_up(record: SessionRecord) -> bool:
        return (record.state in (SessionState.PAUSED, SessionState.RESUMING)
                and record.prefetch_state == PrefetchState.DONE)

    async def _prefetch_locked(self, record: SessionRecord, reason: str) -> None:
        """Promote the parked session's pages now and wait for the ack (Returning: its caller
        asked for the pages now). The caller holds the session's lock and saves the record."""
        sent = self._prefetch_begin(record, reason)
        if sent is not None:
            self._prefetch_end(sent, await self._send(sent.worker, sent.command), record)

    def _prefetch_begin(self, record: SessionRecord, reason: str, *, attempt: int = 0) -> _SentPrefetch | None:
        """Mark ``record``'s prefetch SENT and build its command (None: nothing to prefetch); a
        top-up (``attempt`` > 0) leaves the state DONE."""
        self.timers.cancel(record.session_id)
        source = self._source_tier(record)
        if record.worker_id is None or record.namespace_digest is None or source is None:
            return None
        entry = self.registry.get(record.worker_id)
        if entry is not None and entry.is_draining:
            # Route sends the session's next turn elsewhere, and the worker takes no prefetch
            # while draining: nothing to bring back (the turn's new worker computes or reuses).
            if attempt == 0:
                record.prefetch_state = PrefetchState.NONE
            log.info("prefetch skipped: the worker is draining", extra={
                "session_id": record.session_id, "worker_id": record.worker_id})
            return None
        if record.parked_tier is Tier.HBM and reason == MoveReason.PREFETCH:
            reason = MoveReason.GUARD
        page_bytes = self._page_bytes(record.worker_id)
        bucket = self._bucket(record.worker_id, source)
        if bucket is not None:  # a top-up moves at most what the last ack left below
            num_pages = self._skipped_pages.get(record.session_id, 0) if attempt else record.num_parked_pages
            bucket.take(num_pages * page_bytes)
        if attempt == 0:
            record.prefetch_state = PrefetchState.SENT
        # The deadline tells the worker how long to hold the pages in HBM (until the session is
        # expected back at the latest: see _holds); without it an eviction in the
        # meantime takes them first, and the prefetch is wasted.
        # When it is expected back (the prediction's median) ranks the hold against others on
        # the worker: the session due back last yields first when room is needed. How long it
        # has been away and the prediction's spread keep that rank true once it is overdue.
        now = self._now()
        plan = self._holds.get(record.session_id)
        hold_until = plan.until_ms if plan is not None else record.predicted_return_at_ms
        deadline_ms = return_in_ms = away_ms = spread = None
        if hold_until is not None:
            deadline_ms = round(min(max(0.0, hold_until - now), self.params.max_hold_ms))
        if record.predicted_return_at_ms is not None:
            return_in_ms = round(max(0.0, record.predicted_return_at_ms - now))
            if deadline_ms is not None and return_in_ms > deadline_ms:  # back after the hold ends:
                return_in_ms = deadline_ms  # the hold's end ranks it
            elif plan is not None and plan.spread is not None and record.paused_at_ms is not None:
                away_ms, spread = max(0, now - record.paused_at_ms), plan.spread
        command = PrefetchCommand(record.namespace_digest, (), Tier.HBM, deadline_ms=deadline_ms,
                                  session_id=record.session_id, return_in_ms=return_in_ms, away_ms=away_ms,
                                  return_spread=spread)
        return _SentPrefetch(record.worker_id, command, reason, source, page_bytes, self.clock_ms(),
                             record.paused_at_ms, attempt)

    def _prefetch_end(self, sent: _SentPrefetch, ack: CommandAck | None, record: SessionRecord | None) -> None:
        """Count a prefetch's ack; with ``record`` (still the same pause) mark it DONE or not.

        On the ack, ``num_parked_pages`` becomes the pages that came back (the rest stayed
        below or were gone; a top-up adds its own), and the ack's latency teaches the worker's
        ``PromoteLatency``. Pages left below are topped up later (``_schedule_topup``)."""
        if ack is None or not ack.ok:
            if record is not None and sent.attempt == 0:
                record.prefetch_state = PrefetchState.NONE  # the worker promotes on hit instead
            return
        latency_ms = self.clock_ms() - sent.sent_at_ms
        moved_bytes = ack.num_pages * sent.page_bytes
        rate = self.params.bandwidth_bytes_per_s[(sent.source, Tier.HBM)]
        self._latency_of(sent.worker).observe(latency_ms, moved_bytes, rate)
        if ack.num_pages:  # a guard that found every page still in HBM moved nothing
            self.stats.num_prefetched += 1
            self.stats.prefetched_bytes += moved_bytes
            self.stats.count_move(sent.reason, sent.source.label, Tier.HBM.label, ack.num_pages, moved_bytes)
        session = sent.command.session_id
        log.info("session prefetched", extra={
            "session_id": session, "reason": sent.reason, "num_pages": ack.num_pages,
            "num_skipped": ack.num_skipped_pages, "latency_ms": round(latency_ms), "in_time": record is not None})
        if record is None:
            return
        record.prefetch_state = PrefetchState.DONE
        record.prefetch_done_at_ms = self._now()
        record.num_parked_pages = ack.num_pages + (record.num_parked_pages if sent.attempt else 0)
        self._skipped_pages[record.session_id] = ack.num_skipped_pages
        if ack.num_skipped_pages and sent.attempt < self.params.max_topups:
            self._schedule_topup(record.session_id, sent.attempt + 1)

    # ---- helpers -------------------------------------------------------------------------------
    async def _send(self, worker: WorkerId, command: Command) -> CommandAck | None:
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

    def _bucket(self, worker: WorkerId, tier: Tier) -> TokenBucket | None:
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

    def _latency_of(self, worker: WorkerId) -> PromoteLatency:
        latency = self._latency.get(worker)
        if latency is None:
            p = self.params
            latency = self._latency[worker] = PromoteLatency(p.prefetch_overhead_ms, quantile=p.overhead_quantile)
        return latency

    def _target_ms(self, prediction: Prediction) -> float:
        """When, after the pause, the pages must be back: the low quantile of the prediction."""
        if not self.params.prefetch_at_low_quantile:
            return prediction.return_in_ms
        return min(prediction.quantile_lo_ms, prediction.return_in_ms)

    def prefetch_overheads(self) -> dict[WorkerId, tuple[int, float]]:
        """Per worker: acknowledged prefetches measured, and the overhead planned with (ms)."""
        return {w: (latency.num_samples, latency.overhead_ms()) for w, latency in self._latency.items()}

    def _lower_tier(self, worker: WorkerId | None) -> Tier | None:
        """The worker's first tier below HBM (where its own demotions go), if it has one."""
        entry = self._entry(worker)
        if entry is None:
            return None
        present = {o.tier for o in entry.tiers if o.total_pages}  # as of its last heartbeat
        return next((t for t in (Tier.DRAM, Tier.NVME) if t in present), None)

    def _source_tier(self, record: SessionRecord) -> Tier | None:
        """Where a prefetch of ``record`` brings pages from: the tier they were parked in, or,
        for a session kept in HBM (a guard), the tier the worker's own demotions use."""
        if record.parked_tier is None:
            return None
        return record.parked_tier if record.parked_tier is not Tier.HBM else self._lower_tier(record.worker_id)

    def _promote_ms(self, record: SessionRecord) -> float:
        """How long a Prefetch of the session's pages takes on their worker, ack included (a
        guard assumes every page of the session's history has to come back)."""
        source = self._source_tier(record)
        entry = self._entry(record.worker_id)
        if source is None or entry is None or record.worker_id is None:
            return 0.0
        num_pages = record.num_parked_pages
        if record.parked_tier is Tier.HBM:
            num_pages = record.num_cached_tokens // max(1, entry.registration.page_size)
        rate = self.params.bandwidth_bytes_per_s[(source, Tier.HBM)]
        return self._latency_of(record.worker_id).estimate_ms(num_pages * self._page_bytes(record.worker_id), rate)


def _own_tenant(caller: Principal | None, session: SessionId) -> str:
    """The tenant a session started by a Pause belongs to: the caller's only tenant ("" for an
    admin or with authentication off). A token bound to several tenants cannot say which, so
    its sessions start with a Route (which names the namespace's tenant)."""
    if caller is None or not caller.tenants:
        return ""
    if len(caller.tenants) > 1:
        raise NotFound(f"no session {session!r}; a token bound to several tenants starts a session with a "
                       "Route naming its session_id", field="session_id")
    return next(iter(caller.tenants))
