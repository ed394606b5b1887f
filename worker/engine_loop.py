"""The bridge between asyncio (gRPC, the WorkerLink) and the Engine, which is not thread-safe.

One dedicated thread owns the Engine. Everything that touches it (admission, abort,
``step()``, integrity checks, stats, inventory, commands on pages) runs on that thread, as an
operation posted to the thread's inbox; results and generated tokens travel back with
``loop.call_soon_threadsafe`` into an ``asyncio.Future`` or a per-request ``asyncio.Queue``::

    asyncio side                         engine thread
    submit(req) ──post(admit)──────────► runs.admit ──┐ (errors come back before any token)
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
    runs         generations in flight: admission, events, abort             (worker.runs)
    upkeep       work around each step: retries, expiry, reclaim, load       (worker.upkeep)

Usage and spans are ``worker.usage``; occupancy is ``worker.load``. Quotas and TTLs: the engine
enforces them before each step; while idle the loop runs the same bounded pass and wakes for
the next TTL deadline or pin expiry.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from opentelemetry.context import Context

from kvtier.cache.epochs import EpochTable
from kvtier.domain.errors import FailedPrecondition, Unavailable
from kvtier.domain.hashing import NamespaceDigest, PageKey
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
    SessionId,
)
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine
from kvtier.policy.holds import expected_return
from kvtier.runtime import tracing
from kvtier.runtime.log import get_logger
from kvtier.tiers.moves import MoveOutcome
from kvtier.tiers.transfer import TransferDone
from kvtier.worker.admission import Admission
from kvtier.worker.commands import Commands, deliver, set_exception, set_result
from kvtier.worker.costs import CostMeter
from kvtier.worker.holds import DropOutcome, Holds, PageCounts, SessionPages
from kvtier.worker.integrity import check_integrity
from kvtier.worker.load import EngineLoad
from kvtier.worker.page_events import PageEvents
from kvtier.worker.room import Room
from kvtier.worker.runs import Run, Runs, new_run_id
from kvtier.worker.upkeep import Upkeep
from kvtier.worker.usage import WorkerRecorder

log = get_logger("kvtier.worker.engine")

T = TypeVar("T")

# When step() makes no progress (nothing admissible, e.g. the pool is full of pinned pages)
# the thread waits this long for news instead of spinning.
STALLED_WAIT_S = 0.005


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

    def __init__(self, engine: Engine, *, name: str = "kvtier-engine",
                 on_failure: Callable[[BaseException], None] | None = None,
                 hold_fraction: float | None = None, wait_scale: float = 1.0) -> None:
        self.engine = engine
        self.holds = Holds(engine, hold_fraction=hold_fraction)
        self.page_events = PageEvents(engine.index)
        self.room = Room(engine, self.holds)
        self.admission: Admission[Run] = Admission(engine, self.holds, self.room, wait_scale=wait_scale)
        self.commands = Commands(engine, self.holds, self.room, self.page_events, wait_scale=self.admission.wait_scale)
        self.costs = CostMeter()  # measured rates for Route's cost model (heartbeats carry them)
        self.runs = Runs(engine, self.holds, self.admission, self.page_events, self.commands, self.costs)
        self.upkeep = Upkeep(engine, self.holds, self.room, self.admission, self.commands, self.runs)
        self._name = name
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        # The worker's policy epochs (asyncio side): the servicer applies them to every request.
        self.epochs = EpochTable()
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
    def metrics(self) -> WorkerRecorder | None:
        """Set by the server when the process exports metrics (``kvtier.worker.metrics``)."""
        return self.runs.metrics

    @metrics.setter
    def metrics(self, recorder: WorkerRecorder | None) -> None:
        self.runs.metrics = recorder

    @property
    def span_attributes(self) -> dict[str, str]:
        """Attributes of every ``generate`` span (``kvtier.runtime.tracing``), e.g. the worker id."""
        return self.runs.span_attributes

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
    async def submit(self, request: GenerateRequest, *, trace_parent: Context | None = None,
                     fetch: Callable[[], Awaitable[object]] | None = None) -> AsyncGenerator[GenerateEvent, None]:
        """Generate for ``request``: ``TokenChunk`` events, then exactly one ``GenerateFinal``.

        Admission errors (``InvalidArgument``, ``ResourceExhausted``) raise on the first
        ``__anext__``, before any token. Closing or cancelling the iterator aborts the
        request in the engine; its pages are released exactly once. Use it under
        ``contextlib.aclosing`` so that an early exit closes it at once. ``trace_parent``
        parents the request's spans when tracing is on (``kvtier.runtime.tracing``). ``fetch``
        brings the prompt's pages from a peer and never raises (``kvtier.worker.peer_fetch``): it
        runs on the asyncio side while the request waits outside the engine, which keeps stepping.
        """
        if self.is_draining:
            raise Unavailable("this worker is draining and admits no new requests; route to another worker")
        # The worker's edge: the prompt is checked against the model here, once, before it can
        # wait for pages or room (the wire fields were checked when the request was decoded).
        self.engine.check_prompt(request.prompt_token_ids)
        run = Run(run_id=new_run_id(), request=request, loop=asyncio.get_running_loop(), queue=asyncio.Queue(),
                  submitted_at=time.perf_counter(), trace_parent=trace_parent)
        fetching: asyncio.Future[object] | None = None
        try:
            await self.call(lambda: self.runs.admit(run, fetching=fetch is not None))
            if fetch is not None:
                fetching = asyncio.ensure_future(fetch())
                fetching.add_done_callback(lambda _: self._post(lambda: self.runs.fetched(run)))
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
            if fetching is not None:
                fetching.cancel()  # a no-op once it ended
            if not run.is_done:
                # Ordered after the admission in the inbox, so it always finds the run
                # (or nothing, when admission failed or the request already finished).
                self._post(lambda: self.runs.abort(run))

    # ---- queries and commands: each runs on the engine thread (the component's method says
    # what it does); ``start_*`` return once the transfers are submitted, with a future that
    # resolves once they are applied -----------------------------------------------------
    async def check_integrity(self) -> IntegrityResult:
        return await self.call(lambda: check_integrity(self.engine, self.runs.ids(), self.page_events))

    async def stats(self) -> EngineLoad:
        return await self.call(self.upkeep.measure_load)

    @property
    def latest_load(self) -> EngineLoad:
        """The load as of at most ``LOAD_PUBLISH_INTERVAL_S`` ago; never waits for the engine."""
        return self.upkeep.latest_load

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

    async def prefetch(self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None, *,
                       hold_s: float | None = None, due_s: float | None = None, away_s: float | None = None,
                       spread: float | None = None) -> MoveOutcome:
        return await (await self.start_prefetch(digest, keys, session, hold_s=hold_s, due_s=due_s,
                                                away_s=away_s, spread=spread))

    async def start_prefetch(self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None,
                             *, hold_s: float | None = None, due_s: float | None = None,
                             away_s: float | None = None, spread: float | None = None) -> asyncio.Future[MoveOutcome]:
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
        return await self.call(lambda: self.commands.invalidate(scope, epoch, self.upkeep.busy_namespaces()))

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
    def _main(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._inbox.ops and not self._inbox.is_stopping and not self.engine.has_unfinished():
                        if self.upkeep.has_background_work():
                            break
                        wait_s = self.upkeep.idle_wait_s()
                        if wait_s is not None and wait_s <= 0:
                            break
                        self._cond.wait(wait_s)
                    if self._inbox.is_stopping:
                        break
                    ops = list(self._inbox.ops)
                    self._inbox.ops.clear()
                for op in ops:
                    op()
                if self.upkeep.before_step():
                    self._stall()
                if self.engine.has_unfinished():
                    # Session holds yield before a running sequence is preempted: a hold is a
                    # prediction, a preemption recomputes for certain.
                    outputs = self.engine.step(release_pin=self.holds.yield_weakest)
                    if outputs:
                        self.runs.dispatch(outputs)
                    else:
                        if not self.engine.num_running:  # nothing runs: queued pins hold the room
                            self.admission.release_queued()
                        self._stall()
                self.upkeep.after_step()
        except BaseException as exc:  # a bug in the engine: stop serving rather than guess
            self.failure = exc
            log.error("engine loop stopped after an unexpected error", exc_info=exc)
            if self._on_failure is not None:
                self._on_failure(exc)
            self.runs.fail_all(self._unavailable())
        else:
            self.runs.fail_all(_shutting_down())
        finally:
            self._fail_pending_calls()

    def _stall(self) -> None:
        with self._cond:
            if not self._inbox.ops and not self._inbox.is_stopping:
                self._cond.wait(STALLED_WAIT_S)

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
        self.runs.fail_all(error)
        self.commands.fail_moves(error)

    def _transfer_done(self, done: TransferDone) -> None:  # a transfer thread; must not block
        self.costs.transfer_done(done)
        metrics = self.runs.metrics
        if metrics is not None:
            metrics.transfer_done(done)
        if tracing.is_enabled():
            tracing.record_transfer(done)


def _shutting_down() -> Unavailable:
    return Unavailable("the worker is shutting down; route to another worker")
