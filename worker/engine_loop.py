"""The bridge between asyncio (gRPC, the WorkerLink) and the Engine, which is not thread-safe.

One dedicated thread owns the Engine. Everything that touches it (admission, abort,
``step()``, integrity checks, stats, inventory, commands on pages) runs on that thread, as an
operation posted to the thread's inbox; results and generated tokens travel back with
``loop.call_soon_threadsafe`` into an ``asyncio.Future`` or a per-request ``asyncio.Queue``::

    asyncio side                         engine thread
    submit(req) ──post(admit)──────────► add_request ─┐ (errors come back before any token)
          ◄────────future────────────────────────────┘
    queue.get() ◄──call_soon_threadsafe── step() → TokenChunk …, GenerateFinal
    consumer cancelled ──post(abort)───► abort + pop_result (pages released exactly once)

The thread runs ``step()`` while there is work and blocks on a condition when idle. What it
does between steps belongs to the components it composes, each owning its state:

    holds        admin pins, session holds, sessions' pages, prefetch waste  (worker.holds)
    page_events  namespaces of cached pages, page events, inventory          (worker.page_events)
    room         background room-making in HBM                               (worker.room)
    admission    requests waiting outside the engine for room or pages       (worker.admission)
    commands     Demote / Prefetch / Drop, invalidation                      (worker.commands)

Usage and spans are ``worker.usage``; occupancy is ``worker.load``. Quotas and TTLs: the engine
enforces them before each step; while idle the loop runs the same bounded pass and wakes for
the next TTL deadline or pin expiry.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from opentelemetry.context import Context

from kvtier.cache.epochs import EpochTable
from kvtier.domain.errors import FailedPrecondition, IntegrityError, KvtierError, Unavailable
from kvtier.domain.hashing import NamespaceDigest, PageKey, short
from kvtier.domain.records import (
    GenerateEvent,
    GenerateFinal,
    GenerateRequest,
    IntegrityResult,
    InvalidationScope,
    NamespaceInventory,
    PageEvent,
    PinCommand,
    PinId,
    RunId,
    SessionId,
    TokenChunk,
)
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine, GenerationResult, StepOutput
from kvtier.policy.holds import expected_return
from kvtier.runtime import tracing
from kvtier.runtime.log import get_logger, redact_tokens
from kvtier.tiers.moves import MoveOutcome
from kvtier.tiers.transfer import TransferDone
from kvtier.worker.admission import Admission, Admitted
from kvtier.worker.commands import Commands, deliver, set_exception, set_result
from kvtier.worker.holds import DropOutcome, Holds, PageCounts, SessionPages
from kvtier.worker.integrity import check_integrity
from kvtier.worker.load import EngineLoad, measure_load
from kvtier.worker.page_events import PageEvents
from kvtier.worker.room import Room
from kvtier.worker.usage import WorkerRecorder, add_promotions, finish, record_spans

log = get_logger("kvtier.worker.engine")

T = TypeVar("T")

# When step() makes no progress (nothing admissible, e.g. the pool is full of pinned pages)
# the thread waits this long for news instead of spinning.
STALLED_WAIT_S = 0.005
# Counting pinned pages is O(pool); publish the load for heartbeats at most this often while
# busy (and always when the engine goes idle).
LOAD_PUBLISH_INTERVAL_S = 0.05
# While stale namespaces still have pages and the engine is busy, look for idle ones this often.
RECLAIM_INTERVAL_S = 0.05


def new_run_id() -> RunId:
    return RunId(uuid.uuid4().hex[:16])


@dataclass(slots=True, eq=False)
class _Run:
    """One generation. Fields below the line are touched by the engine thread only."""

    run_id: RunId
    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[GenerateEvent | BaseException]
    submitted_at: float
    trace_parent: Context | None = None  # the caller's trace context (kvtier.runtime.tracing), if any
    is_done: bool = False  # asyncio side: the final event (or an error) was received
    # ---- engine thread
    first_token_at: float | None = None
    num_emitted: int = 0
    digest: NamespaceDigest | None = None  # of its namespace, from admission on
    waited: Admitted[_Run] | None = None  # its wait outside the engine, if it waited


@dataclass(slots=True)
class _Inbox:
    ops: deque[Callable[[], None]] = field(default_factory=deque)
    is_stopping: bool = False  # the thread should finish
    is_closed: bool = False  # the thread has finished; nothing posted will run


class EngineLoop:
    """Owns ``engine`` on one thread; the asyncio side talks to it through ``submit`` and
    the ``async`` query methods. Start with ``start()``; stop with ``await close()``.

    ``hold_fraction``: the share of HBM session holds may keep together
    (``WorkerConfig.session_hold_fraction``; None: all of it). ``wait_scale`` multiplies the
    fixed waits of admission and commands (``WorkerConfig.wait_scale``)."""

    def __init__(
        self,
        engine: Engine,
        *,
        name: str = "kvtier-engine",
        on_failure: Callable[[BaseException], None] | None = None,
        hold_fraction: float | None = None,
        wait_scale: float = 1.0,
    ) -> None:
        self.engine = engine
        self.holds = Holds(engine, hold_fraction=hold_fraction)
        self.page_events = PageEvents(engine.index)
        self.room = Room(engine, self.holds)
        self.admission: Admission[_Run] = Admission(engine, self.holds, self.room, wait_scale=wait_scale)
        self.commands = Commands(engine, self.holds, self.room, self.page_events, wait_scale=self.admission.wait_scale)
        self._name = name
        self._on_failure = on_failure
        # Set by the server when the process exports metrics (kvtier.worker.metrics).
        self.metrics: WorkerRecorder | None = None
        # Attributes of every ``generate`` span (kvtier.runtime.tracing), e.g. the worker id.
        self.span_attributes: dict[str, str] = {}
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        # The worker's policy epochs (asyncio side): the servicer applies them to every request.
        self.epochs = EpochTable()
        # Counters, written by the engine thread (metrics and tests read them).
        self.num_finished = 0
        self.num_cancelled = 0
        self._runs: dict[str, _Run] = {}  # in the engine (engine thread only)
        self._reclaimed_at = 0.0
        self._load = self._measure_load()
        self._load_at = time.monotonic()
        if engine.tiers is not None:
            engine.tiers.transfers.on_done = self._transfer_done

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    @property
    def is_draining(self) -> bool:
        return self.holds.is_draining

    async def close(self) -> None:
        """Stop the thread; in-flight requests end with ``Unavailable``."""
        with self._cond:
            self._inbox.is_stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- requests -------------------------------------------------------------------
    async def submit(
        self, request: GenerateRequest, *, trace_parent: Context | None = None
    ) -> AsyncGenerator[GenerateEvent, None]:
        """Generate for ``request``: ``TokenChunk`` events, then exactly one ``GenerateFinal``.

        Admission errors (``InvalidArgument``, ``ResourceExhausted``) raise on the first
        ``__anext__``, before any token. Closing or cancelling the iterator aborts the
        request in the engine; its pages are released exactly once. Use it under
        ``contextlib.aclosing`` so that an early exit closes it at once. ``trace_parent``
        parents the request's spans when tracing is on (``kvtier.runtime.tracing``).
        """
        if self.is_draining:
            raise Unavailable("this worker is draining and admits no new requests; route to another worker")
        run = _Run(run_id=new_run_id(), request=request, loop=asyncio.get_running_loop(), queue=asyncio.Queue(),
                   submitted_at=time.perf_counter(), trace_parent=trace_parent)
        try:
            await self.call(lambda: self._admit(run))
            while True:
                item = await run.queue.get()
                if isinstance(item, BaseException):
                    run.is_done = True
                    raise item
                if isinstance(item, GenerateFinal):
                    run.is_done = True
                    yield item
                    return
                yield item
        finally:
            if not run.is_done:
                # Ordered after the admission in the inbox, so it always finds the run
                # (or nothing, when admission failed or the request already finished).
                self._post(lambda: self._abort(run))

    # ---- queries and commands: each runs on the engine thread (the component's method says
    # what it does); ``start_*`` return once the transfers are submitted, with a future that
    # resolves once they are applied -----------------------------------------------------
    async def check_integrity(self) -> IntegrityResult:
        return await self.call(lambda: check_integrity(self.engine, set(self._runs), self.page_events))

    async def stats(self) -> EngineLoad:
        return await self.call(self._measure_load)

    @property
    def latest_load(self) -> EngineLoad:
        """The load as of at most ``LOAD_PUBLISH_INTERVAL_S`` ago; never waits for the engine."""
        return self._load

    async def inventory(self, *, reset_page_events: bool = False) -> list[NamespaceInventory]:
        return await self.call(lambda: self.page_events.inventory(reset_page_events))

    def drain_page_events(self) -> list[PageEvent]:
        return self.page_events.drain()

    def consume_page_events_lost(self) -> bool:
        return self.page_events.consume_lost()

    async def drop_pages(self, digest: NamespaceDigest, keys: tuple[PageKey, ...], *,
                         whole_namespace: bool = False) -> DropOutcome:
        return await self.call(lambda: self.commands.drop_pages(digest, keys, whole_namespace))

    async def demote(self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None,
                     dst: Tier, *, whole_namespace: bool = False) -> MoveOutcome:
        return await (await self.start_demote(digest, keys, session, dst, whole_namespace=whole_namespace))

    async def start_demote(self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None,
                           dst: Tier, *, whole_namespace: bool = False) -> asyncio.Future[MoveOutcome]:
        done: asyncio.Future[MoveOutcome] = asyncio.get_running_loop().create_future()
        await self.call(lambda: self.commands.demote(digest, keys, session, dst, whole_namespace, done))
        return done

    async def prefetch(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None,
        *, hold_s: float | None = None, due_s: float | None = None, away_s: float | None = None,
        spread: float | None = None,
    ) -> MoveOutcome:
        return await (await self.start_prefetch(digest, keys, session, hold_s=hold_s, due_s=due_s,
                                                away_s=away_s, spread=spread))

    async def start_prefetch(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None,
        *, hold_s: float | None = None, due_s: float | None = None, away_s: float | None = None,
        spread: float | None = None,
    ) -> asyncio.Future[MoveOutcome]:
        """A session's pages are held up to ``hold_s``, ranked by its return, due in ``due_s``
        (``kvtier.policy.holds.expected_return``). A draining worker refuses."""
        if self.is_draining:
            raise FailedPrecondition(
                "this worker is draining and takes no prefetch: the session's next turn is routed to another worker")
        done: asyncio.Future[MoveOutcome] = asyncio.get_running_loop().create_future()
        expected = None if due_s is None else expected_return(time.time() * 1000.0, due_s, away_s, spread)
        await self.call(lambda: self.commands.prefetch(digest, keys, session, hold_s, done, expected=expected))
        return done

    async def invalidate(self, scope: InvalidationScope, epoch: int) -> PageCounts:
        """Install the epoch in ``epochs`` first, so no new request reaches the stale digests."""
        return await self.call(lambda: self.commands.invalidate(scope, epoch, self._busy_namespaces()))

    async def pin(self, command: PinCommand) -> PageCounts:
        return await self.call(lambda: self.holds.pin(
            command, self.page_events.digests, is_stale=self.commands.is_stale(command.namespace_digest)))

    async def unpin(self, pin_id: PinId) -> int:
        return await self.call(lambda: self.holds.release(pin_id))

    async def set_draining(self, draining: bool) -> int:
        """No request is admitted and no prefetch taken while a drain lasts; starting one
        releases every session hold (``Holds.release_for_drain``): their sessions' next turns
        go elsewhere."""
        self.holds.is_draining = draining
        return await self.call(self.holds.release_for_drain) if draining else 0

    async def drop_session(self, digest: NamespaceDigest, session: SessionId, *, drop: bool = True) -> DropOutcome:
        """Forget the session and release its hold; ``drop`` also removes its private pages."""
        return await self.call(lambda: self.holds.drop_session(digest, session, drop=drop))

    async def session_pages(self, session: SessionId, digest: NamespaceDigest) -> SessionPages | None:
        return await self.call(lambda: self.holds.session_pages(session, digest))

    # ---- posting ----------------------------------------------------------------------
    def _post(self, op: Callable[[], None]) -> bool:
        """Queue ``op`` for the engine thread; False when the thread is gone (it never runs)."""
        with self._cond:
            if self._inbox.is_closed:
                return False
            self._inbox.ops.append(op)
            self._cond.notify()
            return True

    def call(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn`` on the engine thread, which owns the engine: its result or exception
        arrives in the future (an admin tool or a test acting on the engine directly)."""
        if self._thread is None or self.failure is not None:
            raise self._unavailable()
        aloop = asyncio.get_running_loop()
        future: asyncio.Future[T] = aloop.create_future()

        def op() -> None:
            try:
                result = fn()
            except Exception as exc:  # handed to the awaiting coroutine
                deliver(aloop, set_exception, future, exc)
            else:
                deliver(aloop, set_result, future, result)

        if not self._post(op):
            future.set_exception(self._unavailable())
        return future

    def _unavailable(self) -> Unavailable:
        if self._thread is None:
            return Unavailable("the worker's engine loop is not started")
        if self.failure is not None:
            return Unavailable("the worker's engine stopped after an internal error; route to another worker")
        return Unavailable("the worker's engine is not running; route to another worker")

    # ---- engine thread ----------------------------------------------------------------
    def _has_background_work(self) -> bool:
        """Transfers pending, requests waiting outside the engine, or commands deferred."""
        tiers = self.engine.tiers
        return (tiers is not None and tiers.has_pending()) or bool(self.admission) or self.commands.has_deferred

    def _main(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._inbox.ops and not self._inbox.is_stopping and not self.engine.has_unfinished():
                        if self._has_background_work():
                            break
                        wait_s = self._idle_wait_s()
                        if wait_s is not None and wait_s <= 0:
                            break
                        self._cond.wait(wait_s)
                    if self._inbox.is_stopping:
                        break
                    ops = list(self._inbox.ops)
                    self._inbox.ops.clear()
                for op in ops:
                    op()
                self._between_steps()
                if self.engine.has_unfinished():
                    # Session holds yield before a running sequence is preempted: a hold is a
                    # prediction, a preemption recomputes for certain.
                    outputs = self.engine.step(release_pin=self.holds.yield_weakest)
                    if outputs:
                        self._dispatch(outputs)
                    else:
                        self._stall()
                self._after_step()
        except BaseException as exc:  # a bug in the engine: stop serving rather than guess
            self.failure = exc
            log.error("engine loop stopped after an unexpected error", exc_info=exc)
            if self._on_failure is not None:
                self._on_failure(exc)
            self._fail_all(self._unavailable())
        else:
            self._fail_all(_shutting_down())
        finally:
            self._fail_pending_calls()

    def _between_steps(self) -> None:
        if self.commands.has_deferred:
            self.commands.retry_deferred()
        if self.admission:
            self._admit_ready()
        if self.holds.has_pins():
            self.holds.expire()
        if not self.engine.has_unfinished():
            self.engine.enforce_limits()  # quotas and TTLs while idle (step() runs them when busy)
            if self._has_background_work():
                # Idle, but transfers finished or are due: apply them without a request.
                if self.engine.tiers is not None:
                    self.engine.tiers.maintain()
                self._stall()

    def _after_step(self) -> None:
        if self.holds.has_lapsed() and not (self.admission or self.commands.has_deferred or self.engine.num_queued):
            self.holds.retake()  # after the step and the transfers it applied: room may be back
        now = time.monotonic()
        is_busy = self.engine.has_unfinished()
        if self.commands.has_stale and (not is_busy or (
                self.commands.is_reclaim_due and now - self._reclaimed_at >= RECLAIM_INTERVAL_S)):
            self.commands.reclaim(self._busy_namespaces())
            self._reclaimed_at = now
        if now - self._load_at >= LOAD_PUBLISH_INTERVAL_S or not is_busy:
            self._load, self._load_at = self._measure_load(), now

    def _stall(self) -> None:
        with self._cond:
            if not self._inbox.ops and not self._inbox.is_stopping:
                self._cond.wait(STALLED_WAIT_S)

    def _idle_wait_s(self) -> float | None:
        """Seconds until a timed pin lapses or quota / TTL work is due (None: nothing timed)."""
        waits = [w for w in (self.holds.wait_s(), self.engine.limits_wait_s()) if w is not None]
        return min(waits) if waits else None

    def _busy_namespaces(self) -> set[NamespaceDigest]:
        """Namespaces with a request waiting outside the engine or in it."""
        return self.engine.busy_namespaces() | self.admission.digests()

    def _fail_all(self, error: KvtierError) -> None:
        for run in [*self._runs.values(), *self.admission.runs()]:
            try:
                self._abort(run)
            except Exception:  # the engine may be broken; consumers must still hear
                log.exception("could not abort a run while stopping", extra={"run_id": run.run_id})
            self._emit(run, error)

    def _fail_pending_calls(self) -> None:
        # Operations posted while the thread was stopping must not leave callers waiting:
        # run them (admissions among them are failed right after), then refuse new ones.
        with self._cond:
            self._inbox.is_stopping = self._inbox.is_closed = True
            ops = list(self._inbox.ops)
            self._inbox.ops.clear()
        for op in ops:
            try:
                op()
            except Exception:
                log.exception("an operation posted while stopping failed")
        error = self._unavailable() if self.failure is not None else _shutting_down()
        self._fail_all(error)
        self.commands.fail_moves(error)

    def _admit(self, run: _Run) -> None:
        request = run.request
        digest = run.digest = self.engine.digest_for(request.namespace)
        if request.session_id is not None:
            self.holds.arrived(digest, request.session_id)
        tiers = self.engine.tiers
        if tiers is not None and not tiers.config.simulate:
            if self.admission.offer(run.run_id, run, request, digest):
                self._admit_ready()
                return
        self._add(run, digest)

    def _admit_ready(self) -> None:
        """Add the requests whose room and pages are ready, one by one (``Admission.ready``)."""
        for admitted in self.admission.ready():
            run = admitted.run
            run.waited = admitted
            try:
                assert run.digest is not None
                self._add(run, run.digest)
            except KvtierError as exc:
                self.admission.release(run.run_id)
                self._emit(run, exc)
        if self.metrics is not None:
            for waited, outcome in self.admission.take_deferrals():
                self.metrics.record_hold_deferral(waited, outcome)

    def _add(self, run: _Run, digest: NamespaceDigest) -> None:
        request = run.request
        self.engine.add_request(list(request.prompt_token_ids), request.sampling, request_id=run.run_id,
                                priority=request.priority, namespace=request.namespace)
        self.page_events.admitted(digest, request.namespace or self.engine.namespace)
        self._runs[run.run_id] = run
        log.info("generation admitted", extra={
            "run_id": run.run_id, "request_id": request.request_id, "prompt": redact_tokens(request.prompt_token_ids),
            "max_tokens": request.sampling.max_tokens, "namespace": short(digest)})

    def _abort(self, run: _Run) -> None:
        if self.admission.cancel(run.run_id):  # never reached the engine
            self.num_cancelled += 1
            log.info("generation cancelled before admission", extra={"run_id": run.run_id})
            return
        if self._runs.pop(run.run_id, None) is None:
            return
        self.admission.release(run.run_id)
        self.engine.abort(run.run_id)
        result = self.engine.pop_result(run.run_id)
        self.num_cancelled += 1
        self.commands.run_ended(run.digest)
        if tracing.is_enabled():
            record_spans(run.run_id, run.request, result, self._times(run, result), self.span_attributes,
                         run.trace_parent)
        log.info("generation cancelled", extra={"run_id": run.run_id, "generated_tokens": len(result.token_ids)})

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            run = self._runs.get(out.request_id)
            if run is None:
                raise IntegrityError(f"the engine stepped request {out.request_id} that no run owns")
            self.admission.release(run.run_id)  # stepped: its sequence holds its pages now
            if out.new_token_ids:
                if run.first_token_at is None:
                    run.first_token_at = now
                self._emit(run, TokenChunk(token_ids=tuple(out.new_token_ids), index=run.num_emitted))
                run.num_emitted += len(out.new_token_ids)
            if out.finished:
                del self._runs[run.run_id]
                self.num_finished += 1
                self.commands.run_ended(run.digest)
                self._emit(run, self._final(run))

    def _final(self, run: _Run) -> GenerateFinal:
        result = self.engine.pop_result(run.run_id)
        waited = run.waited
        if waited is not None:
            add_promotions(result, waited.promoted_tokens_by_tier, waited.promotion_wait_s)
        session = run.request.session_id
        # A session's next turn here: its last turn's pages are the history this one resumes.
        resumed = session is not None and run.digest is not None and self.holds.has_session(session, run.digest)
        if session is not None:
            assert run.digest is not None
            self.holds.remember(session, run.digest, result.prompt_token_ids, result.token_ids)
        return finish(run.run_id, run.request, result, self._times(run, result), recorder=self.metrics,
                      span_attributes=self.span_attributes, parent=run.trace_parent, resumed=resumed,
                      admission_wait_s=waited.admission_wait_s if waited else 0.0,
                      hold_wait_s=waited.hold_wait_s if waited else 0.0)

    @staticmethod
    def _times(run: _Run, result: GenerationResult) -> tracing.GenerationTimes:
        return tracing.GenerationTimes(submitted_at=run.submitted_at, finished_at=time.perf_counter(),
                                       prefill_started_at=result.prefill_started_at,
                                       first_token_at=run.first_token_at, promotion_wait_s=result.promotion_wait_s)

    def _transfer_done(self, done: TransferDone) -> None:  # a transfer thread; must not block
        if self.metrics is not None:
            self.metrics.transfer_done(done)
        if tracing.is_enabled():
            tracing.record_transfer(done)

    def _emit(self, run: _Run, item: GenerateEvent | BaseException) -> None:
        try:
            run.loop.call_soon_threadsafe(run.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody will read or abort
            self._abort(run)

    def _measure_load(self) -> EngineLoad:
        self.holds.count_held_pages()
        return measure_load(self.engine, self.room.free_hbm())


def _shutting_down() -> Unavailable:
    return Unavailable("the worker is shutting down; route to another worker")
