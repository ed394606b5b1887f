"""Tool-call-aware tiering: park a paused session's pages, bring them back in time (DESIGN §5.8).

On Pause the orchestrator predicts the return (``ToolReturnPredictor``), picks where the
session's pages wait, sends ``Demote`` (by session id: only the worker knows the pages
of the last turn's output), and schedules ``Prefetch`` into HBM at

    prefetch_at = paused_at + predicted_return_low_quantile − promote_time − margin

on a timer queue (``controller/timer_queue.py``). ``promote_time`` is bytes over bandwidth
plus the worker's measured overhead (a high quantile of recent Prefetch ack latencies beyond
the copy: the wait for the engine step in progress and the round trip;
``controller/prefetch.py``); the low quantile is
the predictor's ``lo_quantile`` (5 %) until the tenant has parked sessions of two tools with
a history, then each tool's share of the same expected lateness, spent by equal hazard (long
tools aim later, short ones earlier; ``kvtier/policy/lateness.py``). The Prefetch's
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

Where to wait is the cheapest of the tiers that can be back in time, holding HBM against
the round trip's copies (``kvtier/policy/placement.py``, which also gives the prefetch's start
and the hold it asks for).

Transfer seconds come from configured/measured bandwidth; recompute seconds from the
model geometry (``CostModel``). Anti-thrash: a token bucket (``controller/token_bucket.py``)
of bytes per (worker, lower tier) shared by demotions and prefetches. A demotion needs
tokens (and, once the bucket ran dry, waits until it refilled to ``resume_fraction`` —
hysteresis); a prefetch always
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
from collections.abc import Callable
from dataclasses import replace

from kvtier.controller.lateness import LatenessBudget
from kvtier.controller.orchestrator_params import OrchestratorParams
from kvtier.controller.predictor import ToolReturnPredictor
from kvtier.controller.prefetch import (
    MoveReason,
    Outcome,
    PauseOutcome,
    PrefetchStats,
    evicted_since_prefetch,
)
from kvtier.controller.registry import Registry
from kvtier.controller.session_census import SessionCensus
from kvtier.controller.session_serial import SessionSerial
from kvtier.controller.session_tenancy import (
    SessionKey,
    is_visible_to,
    key_for_call,
    owner_of,
    session_not_found,
)
from kvtier.controller.sessions import PrefetchState, SessionRecord, SessionStore
from kvtier.controller.tier_moves import SendCommand, SentPrefetch, TierMoves
from kvtier.controller.timer_queue import TimerQueue, wall_clock_ms
from kvtier.domain.hashing import NamespaceDigest
from kvtier.domain.records import (
    CommandAck,
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
    TokensByTier,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.policy.placement import (
    HoldPlan,
    choose_tier,
    eta_hold,
    hold_terms,
    predicted_hold,
    prefetch_start_ms,
    prefetch_target_ms,
    topup_delay_ms,
)
from kvtier.policy.prediction import Prediction
from kvtier.rpc.auth import Principal
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.orchestrator")

# How often the orchestrator forgets sessions idle past the store's TTL (``forget_idle``).
FORGET_INTERVAL_S = 60.0


# --------------------------------------------------------------------------- orchestrator


class Orchestrator:
    """Drives session transitions and the tier moves they imply. ``moves`` (``TierMoves``) sends
    the commands and knows their costs; ``serial`` (``SessionSerial``) runs Pause, Returning,
    End, Route and timer work on one session one at a time; ``timers`` holds the prefetches."""

    def __init__(self, store: SessionStore, predictor: ToolReturnPredictor, registry: Registry,
                 send_command: SendCommand, params: OrchestratorParams | None = None, *,
                 clock_ms: Callable[[], float] = wall_clock_ms) -> None:
        self.store = store
        self.predictor = predictor
        self.registry = registry
        self.params = params or OrchestratorParams()
        self.clock_ms = clock_ms
        self.timers = TimerQueue(clock_ms)
        self.stats = PrefetchStats()
        self.lateness = LatenessBudget(
            self.params.lateness, lambda tenant, tool: predictor.model(tenant, tool, self.params.lateness.min_samples))
        self.outcomes: collections.deque[PauseOutcome] = collections.deque(maxlen=self.params.num_outcomes_kept)
        self.listeners: list[Callable[[PauseOutcome], None]] = []  # called as each pause closes
        self.moves = TierMoves(registry, send_command, self.params, self.stats, clock_ms)
        self.serial = SessionSerial()  # per-session locks, Route bookkeeping in the background
        # Live sessions by (tenant, id): counts without a Redis scan, the per-tenant cap.
        self.census = SessionCensus(store.ttl_s, clock_ms, max_per_tenant=self.params.max_sessions_per_tenant)
        # How a prefetch of a paused session should hold its pages in HBM (until the
        # prediction's high quantile). In memory only: after a restart the median is used.
        self._holds: dict[SessionKey, HoldPlan] = {}
        # Pages a session's last prefetch left below HBM (moving, or no room): not its waste.
        self._skipped_pages: dict[SessionKey, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._forget_task: asyncio.Task[None] | None = None

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
        idle = self.census.forget_idle()
        for key in idle:
            self._holds.pop(key, None)
            self._skipped_pages.pop(key, None)
        return len(idle)

    async def settled(self) -> None:
        """Wait for the Route bookkeeping still running in the background (``route_seen``)."""
        await self.serial.settled()

    async def recover(self) -> int:
        """Reschedule the prefetches of parked sessions (after a restart or takeover)."""
        num = 0
        async for record in self.store.scan():
            self.census.note(record.key, record.state)
            if record.prefetch_state in (PrefetchState.SCHEDULED, PrefetchState.SENT) and record.prefetch_at_ms:
                self._schedule(record.key, record.prefetch_at_ms)
                num += 1
        return num

    def apply_policy(self, policy: Policy) -> None:
        """Budgets and watermarks of ``policy`` from now on (``controller/policy_store.py``).
        Buckets restart full at the new rates."""
        self.params = replace(self.params, budget_bytes_per_s=dict(policy.budget_bytes_per_s),
                              watermarks=dict(policy.watermarks))
        self.moves.apply_params(self.params)

    def key_for(self, session: SessionId, caller: Principal | None) -> SessionKey:
        """The (tenant, id) a Sessions call from ``caller`` names (``session_tenancy.key_for_call``)."""
        return key_for_call(caller, session, self.census.live_tenants)

    async def _get(self, key: SessionKey, caller: Principal | None = None) -> SessionRecord:
        """The session's record; NOT_FOUND when there is none or the caller may not act for it
        (the same answer, so ids of other tenants' sessions leak nothing)."""
        record = await self.store.get(key.session_id, key.tenant)
        if record is None or not is_visible_to(record.tenant, caller, record.owner):
            raise session_not_found(key.session_id)
        return record

    def _now(self) -> int:
        return round(self.clock_ms())

    async def _save(self, record: SessionRecord) -> None:
        await self.store.put(record)
        self.census.note(record.key, record.state)

    def session_counts(self) -> dict[SessionState, int]:
        """Sessions per state, as this controller last wrote them (ENDED ones are forgotten)."""
        self.forget_idle()
        return self.census.counts()

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
        num_tokens: int, matched: TokensByTier | None = None, owner: str = "",
    ) -> None:
        """The Router's hook (``Router.on_session_route``): ``on_route`` in the background, as
        of now. A Route does not wait for the session's bookkeeping (Redis round trips: ~0.5 ms
        of a resume's time to first token in the agent workload, and however long a slow Redis
        takes); the session's next Pause, Returning, End or prefetch waits for it instead
        (``SessionSerial.after_route``), so each still sees the turn. A session the tenant does
        not have live yet must fit its cap (``SessionCensus.admit``: ``ResourceExhausted``,
        which fails the Route)."""
        key = SessionKey(tenant, session)
        self.census.admit(key)
        bookkeeping = self.on_route(session, tenant=tenant, worker=worker, digest=digest, num_tokens=num_tokens,
                                    matched=matched, now_ms=self._now(), owner=owner)
        self.serial.run_after_route(key, bookkeeping)

    async def on_route(
        self, session: SessionId, *, tenant: str, worker: WorkerId | None, digest: NamespaceDigest,
        num_tokens: int, matched: TokensByTier | None = None, now_ms: int | None = None, owner: str = "",
    ) -> SessionInfo:
        """The session's next turn is being routed: it is ACTIVE again (a pause closes here).

        ``matched``: where the directory has the request's prefix on ``worker`` (None when
        unknown, e.g. a degraded Route); it tells whether prefetched pages were still in HBM.
        ``now_ms``: when the Route came (default: now), which a prefetch's ack must precede to
        be on time. ``owner``: the credential of the Route (a new session is its)."""
        key = SessionKey(tenant, session)
        async with self.serial.locked(key):
            now = self._now() if now_ms is None else now_ms
            record = await self.store.get(session, tenant)
            if record is None or record.state is SessionState.ENDED:
                record = SessionRecord(session_id=session, state=SessionState.ACTIVE, owner=owner)
            elif record.state in (SessionState.PAUSED, SessionState.RESUMING):
                await self._close_pause(record, now, matched if worker == record.worker_id else None)
            record.state = SessionState.ACTIVE
            record.tenant, record.namespace_digest, record.num_cached_tokens = tenant, digest, num_tokens
            record.worker_id = worker or record.worker_id
            await self._save(record)
            return record.info()

    async def _close_pause(self, record: SessionRecord, now: int, matched: TokensByTier | None) -> None:
        self.timers.cancel(record.key)
        self._holds.pop(record.key, None)
        skipped = self._skipped_pages.pop(record.key, 0)
        page_bytes = self.moves.page_bytes(record.worker_id)
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
            entry = self.moves.entry(record.worker_id)
            num_evicted = 0
            if entry is not None and matched is not None and record.prefetch_done_at_ms is not None:
                num_evicted = evicted_since_prefetch(
                    matched, page_size=entry.registration.page_size, num_parked_pages=record.num_parked_pages,
                    num_cached_tokens=record.num_cached_tokens, num_skipped=skipped,
                    is_too_recent=lead_ms < self.params.directory_lag_ms)
            wasted_bytes = num_evicted * page_bytes
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

    # ---- Pause -----------------------------------------------------------------------------
    async def pause(self, request: PauseRequest, *, caller: Principal | None = None) -> SessionInfo:
        key = self.key_for(request.session_id, caller)
        await self.serial.after_route(key)
        async with self.serial.locked(key):
            record = await self.store.get(key.session_id, key.tenant)
            if record is None:  # a Pause starts the session (sessions.proto): no worker, nothing to park
                self.census.admit(key)
                record = SessionRecord(session_id=request.session_id, state=SessionState.ACTIVE,
                                       tenant=key.tenant, owner=owner_of(caller))
            else:
                record = await self._get(key, caller)
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
            self._holds[record.key] = predicted_hold(now, prediction, self.predictor.spread(prediction))
            record.parked_tier = Tier.HBM
            await self._park(record, prediction, now)
            await self._save(record)
            return record.info()

    async def _park(self, record: SessionRecord, prediction: Prediction, paused_at_ms: int) -> None:
        entry = self.registry.get(record.worker_id) if record.worker_id else None
        if entry is None or record.namespace_digest is None:
            self.stats.num_kept_in_hbm += 1
            return
        page_bytes = self.moves.page_bytes(record.worker_id)
        page_size = entry.registration.page_size
        num_pages = max(1, record.num_cached_tokens // page_size)
        cost_model = replace(self.params.cost_model, page_size=page_size, page_bytes=page_bytes)
        overhead_ms = self.moves.latency_of(entry.worker_id).overhead_ms()
        p = self.params
        choice = choose_tier(
            num_pages=num_pages, page_bytes=page_bytes, pause_ms=prediction.return_in_ms,
            occupancy={o.tier: o for o in entry.tiers}, bandwidth_bytes_per_s=p.bandwidth_bytes_per_s,
            recompute_s=cost_model.prefix_recompute_s(num_pages), margin_ms=p.margin_ms, prices=p.prices,
            watermarks=p.watermarks, earliest_return_ms=self._target_ms(prediction), overhead_ms=overhead_ms,
        )
        if choice.tier is Tier.HBM or not await self.moves.demote(record, entry.worker_id, choice.tier, num_pages):
            self.stats.num_kept_in_hbm += 1
            self._guard(record)
            return
        record.parked_tier = choice.tier
        self.lateness.note_park(record.tenant, record.tool_name or "")
        # Aim at the early end of the predicted spread (the predictor's lo_quantile, 5 %, or
        # the tool's share of the tenant's lateness: kvtier/policy/lateness.py), not the median.
        at_ms = prefetch_start_ms(paused_at_ms + self._target_ms(prediction), self.moves.promote_ms(record),
                                  self.params.margin_ms)
        record.prefetch_at_ms = round(at_ms)
        record.prefetch_state = PrefetchState.SCHEDULED
        self._schedule(record.key, record.prefetch_at_ms)
        log.info("session parked", extra={
            "session_id": record.session_id, "tier": choice.tier.label, "num_pages": record.num_parked_pages,
            "prefetch_in_ms": round(at_ms - self._now())})

    def _guard(self, record: SessionRecord) -> None:
        """A guard prefetch for a session kept in HBM, at once (from the timer task: Pause
        does not wait for its ack).

        Kept is not staying: under pressure the worker's own watermark demotion moves idle
        pages down during the pause, and the next turn pays their promotion (what a reactive
        policy pays). Kept has to mean held: the guard's Prefetch moves nothing (the pages
        are in HBM) and holds them until the predicted return's high quantile, like a
        prefetched session's; whatever already left comes back."""
        if self.moves.lower_tier_of(record.worker_id) is None:
            return
        record.prefetch_at_ms = self._now()
        record.prefetch_state = PrefetchState.SCHEDULED
        self._schedule(record.key, record.prefetch_at_ms)

    # ---- Returning -------------------------------------------------------------------------
    async def returning(self, request: ReturningRequest, *, caller: Principal | None = None) -> SessionInfo:
        key = self.key_for(request.session_id, caller)
        await self.serial.after_route(key)
        async with self.serial.locked(key):
            record = await self._get(key, caller)
            record.require(SessionState.PAUSED, SessionState.RESUMING, action="Returning")
            now = self._now()
            eta_ms = request.eta_ms or 0
            if not record.is_duration_observed and record.paused_at_ms is not None:
                await self.predictor.observe(record.tenant, record.tool_name or "", now + eta_ms - record.paused_at_ms)
                record.is_duration_observed = True
            record.state = SessionState.RESUMING
            record.predicted_return_at_ms = now + eta_ms
            record.prediction_source = PredictionSource.CALLER_ETA
            self._holds[record.key] = eta_hold(now, eta_ms, self.params.margin_ms)
            if record.prefetch_state == PrefetchState.SCHEDULED:
                promote_ms = self.moves.promote_ms(record)
                at_ms = prefetch_start_ms(now + eta_ms, promote_ms, self.params.margin_ms)
                if at_ms <= now:
                    await self._prefetch_locked(record, MoveReason.RETURNING)
                else:
                    record.prefetch_at_ms = round(at_ms)
                    self._schedule(record.key, record.prefetch_at_ms)
            await self._save(record)
            return record.info()

    # ---- End ---------------------------------------------------------------------------------
    async def end(self, request: EndRequest, *, caller: Principal | None = None) -> SessionInfo:
        key = self.key_for(request.session_id, caller)
        await self.serial.after_route(key)
        async with self.serial.locked(key):
            record = await self._get(key, caller)
            if record.state is SessionState.ENDED:
                return record.info()
            self.timers.cancel(record.key)
            self._holds.pop(record.key, None)
            self._skipped_pages.pop(record.key, None)
            page_bytes = self.moves.page_bytes(record.worker_id)
            if record.prefetch_state == PrefetchState.DONE and record.state is not SessionState.ACTIVE:
                self.stats.count_waste("ended", record.num_parked_pages * page_bytes)
            if record.worker_id is not None and record.namespace_digest is not None:
                # Without ``drop`` the worker forgets the session and its hold; the pages stay as
                # ordinary cache entries (sessions.proto, End).
                ack = await self.moves.send(record.worker_id, DropCommand(
                    record.namespace_digest, (), record.session_id, keep_pages=not request.drop))
                if ack is not None and ack.num_pages:
                    self.stats.count_move(MoveReason.END, "any", "none", ack.num_pages, ack.num_pages * page_bytes)
            record.clear_pause()
            record.state = SessionState.ENDED
            await self.store.put(record)
            self.census.forget(record.key)
            self.registry.forget_session(record.key)
            return record.info()

    # ---- prefetch ------------------------------------------------------------------------------
    def _schedule(self, session: SessionKey, at_ms: float) -> None:
        async def fire() -> None:
            await self._run_prefetch(
                session, attempt=0,
                may_start=lambda r: r.prefetch_state == PrefetchState.SCHEDULED,
                may_finish=lambda r: r.prefetch_state == PrefetchState.SENT,
            )

        self.timers.schedule(session, at_ms, fire)

    def _schedule_topup(self, session: SessionKey, attempt: int) -> None:
        """Bring up, later, what the pause's prefetch left below. The pause stays scored by its
        first prefetch (on time: its ack came before the Route); the top-up adds its pages to
        those the Route judges, and a Route or End meanwhile cancels it (same timer key).

        The ``attempt``-th top-up waits ``topup_delay_ms × topup_backoff^(attempt − 1)``: the
        first ones catch a page that was in another move; the later ones, spread over the pause,
        catch the room that a prefetch ranked behind every hold in HBM could not take (it comes
        back as turns finish and sessions due sooner return; decision 0008). None is scheduled
        past the hold's end (``_holds``): the pages would be unheld, the first an eviction takes."""
        p = self.params
        at_ms = self.clock_ms() + topup_delay_ms(attempt, p.topup_delay_ms, p.topup_backoff)
        plan = self._holds.get(session)
        if plan is not None and at_ms > plan.until_ms:
            return

        async def fire() -> None:
            await self._run_prefetch(session, attempt=attempt, may_start=self._is_topping_up,
                                     may_finish=self._is_topping_up)

        self.timers.schedule(session, at_ms, fire)

    async def _run_prefetch(
        self, session: SessionKey, *, attempt: int,
        may_start: Callable[[SessionRecord], bool], may_finish: Callable[[SessionRecord], bool],
    ) -> None:
        """A timer's prefetch (``attempt`` 0) or top-up, if the session is still where ``may_start``
        expects; the ack applies to it only if it is still that pause and ``may_finish`` holds.

        The session's lock is held to start and to finish the prefetch, not while the worker
        carries it out: a Route meanwhile must not wait for the ack (its TTFT would pay the
        transfer, and the prefetch would be scored on time). It closes the pause as late; the
        ack then finds the pause gone and only its traffic is counted."""
        try:
            await self.serial.after_route(session)
            async with self.serial.locked(session):
                record = await self.store.get(session.session_id, session.tenant)
                if record is None or not may_start(record):
                    return
                sent = self._prefetch_begin(record, MoveReason.PREFETCH, attempt=attempt)
                await self._save(record)
            if sent is None:
                return
            ack = await self.moves.send(sent.worker, sent.command)
            async with self.serial.locked(session):
                record = await self.store.get(session.session_id, session.tenant)
                if record is not None and may_finish(record) and record.paused_at_ms == sent.paused_at_ms:
                    self._prefetch_end(sent, ack, record)
                    await self._save(record)
                else:
                    self._prefetch_end(sent, ack, None)
        except Exception as exc:  # a timer must not die silently
            log.error("scheduled prefetch failed", exc_info=exc,
                      extra={"session_id": session.session_id, "attempt": attempt})

    @staticmethod
    def _is_topping_up(record: SessionRecord) -> bool:
        return (record.state in (SessionState.PAUSED, SessionState.RESUMING)
                and record.prefetch_state == PrefetchState.DONE)

    async def _prefetch_locked(self, record: SessionRecord, reason: str) -> None:
        """Promote the parked session's pages now and wait for the ack (Returning: its caller
        asked for the pages now). The caller holds the session's lock and saves the record."""
        sent = self._prefetch_begin(record, reason)
        if sent is not None:
            self._prefetch_end(sent, await self.moves.send(sent.worker, sent.command), record)

    def _prefetch_begin(self, record: SessionRecord, reason: str, *, attempt: int = 0) -> SentPrefetch | None:
        """Mark ``record``'s prefetch SENT and build its command (None: nothing to prefetch); a
        top-up (``attempt`` > 0) leaves the state DONE."""
        self.timers.cancel(record.key)
        source = self.moves.source_tier(record)
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
        page_bytes = self.moves.page_bytes(record.worker_id)
        bucket = self.moves.bucket(record.worker_id, source)
        if bucket is not None:  # a top-up moves at most what the last ack left below
            num_pages = self._skipped_pages.get(record.key, 0) if attempt else record.num_parked_pages
            bucket.take(num_pages * page_bytes)
        if attempt == 0:
            record.prefetch_state = PrefetchState.SENT
        plan = self._holds.get(record.key)
        terms = hold_terms(
            self._now(), hold_until_ms=plan.until_ms if plan is not None else record.predicted_return_at_ms,
            predicted_return_at_ms=record.predicted_return_at_ms, paused_at_ms=record.paused_at_ms,
            spread=plan.spread if plan is not None else None, max_hold_ms=self.params.max_hold_ms,
        )
        command = PrefetchCommand(record.namespace_digest, (), Tier.HBM, deadline_ms=terms.deadline_ms,
                                  session_id=record.session_id, return_in_ms=terms.return_in_ms,
                                  away_ms=terms.away_ms, return_spread=terms.return_spread)
        return SentPrefetch(record.worker_id, command, reason, source, page_bytes, self.clock_ms(),
                             record.paused_at_ms, attempt)

    def _prefetch_end(self, sent: SentPrefetch, ack: CommandAck | None, record: SessionRecord | None) -> None:
        """Count a prefetch's ack; with ``record`` (still the same pause) mark it DONE or not.

        On the ack, ``num_parked_pages`` becomes the pages that came back (the rest stayed
        below or were gone; a top-up adds its own), and the ack's latency teaches the worker's
        ``PromoteLatency``. Pages left below are topped up later (``_schedule_topup``)."""
        if ack is None or not ack.ok:
            if record is not None and sent.attempt == 0:
                record.prefetch_state = PrefetchState.NONE  # the worker promotes on hit instead
            return
        latency_ms = self.moves.count_prefetch(sent, ack)
        session = sent.command.session_id
        log.info("session prefetched", extra={
            "session_id": session, "reason": sent.reason, "num_pages": ack.num_pages,
            "num_skipped": ack.num_skipped_pages, "latency_ms": round(latency_ms), "in_time": record is not None})
        if record is None:
            return
        record.prefetch_state = PrefetchState.DONE
        record.prefetch_done_at_ms = self._now()
        record.num_parked_pages = ack.num_pages + (record.num_parked_pages if sent.attempt else 0)
        self._skipped_pages[record.key] = ack.num_skipped_pages
        if ack.num_skipped_pages and sent.attempt < self.params.max_topups:
            self._schedule_topup(record.key, sent.attempt + 1)

    def _target_ms(self, prediction: Prediction) -> float:
        """When, after the pause, the pages must be back: the low quantile of the prediction."""
        return prefetch_target_ms(prediction, at_low_quantile=self.params.prefetch_at_low_quantile)

