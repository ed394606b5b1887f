"""The bridge between asyncio (gRPC, the WorkerLink) and the Engine, which is not thread-safe.

One dedicated thread owns the Engine. Everything that touches it (admission, abort,
``step()``, integrity checks, stats, inventory, page drops) runs on that thread, as an
operation posted to the thread's inbox; results and generated tokens travel back with
``loop.call_soon_threadsafe`` into an ``asyncio.Future`` or a per-request
``asyncio.Queue``::

    asyncio side                         engine thread
    submit(req) ──post(admit)──────────► add_request ─┐ (errors come back before any token)
          ◄────────future────────────────────────────┘
    queue.get() ◄──call_soon_threadsafe── step() → TokenChunk …, GenerateFinal
    consumer cancelled ──post(abort)───► abort + pop_result (pages released exactly once)

The thread runs ``step()`` while there is work and blocks on a condition when idle.

Usage accounting (``kvtier.domain.records.Usage``; P prompt tokens, C cached, G generated)::

    prompt_tokens     = P
    cached_tokens     = C: prompt tokens served from the prefix cache at first admission
                        (a whole-prompt hit reports P - 1: the last position is recomputed
                        to get logits)
    promoted_tokens   = cached tokens copied up from DRAM/NVMe before prefill (a subset of cached)
    generated_tokens  = G
    recomputed_tokens = tokens whose K/V the model computed beyond what an uninterrupted
                        run needs, i.e. beyond the uncached prompt suffix (P - C) and the
                        decode steps (G - 1; the last sampled token is never fed back):
                            max(0, computed - (P - C) - max(G - 1, 0))
                        0 unless the request was preempted (or, later, a page failed its
                        checksum) and had to rebuild K/V it once had.

Sessions: when a generation with a ``session_id`` finishes, the loop remembers that
session's namespace digest and the keys of the full pages it left cached (prompt plus
output, less the last sampled token, which is never fed back). Only the worker knows the
output pages, so the controller addresses a session's pages by session id
(Demote/Prefetch/Drop with ``session_id``) and the loop resolves them here: the longest
prefix of those keys still cached. The newest ``MAX_SESSIONS`` sessions are remembered.

Page events: the loop listens to the radix index and buffers an INSERT (parent key and
depth, tier HBM) or DROP per page, with the page's namespace digest. A radix node does
not know its namespace, so the loop keeps a side map page key → digest: a child inherits
its parent's digest; a depth-1 page is matched against the root keys of the namespaces
admitted so far (``next_key(root, tokens) == key``; one hash per known namespace).

Invalidation (DESIGN §5.3): ``epochs`` is the worker's policy-epoch table; the servicer
derives every request's digest with it, so once an epoch rises no new request reaches the
old digest. ``invalidate`` marks the admitted namespaces the new epoch makes stale and
drops their idle pages at once (leaves first; each drop is a DROP page event, which is
what removes the directory's entries). Pages a running sequence holds, and the pages
such a sequence caches when it finishes, go in background passes (at most every
``RECLAIM_INTERVAL_S`` while busy, and whenever the engine goes idle) until no page and
no sequence of a stale namespace is left.

Admin pins (``pin`` / ``unpin``, by pin id): radix pins on the listed pages the worker
holds in the pin's tier or a faster one, released exactly once: by ``unpin``, when
``expires_at_ms`` passes (checked before every step, and the idle thread wakes for it),
or when their namespace is invalidated. Pinning an id the loop already holds changes
nothing (the controller sends every pin again when the link reconnects).

Room and promotion before admission: a request whose cached prefix lies partly below HBM, or
whose admission would find too few free HBM pages, waits *outside* the engine while the loop
makes room in the background (a demotion of the coldest idle pages, the request's own pinned
meanwhile) and brings its pages up (``TierManager.start_prefetch``, or the controller's prefetch
already bringing them); it is added to the engine once both are done (at most
``MAX_ADMISSION_WAIT_S``; after that, or when nothing can leave HBM, the engine makes room and
promotes on admission, as before). The engine thread never waits on those copies, so running
sequences keep decoding and other requests keep being admitted: a transfer on the request path
costs its own request, not every request behind it. With an emulated GPU link (decision 0011) a
13 MiB NVMe promotion takes ~200 ms and a spill ~16 ms a page; done on the engine thread they
stalled every resume behind them (quick NVMe run: 2.5-5.4 s of spills per run, resumes that
moved nothing took 1.9 s). One request's room-making or promotion runs at a time, in arrival
order, as the synchronous path did: concurrent ones would share the link and all finish late.
Its pages are reported as promoted tokens (and its wait as promotion wait), as a promotion on
admission would be. A commanded Prefetch likewise waits for room made in the background before
its pages come up (at most ``MAX_PREFETCH_ROOM_WAIT_S``); its ack comes once they are applied.
When the coldest idle pages cannot make the room, session holds yield it, the weakest first
(``_hold_session``), except a hold whose session is due back within ``HOLD_DUE_SOON_S``: the
request waits for that session's turn to come and go (at most ``HOLD_DEFER_S``), since its whole
context would otherwise come back up on the request path. A request counts the pages promised
to the requests the engine has yet to admit (``_backlog_pages``): a burst measured against the
same free pages would otherwise take its room from holds on the engine thread, whatever their
rank. The wait is logged with the generation (``admission_wait_ms``; of it, ``hold_wait_ms``
waited for holds due back soon, also the ``kvtier.hold_deferral_wait`` metric). These waits are
fixed in seconds; ``WorkerConfig.wait_scale`` multiplies them all, for an engine whose turns
take that much longer than the ones they were tuned on (a benchmark played slower to fit a
slower machine: ``loadtests.agent_workload --slow-down``). A hold that
yielded (or was displaced, or refused at the cap) is retaken once HBM has free room again and
nothing waits for it, before its session is back (``_retake``). Neither a prefetch nor a
request takes its room from its own session's hold.

Quotas and TTLs (``kvtier.cache.quotas``, ``kvtier.cache.ttls``): the engine enforces them before each
step; while idle the loop runs the same bounded pass and wakes for the next TTL deadline.
Pages they demote or drop leave as MOVE / DROP page events, like any other.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from opentelemetry.context import Context

from kvtier.cache.epochs import EpochTable
from kvtier.cache.quotas import DEFAULT_TENANT
from kvtier.cache.radix import RadixNode
from kvtier.domain.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    KvtierError,
    NotFound,
    Unavailable,
)
from kvtier.domain.hashing import (
    NamespaceDigest,
    NamespaceIdentity,
    PageKey,
    next_key,
    page_keys,
    root_key,
    short,
)
from kvtier.domain.records import (
    GenerateEvent,
    GenerateFinal,
    GenerateRequest,
    IntegrityReport,
    IntegrityResult,
    InvalidationScope,
    InventoryPage,
    NamespaceInventory,
    PageEvent,
    PinCommand,
    PinId,
    RunId,
    SessionId,
    TierOccupancy,
    TokenChunk,
    TokensByTier,
    Usage,
)
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine, GenerationResult, StepOutput
from kvtier.runtime import tracing
from kvtier.runtime.config import MAX_WAIT_SCALE
from kvtier.runtime.log import get_logger, redact_tokens
from kvtier.tiers.manager import TierManager
from kvtier.tiers.moves import MoveOutcome, MoveTicket
from kvtier.tiers.transfer import TransferDone, TransferReason

if TYPE_CHECKING:
    from kvtier.worker.metrics import WorkerMetrics

log = get_logger("kvtier.worker.engine")

T = TypeVar("T")

# Page events waiting for the WorkerLink. Beyond this (no controller connected for a
# long time) the buffer is dropped and the link sends a full snapshot instead.
MAX_BUFFERED_PAGE_EVENTS = 1 << 16
# Session holds (_hold_session): their pin ids, and the share of HBM they may keep together.
HOLD_PREFIX = "session-hold/"
# What became of session holds (``EngineLoop.hold_outcomes``, the ``kvtier.session_holds``
# metric): taken; not taken because none of the session's pages was in HBM or the worker is
# draining (``unheld``), or holds were at their cap and all were due back sooner (``refused``);
# released early for a hold due back sooner (``displaced``) or for room needed now
# (``yielded``); taken again, its pages brought back up if they had left, once HBM had room
# (``retaken``: ``_retake``).
HOLD_OUTCOMES = ("taken", "unheld", "refused", "displaced", "yielded", "retaken")
# The default of ``WorkerConfig.session_hold_fraction`` (an EngineLoop built without one).
MAX_HELD_FRACTION = 1.0
# When step() makes no progress (nothing admissible, e.g. the pool is full of pinned
# pages) the thread waits this long for news instead of spinning.
STALLED_WAIT_S = 0.005
# Counting pinned pages is O(pool); publish the load for heartbeats at most this often
# while busy (and always when the engine goes idle).
LOAD_PUBLISH_INTERVAL_S = 0.05
# Sessions whose last generation's pages the loop remembers (least recently finished go first).
MAX_SESSIONS = 1 << 16
# While stale namespaces still have pages and the engine is busy, look for idle ones this often.
RECLAIM_INTERVAL_S = 0.05
# A request waiting outside the engine for its pages to come up (module doc) is added anyway
# after this long; what is still below is then promoted on admission.
MAX_ADMISSION_WAIT_S = 5.0
# A commanded prefetch waits at most this long for room made in the background; then it makes
# room on the engine thread, as before.
MAX_PREFETCH_ROOM_WAIT_S = 1.0
# A commanded demotion waits at most this long for the pages it asks for that are already on
# their way down (``_demote``); then the rest go as they can.
MAX_DEMOTE_WAIT_S = 0.5
# A request waiting for room does not take it from a session hold due back within
# HOLD_DUE_SOON_S: it waits (at most HOLD_DEFER_S) for that session's turn to come and go.
HOLD_DUE_SOON_S = 1.0
HOLD_DEFER_S = 2.0
# How such a wait ended (``EngineLoop.hold_deferrals``; the ``outcome`` of the
# ``kvtier.hold_deferral_wait`` metric): the room came without displacing those holds (``room``:
# their sessions' turns came and went, or other pages freed), or HOLD_DEFER_S ran out and a hold
# yielded as before (``timed_out``).
HOLD_DEFERRAL_OUTCOMES = ("room", "timed_out")


def new_run_id() -> RunId:
    return RunId(uuid.uuid4().hex[:16])


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


@dataclass(frozen=True, slots=True)
class DropOutcome:
    """Result of ``drop_pages``: pages removed, and pages kept because a sequence holds
    them (or a descendant) or they are pinned."""

    num_dropped: int
    num_kept: int
    num_missing: int


@dataclass(frozen=True, slots=True)
class PageCounts:
    """Pages an operation handled now, and pages it left alone (``num_kept``)."""

    num_done: int
    num_kept: int


@dataclass(frozen=True, slots=True)
class ExpectedReturn:
    """When a held session is expected back (wall-clock ms): the median of its predicted
    return (``due_at_ms``, the Prefetch's ``return_in_ms``) and, when the controller sent them
    (``away_ms``, ``return_spread``), when its pause began and the spread of the prediction
    (sigma of ln duration)."""

    due_at_ms: float
    away_since_ms: float | None = None
    spread: float | None = None

    def rank_ms(self, now_ms: float) -> float:
        """When the session is expected back, as of ``now_ms``: the median of its return given
        that it has not returned yet. Before ``due_at_ms`` that is barely later than the median
        (a session prefetched at its 5 % point: 1.03 x the median pause for sigma 0.4); past
        it, it moves out with the tail (at 1.2 x the median pause, sigma 0.4: 1.48 x). Without
        the spread, ``due_at_ms``: an overdue session would stay the first expected back,
        keeping its hold over sessions due in a second, until its hold lapsed (decision 0008,
        revision 9)."""
        if self.away_since_ms is None or self.spread is None:
            return self.due_at_ms
        median = self.due_at_ms - self.away_since_ms
        return self.away_since_ms + conditional_median_ms(median, now_ms - self.away_since_ms, self.spread)


_UNIT_NORMAL = NormalDist()


def conditional_median_ms(median_ms: float, elapsed_ms: float, sigma: float) -> float:
    """Median of a log-normal duration (median ``median_ms``, sigma ``sigma`` of its log) given
    that it has lasted ``elapsed_ms`` already: the point where the survival is half of what it
    is now."""
    if median_ms <= 0.0 or elapsed_ms <= 0.0 or sigma <= 0.0:
        return max(median_ms, elapsed_ms)
    z = math.log(elapsed_ms / median_ms) / sigma
    if z < 6.0:
        z_half = _UNIT_NORMAL.inv_cdf(1.0 - (1.0 - _UNIT_NORMAL.cdf(z)) / 2.0)
    else:  # the survival is under 1e-9: a double cannot halve it, its tail can (ln S ~ -z^2 / 2)
        z_half = math.sqrt(z * z + 2.0 * math.log(2.0))
    return max(elapsed_ms, median_ms * math.exp(sigma * z_half))


@dataclass(slots=True, eq=False)
class _Pin:
    digest: NamespaceDigest
    nodes: list[RadixNode]  # the pinned nodes, one radix pin each
    expires_at_ms: int | None
    # Session holds: when the session is expected back (from the Prefetch), and how many of its
    # pages the prefetch behind it brought up.
    expected: ExpectedReturn | None = None
    num_moved: int = 0

    def hold_rank(self) -> float:
        """A session hold's claim on HBM, strongest (lowest) first: the session expected back
        first (without an expected return, the hold lapsing first). Whether the prefetch behind
        it copied pages up does not count: a page that leaves HBM goes back onto its copy below
        without a write (decision 0012), so a yielded hold costs one promotion whoever paid for
        the last one."""
        return _hold_rank(self.expected, self.expires_at_ms)


def _hold_rank(expected: ExpectedReturn | None, expires_at_ms: float | None) -> float:
    """``_Pin.hold_rank`` of a hold expected back as ``expected`` says, lapsing at ``expires_at_ms``."""
    if expected is not None:
        return expected.rank_ms(time.time() * 1000.0)
    return float("inf") if expires_at_ms is None else float(expires_at_ms)


@dataclass(frozen=True, slots=True)
class SessionPages:
    """The pages a session's last finished generation left cached (root first)."""

    namespace_digest: NamespaceDigest
    page_keys: tuple[PageKey, ...]


@dataclass(slots=True)
class _Prefetched:
    """Pages brought up into HBM for a session due back (commanded prefetches, retakes) since its
    last generation finished: their keys, and how many page moves that took (a page that went
    down and came up again moved twice)."""

    keys: set[PageKey] = field(default_factory=set)
    num_moved: int = 0


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
    # Promotion before admission (module doc): the prompt's full-page keys, when it waits.
    page_keys: list[PageKey] | None = None
    waiting_since: float = 0.0
    promotion: MoveTicket | None = None  # the loop's own prefetch for it
    below_hbm: dict[PageKey, Tier] = field(default_factory=dict)  # its pages' tier when seen below
    promoted_tokens_by_tier: dict[Tier, int] = field(default_factory=dict)  # brought up before admission
    promotion_wait_s: float = 0.0  # waited for them before admission
    admission_wait_s: float = 0.0  # waited outside the engine, for pages or room
    deferred_at: float | None = None  # began waiting for holds due back soon (HOLD_DUE_SOON_S)
    hold_wait_s: float = 0.0  # of admission_wait_s, waited for such holds' sessions
    pinned: RadixNode | None = None  # its deepest HBM page while it waits for room
    digest: NamespaceDigest | None = None  # of its namespace, from admission on


@dataclass(slots=True)
class _Inbox:
    ops: deque[Callable[[], None]] = field(default_factory=deque)
    is_stopping: bool = False  # the thread should finish
    is_closed: bool = False  # the thread has finished; nothing posted will run


class EngineLoop:
    """Owns ``engine`` on one thread; the asyncio side talks to it through ``submit`` and
    the ``async`` query methods. Start with ``start()``; stop with ``await close()``."""

    def __init__(
        self,
        engine: Engine,
        *,
        name: str = "kvtier-engine",
        on_failure: Callable[[BaseException], None] | None = None,
        hold_fraction: float | None = None,
        wait_scale: float = 1.0,
    ) -> None:
        if hold_fraction is not None and not _in_range(hold_fraction, 1.0):
            raise InvalidArgument(
                f"session_hold_fraction must be in (0, 1], got {hold_fraction!r}", field="session_hold_fraction"
            )
        if not _in_range(wait_scale, MAX_WAIT_SCALE):
            raise InvalidArgument(
                f"wait_scale must be in (0, {MAX_WAIT_SCALE:g}], got {wait_scale!r}", field="wait_scale"
            )
        self.engine = engine
        # Share of HBM session holds may keep together (``hold_cap_pages``); None: the default.
        self._hold_fraction = hold_fraction
        # Multiplies the fixed waits (MAX_ADMISSION_WAIT_S, MAX_PREFETCH_ROOM_WAIT_S,
        # MAX_DEMOTE_WAIT_S, HOLD_DUE_SOON_S, HOLD_DEFER_S): ``WorkerConfig.wait_scale``.
        self._wait_scale = float(wait_scale)
        self._name = name
        self._on_failure = on_failure
        # Set by the server when the process exports metrics (kvtier.worker.metrics).
        self.metrics: WorkerMetrics | None = None
        # Attributes of every ``generate`` span (kvtier.runtime.tracing), e.g. the worker id.
        self.span_attributes: dict[str, str] = {}
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.is_draining = False
        # The worker's policy epochs (asyncio side): the servicer applies them to every request.
        self.epochs = EpochTable()
        # Counters, written by the engine thread (metrics and tests read them).
        self.num_finished = 0
        self.num_cancelled = 0
        # ---- engine thread only
        self._runs: dict[str, _Run] = {}
        self._awaiting: dict[str, _Run] = {}  # waiting for their pages before admission (module doc)
        # Commanded prefetches waiting for room (``_prefetch``) and demotions waiting for pages on
        # their way down (``_demote``): a retry and the caller's future.
        self._deferred: list[tuple[Callable[[], None], asyncio.Future[MoveOutcome]]] = []
        self._key_digest: dict[PageKey, NamespaceDigest] = {}
        self._roots: dict[NamespaceDigest, PageKey] = {}
        self._sessions: OrderedDict[SessionId, SessionPages] = OrderedDict()
        self._identities: dict[NamespaceDigest, NamespaceIdentity] = {}  # of admitted namespaces
        self._stale: set[NamespaceDigest] = set()  # invalidated, pages or sequences left
        self._reclaim_due = False  # a stale namespace's sequence ended, or pages were in transit
        self._reclaimed_at = 0.0
        self._pins: dict[PinId, _Pin] = {}
        # Session holds released or refused before their session came back, by session: taken
        # again when HBM has room (``_retake``).
        self._lapsed: dict[SessionId, _Pin] = {}
        # Counts per HOLD_OUTCOMES (engine thread writes; the keys never change, so a scrape
        # may read them from another thread).
        self.hold_outcomes: dict[str, int] = dict.fromkeys(HOLD_OUTCOMES, 0)
        # Brought back up by ``_retake``, and of those, pages a prefetch had brought up before
        # (they went down unused: prefetched bytes wasted once).
        self.retaken_pages = self.retaken_waste_pages = 0
        # Pages brought up for sessions due back, by session (``_note_prefetched``), settled when
        # the session's next request arrives (``_settle_prefetched``): the page moves counted as
        # ``session_prefetched_pages``, and those not in HBM when it arrived, or moved up more
        # than once, as ``session_prefetch_wasted_pages``. Exact, where the controller's waste is
        # judged from the directory, which lags (decision 0008, revision 15).
        self._prefetched: dict[SessionId, _Prefetched] = {}
        self._awaited: dict[PageKey, SessionId] = {}  # those pages, until their session settles
        self.session_prefetched_pages = self.session_prefetch_wasted_pages = 0
        # Requests that waited for holds due back soon, by HOLD_DEFERRAL_OUTCOMES, and their
        # waits in all (``_end_deferral``).
        self.hold_deferrals: dict[str, int] = dict.fromkeys(HOLD_DEFERRAL_OUTCOMES, 0)
        self.hold_deferral_wait_s = 0.0
        # Pages session holds keep in HBM (their chains, shared ones once), as of the last load
        # measurement: at their cap (``hold_cap_pages``) for long, HBM is short for the
        # sessions due back (decision 0008, revision 5).
        self.num_held_pages = 0
        # Session holds yield before a running sequence is preempted (``_yield_hold``).
        self.engine.scheduler.release_pin = self._yield_hold
        # Commanded moves in flight (Demote / Prefetch): their futures resolve when applied.
        self._moves: set[asyncio.Future[MoveOutcome]] = set()
        # ---- shared, under _events_lock
        self._events_lock = threading.Lock()
        self._events: list[PageEvent] = []
        self._events_lost = False
        self._load = self._measure_load()
        self._load_at = time.monotonic()
        engine.index.on_insert.append(self._on_insert)
        engine.index.on_remove.append(self._on_remove)
        engine.index.on_move.append(self._on_move)
        if engine.tiers is not None:
            engine.tiers.transfers.on_done = self._transfer_done
        # Pages indexed before the loop existed (restored from NVMe at start-up) carry their
        # namespace: learn them, so the first snapshot lists them and the directory routes to them.
        for node in sorted(engine.index.nodes(), key=lambda n: n.depth):
            digest = self._digest_of(node)
            if digest is not None:
                self._key_digest[node.key] = digest
                self._roots.setdefault(digest, root_key(digest))

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

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
    ) -> AsyncIterator[GenerateEvent]:
        """Generate for ``request``: ``TokenChunk`` events, then exactly one ``GenerateFinal``.

        Admission errors (``InvalidArgument``, ``ResourceExhausted``) raise on the first
        ``__anext__``, before any token. Closing or cancelling the iterator aborts the
        request in the engine; its pages are released exactly once. Use it under
        ``contextlib.aclosing`` so that an early exit closes it at once. ``trace_parent``
        parents the request's spans when tracing is on (``kvtier.runtime.tracing``).
        """
        if self.is_draining:
            raise Unavailable("this worker is draining and admits no new requests; route to another worker")
        aloop = asyncio.get_running_loop()
        run = _Run(
            run_id=new_run_id(),
            request=request,
            loop=aloop,
            queue=asyncio.Queue(),
            submitted_at=time.perf_counter(),
            trace_parent=trace_parent,
        )
        try:
            await self._call(lambda: self._admit(run))
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

    # ---- queries (each runs on the engine thread, so it sees a consistent state) ------
    async def check_integrity(self) -> IntegrityResult:
        return await self._call(self._check_integrity)

    async def stats(self) -> EngineLoad:
        return await self._call(self._measure_load)

    @property
    def hold_cap_pages(self) -> float:
        """HBM pages session holds may keep together: ``hold_fraction`` of HBM, by default
        ``MAX_HELD_FRACTION`` (``WorkerConfig.session_hold_fraction``)."""
        fraction = MAX_HELD_FRACTION if self._hold_fraction is None else self._hold_fraction
        return fraction * self.engine.pool.num_pages

    @property
    def latest_load(self) -> EngineLoad:
        """The load as of at most ``LOAD_PUBLISH_INTERVAL_S`` ago; never waits for the engine."""
        return self._load

    async def inventory(self, *, reset_page_events: bool = False) -> list[NamespaceInventory]:
        """Every cached page by namespace and tier, parents before children.

        With ``reset_page_events`` the buffered page events are discarded in the same
        engine-thread step: the inventory already reflects them (a snapshot replaces them).
        """
        return await self._call(lambda: self._inventory(reset_page_events))

    async def drop_pages(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], *, whole_namespace: bool = False
    ) -> DropOutcome:
        """Remove ``keys`` and their descendants (or every page of the namespace) from the
        cache where no sequence holds them and no pin keeps them."""
        return await self._call(lambda: self._drop_pages(digest, keys, whole_namespace))

    async def demote(
        self,
        digest: NamespaceDigest,
        keys: tuple[PageKey, ...],
        session: SessionId | None,
        dst: Tier,
        *,
        whole_namespace: bool = False,
    ) -> MoveOutcome:
        """Move idle pages down to ``dst``: the listed ones and their descendants, the
        session's, or the whole namespace's. Held and pinned pages stay. Returns once the
        pages are there (``start_demote`` returns once the transfers are submitted)."""
        return await (await self.start_demote(digest, keys, session, dst, whole_namespace=whole_namespace))

    async def start_demote(
        self,
        digest: NamespaceDigest,
        keys: tuple[PageKey, ...],
        session: SessionId | None,
        dst: Tier,
        *,
        whole_namespace: bool = False,
    ) -> asyncio.Future[MoveOutcome]:
        """Submit ``demote``'s transfers; the engine keeps stepping while they run. The
        returned future resolves with the outcome once they are applied to the index."""
        done: asyncio.Future[MoveOutcome] = asyncio.get_running_loop().create_future()
        await self._call(lambda: self._demote(digest, keys, session, dst, whole_namespace, done))
        return done

    def _demote(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None, dst: Tier,
        whole_namespace: bool, done: asyncio.Future[MoveOutcome], since: float | None = None,
        leaving: frozenset[PageKey] = frozenset(),
    ) -> None:
        """``start_demote`` on the engine thread. Pages already on their way down (a watermark
        demotion that took them a moment before: a session's turn just finished, its Pause's
        Demote comes next) are waited for, at most ``MAX_DEMOTE_WAIT_S``, and counted as moved
        once they are there: they went where the command sends them. Demoted at once, they would
        be skipped, and so would every page above them (a page leaves HBM only after its
        children), so a park found nothing to move and the controller kept the session in HBM
        for its whole pause, holding it (decision 0008, revision 14)."""
        nodes = self._demote_targets(digest, keys, session, whole_namespace)
        now = time.monotonic()
        since = now if since is None else since
        going = frozenset(n.key for n in nodes if n.tier is Tier.HBM and n.moving)
        if going and now - since < MAX_DEMOTE_WAIT_S * self._wait_scale:
            self._defer(lambda: self._demote(
                digest, keys, session, dst, whole_namespace, done, since, leaving | going), done)
            return
        ticket = self._tiers().start_demotion(nodes, dst)
        ticket.num_moved += sum(n.key in leaving and n.tier >= dst for n in nodes)  # landed meanwhile
        self._track(ticket, done)

    async def invalidate(self, scope: InvalidationScope, epoch: int) -> PageCounts:
        """Mark the admitted namespaces ``scope`` makes stale at ``epoch`` and drop their idle
        pages now; the rest (``num_kept``) go in background passes. Install the epoch in
        ``epochs`` first, so no new request reaches the stale digests."""
        return await self._call(lambda: self._invalidate(scope, epoch))

    async def pin(self, command: PinCommand) -> PageCounts:
        """Pin the listed pages held in ``command.tier`` or faster (``num_kept``: the rest)."""
        return await self._call(lambda: self._pin(command))

    async def unpin(self, pin_id: PinId) -> int:
        """Release a pin; the number of pages released (0 for an unknown or lapsed pin)."""
        return await self._call(lambda: self._release_pin(pin_id))

    async def prefetch(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None,
        *, hold_s: float | None = None, due_s: float | None = None, away_s: float | None = None,
        spread: float | None = None,
    ) -> MoveOutcome:
        """Promote the listed (or the session's) lower-tier pages into HBM, cached and idle;
        a session's are held there up to ``hold_s`` seconds (``_hold_session``), ranked by
        when the session is expected back: in ``due_s`` (the prediction's median), or, with
        how long it has been away (``away_s``) and the prediction's ``spread``, by the median
        of its return given it has not returned yet (``ExpectedReturn``). Returns once they
        are there (``start_prefetch`` returns once the transfers are submitted)."""
        return await (await self.start_prefetch(digest, keys, session, hold_s=hold_s, due_s=due_s,
                                                away_s=away_s, spread=spread))

    async def start_prefetch(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None,
        *, hold_s: float | None = None, due_s: float | None = None, away_s: float | None = None,
        spread: float | None = None,
    ) -> asyncio.Future[MoveOutcome]:
        """Submit ``prefetch``'s transfers; the engine keeps stepping while they run. The
        returned future resolves with the outcome once they are applied (and the hold taken).
        A draining worker refuses (``set_draining``): its sessions' next turns go elsewhere."""
        if self.is_draining:
            raise FailedPrecondition(
                "this worker is draining and takes no prefetch: the session's next turn is routed to another worker")
        done: asyncio.Future[MoveOutcome] = asyncio.get_running_loop().create_future()
        expected = None
        if due_s is not None:
            now_ms = time.time() * 1000.0
            expected = ExpectedReturn(now_ms + due_s * 1000.0)
            if away_s is not None and spread is not None:
                expected = ExpectedReturn(expected.due_at_ms, now_ms - away_s * 1000.0, spread)
        await self._call(lambda: self._prefetch(digest, keys, session, hold_s, done, expected=expected))
        return done

    async def set_draining(self, draining: bool) -> int:
        """Start (or end) a drain: no new request is admitted (``submit``) and no prefetch
        taken (``start_prefetch``) while it lasts. Starting one releases every session hold and
        forgets the lapsed ones (nothing is retaken): a hold keeps pages for a session's next
        turn, which Route now sends to another worker, and a held page is pinned, so the
        drain's drops would keep it (only an operator's pins should). Returns the holds released."""
        self.is_draining = draining
        if not draining:
            return 0
        return await self._call(self._release_holds)

    def _release_holds(self) -> int:
        holds = [pin_id for pin_id, _ in self._holds()]
        for pin_id in holds:
            self._release_pin(pin_id)
        self._lapsed.clear()
        if holds:
            log.info("session holds released for a drain", extra={"num_holds": len(holds)})
        return len(holds)

    async def drop_session(self, digest: NamespaceDigest, session: SessionId, *, drop: bool = True) -> DropOutcome:
        """Forget the session and release its hold; with ``drop``, also remove its private pages,
        deepest first (a shared prefix stays cached). Without, they stay as ordinary cache entries."""
        return await self._call(lambda: self._drop_session(digest, session, drop))

    async def session_pages(self, session: SessionId) -> SessionPages | None:
        return await self._call(lambda: self._sessions.get(session))

    def drain_page_events(self) -> list[PageEvent]:
        """Page events since the last drain, oldest first (any thread)."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def consume_page_events_lost(self) -> bool:
        """True once after the buffer overflowed: the receiver needs a full snapshot."""
        with self._events_lock:
            lost, self._events_lost = self._events_lost, False
        return lost

    # ---- posting ----------------------------------------------------------------------
    def _post(self, op: Callable[[], None]) -> bool:
        """Queue ``op`` for the engine thread; False when the thread is gone (it never runs)."""
        with self._cond:
            if self._inbox.is_closed:
                return False
            self._inbox.ops.append(op)
            self._cond.notify()
            return True

    def _call(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn`` on the engine thread; its result or exception arrives in the future."""
        if self._thread is None or self.failure is not None:
            raise self._unavailable()
        aloop = asyncio.get_running_loop()
        future: asyncio.Future[T] = aloop.create_future()

        def op() -> None:
            try:
                result = fn()
            except Exception as exc:  # handed to the awaiting coroutine
                _deliver(aloop, _set_exception, future, exc)
            else:
                _deliver(aloop, _set_result, future, result)

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
    def _tier_work_pending(self) -> bool:
        tiers = self.engine.tiers
        return tiers is not None and tiers.has_pending()

    def _main(self) -> None:
        try:
            while True:
                with self._cond:
                    while (
                        not self._inbox.ops
                        and not self._inbox.is_stopping
                        and not self.engine.has_unfinished()
                    ):
                        if self._tier_work_pending() or self._awaiting or self._deferred:
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
                if self._deferred:
                    self._retry_deferred()
                if self._awaiting:
                    self._admit_awaiting()
                if self._pins:
                    self._expire_pins()
                if not self.engine.has_unfinished():
                    self.engine.enforce_limits()  # quotas and TTLs while idle (step() runs them when busy)
                if not self.engine.has_unfinished() and (self._tier_work_pending() or self._awaiting or self._deferred):
                    # Idle, but transfers finished or are due: apply them without a request.
                    if self.engine.tiers is not None:
                        self.engine.tiers.maintain()
                    with self._cond:
                        if not self._inbox.ops and not self._inbox.is_stopping:
                            self._cond.wait(STALLED_WAIT_S)
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    if outputs:
                        self._dispatch(outputs)
                    else:
                        with self._cond:
                            if not self._inbox.ops and not self._inbox.is_stopping:
                                self._cond.wait(STALLED_WAIT_S)
                if self._lapsed and not (self._awaiting or self._deferred or self.engine.scheduler.waiting):
                    self._retake()  # after the step and the transfers it applied: room may be back
                now = time.monotonic()
                if self._stale and (not self.engine.has_unfinished() or (
                        self._reclaim_due and now - self._reclaimed_at >= RECLAIM_INTERVAL_S)):
                    self._reclaim_stale()
                    self._reclaimed_at = now
                if now - self._load_at >= LOAD_PUBLISH_INTERVAL_S or not self.engine.has_unfinished():
                    self._load, self._load_at = self._measure_load(), now
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

    def _fail_all(self, error: KvtierError) -> None:
        for run in [*self._runs.values(), *self._awaiting.values()]:
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
        # Commanded moves still in flight are never applied by this thread: their callers hear.
        for future in list(self._moves):
            _deliver(future.get_loop(), _set_exception, future, error)
        self._moves.clear()

    def _admit(self, run: _Run) -> None:
        request = run.request
        if request.session_id is not None:
            self._lapsed.pop(request.session_id, None)  # back: its own admission brings its pages up
            self._settle_prefetched(request.session_id)
        digest = run.digest = self.engine.digest_for(request.namespace)
        tiers = self.engine.tiers
        if tiers is not None and not tiers.config.simulate:
            # Checked now, so a bad request fails before any token even when it waits.
            request.sampling.validate()
            self.engine.validate_prompt(list(request.prompt_token_ids))
            keys = page_keys(digest, request.prompt_token_ids, self.engine.pool.page_size)
            chain = self._cached_chain(keys)
            if any(n.tier is not Tier.HBM for n in chain) or self._room_short(run, chain) > 0:
                run.page_keys, run.waiting_since = keys, time.monotonic()
                self._awaiting[run.run_id] = run
                self._admit_awaiting()
                return
        self._add(run, digest)

    def _cached_chain(self, keys: Sequence[PageKey]) -> list[RadixNode]:
        """Cached nodes of the longest cached prefix of ``keys`` (root first)."""
        chain: list[RadixNode] = []
        for key in keys:
            node = self.engine.index.get(key)
            if node is None:
                break
            chain.append(node)
        return chain

    def _pin_chain(self, run: _Run, chain: list[RadixNode]) -> None:
        """Pin the deepest of the request's pages in HBM (the chain above it stays) while it waits."""
        # A page on its way down stays for the pin (``TierManager.start_prefetch``: recalled).
        deepest = next((n for n in reversed(chain) if n.tier is Tier.HBM), None)
        if run.pinned is None and deepest is not None:
            self.engine.index.pin(deepest.key)
            run.pinned = deepest

    def _promotion_landed(self, run: _Run, _outcome: MoveOutcome) -> None:
        """Pages brought up for a waiting request are pinned as they land (from the transfer's
        application, before the step's watermark demotion can take them back down) until the
        engine has taken them."""
        if run.run_id in self._awaiting and run.page_keys is not None:
            self._unpin_chain(run)
            self._pin_chain(run, self._cached_chain(run.page_keys))

    def _unpin_chain(self, run: _Run) -> None:
        if run.pinned is not None:
            if self.engine.index.get(run.pinned.key) is run.pinned:
                self.engine.index.unpin(run.pinned.key)
            run.pinned = None

    def _room_short(self, run: _Run, chain: list[RadixNode]) -> int:
        """HBM pages the request's admission would have to free by spilling on the engine
        thread: the pages it allocates (promoted, new, its first output's) beyond those free to
        take (free, or clean: going back onto their copy below moves no bytes) and not already
        promised to the requests the engine has yet to admit (``_backlog_pages``)."""
        ps = self.engine.pool.page_size
        num_tokens = len(run.request.prompt_token_ids) + min(run.request.sampling.max_tokens, ps)
        return -(-num_tokens // ps) - _num_in_hbm(chain) - self._free_hbm() + self._backlog_pages()

    def _backlog_pages(self) -> int:
        """HBM pages the requests added to the engine and not yet admitted will allocate.

        Each request was added because the free pages covered it, but a burst of them was
        measured against the same free pages; the engine then admits them one by one, and the
        ones the free pages no longer cover take their room from session holds on the engine
        thread (``release_pin``: it counts held pages as idle), whatever the hold's rank. Counted
        here, such a request waits outside and its room is made in the background
        (``_make_room``), holds yielding in rank order."""
        waiting = self.engine.scheduler.waiting
        if not waiting:
            return 0
        return sum(max(seq.pages_for(seq.num_tokens + 1) - _num_in_hbm(self._cached_chain(seq.full_page_keys())), 0)
                   for seq in waiting)

    def _admit_awaiting(self) -> None:
        """Add each waiting request that has its room and its pages in HBM (module doc); for
        the first that lacks either, start a background demotion or bring its pages up (once)."""
        tiers = self.engine.tiers
        assert tiers is not None
        now = time.monotonic()
        # One request's room-making or promotion at a time, in arrival order: concurrent ones
        # share the link and all finish late; one after the other, the first waits only for its own.
        is_promoting = any(r.promotion is not None and not r.promotion.is_done for r in self._awaiting.values())
        has_lower = self._lower_tier() is not None
        for run in list(self._awaiting.values()):
            assert run.page_keys is not None
            chain = self._cached_chain(run.page_keys)
            below = [n for n in chain if n.tier is not Tier.HBM]
            for node in below:
                run.below_hbm.setdefault(node.key, node.tier)
            is_waiting = now - run.waiting_since < MAX_ADMISSION_WAIT_S * self._wait_scale
            if is_waiting and run.promotion is None and has_lower:
                # Make room first, in the background: a spill on allocation waits on the link
                # with the engine thread (module doc). One request at a time, as promotions.
                short = self._room_short(run, chain)
                if short <= 0:
                    self._end_deferral(run, now)
                else:
                    if is_promoting:
                        continue
                    # A hold due back within HOLD_DUE_SOON_S keeps its pages while this request
                    # can still wait for them (HOLD_DEFER_S): displaced, its session's next turn
                    # would promote its whole context, on the link this request's room shares.
                    deferring = now - run.waiting_since < HOLD_DEFER_S * self._wait_scale
                    spared = time.time() * 1000.0 + HOLD_DUE_SOON_S * self._wait_scale * 1000.0 if deferring else None
                    # Its own pages are not the room it makes: pinned before anything is demoted.
                    made = self._make_room(short, protect=functools.partial(self._pin_chain, run, chain),
                                           weaker_than=spared, sparing=run.request.session_id)
                    if not made and spared is not None and self._holds_due_soon(spared):
                        if run.deferred_at is None:
                            run.deferred_at = now
                        continue  # only holds due back soon are left: wait for their turns
                    self._end_deferral(run, now)
                    if made and self._room_short(run, chain) > 0:
                        is_promoting = True
                        continue  # pages on their way down: admitted once they have left
                    # The room is there now (yielded holds' pages are clean: free to take at no
                    # copy), or nothing can leave HBM: admit in this pass, not after a step.
            if below and is_waiting:
                if any(n.moving for n in below):
                    continue  # on their way up (the controller's prefetch, or ours): wait
                if run.promotion is None:
                    if is_promoting:
                        continue
                    run.promotion = tiers.start_prefetch(chain, for_request=True)
                    if not run.promotion.is_done:
                        run.promotion.on_done = functools.partial(self._promotion_landed, run)
                        is_promoting = True
                        continue
                    # Done at once: nothing could move (no room in HBM); promote on admission.
                elif not run.promotion.is_done:
                    continue
            del self._awaiting[run.run_id]
            # Its pages stay pinned until the engine has taken them (its first step): room made
            # for the next request in this pass must not take the pages just brought up for it.
            self._unpin_chain(run)
            self._pin_chain(run, chain)
            for node in chain:
                tier = run.below_hbm.get(node.key)
                if tier is not None and node.tier is Tier.HBM:
                    run.promoted_tokens_by_tier[tier] = run.promoted_tokens_by_tier.get(tier, 0) + self.engine.pool.page_size
            self._end_deferral(run, now)
            run.admission_wait_s = now - run.waiting_since
            if run.promoted_tokens_by_tier:
                run.promotion_wait_s = run.admission_wait_s
            try:
                assert run.digest is not None
                self._add(run, run.digest)
            except KvtierError as exc:
                self._emit(run, exc)

    def _end_deferral(self, run: _Run, now: float) -> None:
        """``run`` no longer waits for holds due back soon (if it did): count how the wait ended
        (HOLD_DEFERRAL_OUTCOMES; timed out once HOLD_DEFER_S has passed since it began waiting)
        and how long it took."""
        if run.deferred_at is None:
            return
        waited, run.deferred_at = now - run.deferred_at, None
        run.hold_wait_s += waited  # a request may wait for such holds more than once
        outcome = "timed_out" if now - run.waiting_since >= HOLD_DEFER_S * self._wait_scale else "room"
        self.hold_deferrals[outcome] += 1
        self.hold_deferral_wait_s += waited
        if self.metrics is not None:
            self.metrics.record_hold_deferral(waited, outcome)

    def _add(self, run: _Run, digest: NamespaceDigest) -> None:
        request = run.request
        self.engine.add_request(
            list(request.prompt_token_ids),
            request.sampling,
            request_id=run.run_id,
            priority=request.priority,
            namespace=request.namespace,
        )
        if digest not in self._roots:
            self._roots[digest] = root_key(digest)
            self._identities[digest] = request.namespace
        self._runs[run.run_id] = run
        log.info(
            "generation admitted",
            extra={
                "run_id": run.run_id,
                "request_id": request.request_id,
                "prompt": redact_tokens(request.prompt_token_ids),
                "max_tokens": request.sampling.max_tokens,
                "namespace": short(digest),
            },
        )

    def _abort(self, run: _Run) -> None:
        if self._awaiting.pop(run.run_id, None) is not None:  # never reached the engine
            self._unpin_chain(run)
            self.num_cancelled += 1
            log.info("generation cancelled before admission", extra={"run_id": run.run_id})
            return
        if self._runs.pop(run.run_id, None) is None:
            return
        self._unpin_chain(run)
        self.engine.abort(run.run_id)
        result = self.engine.pop_result(run.run_id)
        self.num_cancelled += 1
        self._run_ended(run)
        if tracing.is_enabled():
            self._record_spans(run, result, time.perf_counter())
        log.info(
            "generation cancelled",
            extra={"run_id": run.run_id, "generated_tokens": len(result.token_ids)},
        )

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            run = self._runs.get(out.request_id)
            if run is None:
                raise IntegrityError(f"the engine stepped request {out.request_id} that no run owns")
            self._unpin_chain(run)  # stepped: its sequence holds its pages now
            if out.new_token_ids:
                if run.first_token_at is None:
                    run.first_token_at = now
                self._emit(run, TokenChunk(token_ids=tuple(out.new_token_ids), index=run.num_emitted))
                run.num_emitted += len(out.new_token_ids)
            if out.finished:
                del self._runs[run.run_id]
                self.num_finished += 1
                self._run_ended(run)
                self._emit(run, self._final(run))

    def _final(self, run: _Run) -> GenerateFinal:
        result = self.engine.pop_result(run.run_id)
        # Pages brought up before admission count as the engine's own promotions (module doc).
        for tier, num in run.promoted_tokens_by_tier.items():
            result.promoted_tokens_by_tier[tier] = result.promoted_tokens_by_tier.get(tier, 0) + num
            result.num_promoted_tokens += num
        result.promotion_wait_s += run.promotion_wait_s
        num_prompt = len(result.prompt_token_ids)
        num_cached = result.num_cached_tokens
        num_generated = len(result.token_ids)
        needed = (num_prompt - num_cached) + max(num_generated - 1, 0)
        # Promotion works on whole pages; when every prompt page hit, the last prompt token
        # is recomputed, so the promoted count may exceed the cached count by up to a page.
        dram = min(result.promoted_tokens_by_tier.get(Tier.DRAM, 0), num_cached)
        nvme = min(result.promoted_tokens_by_tier.get(Tier.NVME, 0), num_cached - dram)
        usage = Usage(
            prompt_tokens=num_prompt,
            cached_tokens=num_cached,
            promoted_tokens=dram + nvme,
            recomputed_tokens=max(0, result.num_computed_tokens - needed),
            generated_tokens=num_generated,
            cached_tokens_by_tier=TokensByTier(hbm_tokens=num_cached - dram - nvme, dram_tokens=dram, nvme_tokens=nvme),
        )
        # A session's next turn here: its last turn's pages are the history this one resumes.
        resumed = run.request.session_id is not None and run.request.session_id in self._sessions
        if run.request.session_id is not None:
            self._remember_session(run, result.prompt_token_ids, result.token_ids)
        now = time.perf_counter()
        first = run.first_token_at if run.first_token_at is not None else now
        ttft_ms = (first - run.submitted_at) * 1000.0
        if self.metrics is not None:
            self.metrics.record_request(result, ttft_ms / 1000.0, now - first, resumed=resumed)
        if tracing.is_enabled():
            self._record_spans(run, result, now, usage)
        log.info(
            "generation finished",
            extra={
                "run_id": run.run_id,
                "finish_reason": result.finish_reason.value,
                "prompt_tokens": num_prompt,
                "cached_tokens": num_cached,
                "generated_tokens": num_generated,
                "recomputed_tokens": usage.recomputed_tokens,
                "num_preemptions": result.num_preemptions,
                "ttft_ms": round(ttft_ms, 2),
                "admission_wait_ms": round(run.admission_wait_s * 1000.0, 2),
                "hold_wait_ms": round(run.hold_wait_s * 1000.0, 2),
            },
        )
        return GenerateFinal(
            usage=usage, finish_reason=result.finish_reason, run_id=run.run_id, ttft_ms=ttft_ms
        )

    def _record_spans(self, run: _Run, result: GenerationResult, now: float, usage: Usage | None = None) -> None:
        """The request's spans, from the timestamps it collected (counts only, no token ids)."""
        times = tracing.GenerationTimes(
            submitted_at=run.submitted_at,
            finished_at=now,
            prefill_started_at=result.prefill_started_at,
            first_token_at=run.first_token_at,
            promotion_wait_s=result.promotion_wait_s,
        )
        attributes: dict[str, str | int] = {
            **self.span_attributes,
            "kvtier.finish_reason": result.finish_reason.value,
            "kvtier.prompt_tokens": len(result.prompt_token_ids),
            "kvtier.generated_tokens": len(result.token_ids),
            "kvtier.num_preemptions": result.num_preemptions,
        }
        if run.request.request_id:
            attributes["kvtier.request_id"] = run.request.request_id
        if run.request.session_id:
            attributes["kvtier.session_id"] = run.request.session_id
        phases: dict[str, dict[str, str | int]] = {
            "admission": {"kvtier.cached_tokens": result.num_cached_tokens},
            "prefill": {"kvtier.computed_prompt_tokens": len(result.prompt_token_ids) - result.num_cached_tokens},
            "decode": {"kvtier.generated_tokens": len(result.token_ids)},
        }
        if usage is not None:
            by_tier = usage.cached_tokens_by_tier
            phases["promote"] = {
                "kvtier.promoted_tokens": usage.promoted_tokens,
                "kvtier.dram_tokens": by_tier.dram_tokens,
                "kvtier.nvme_tokens": by_tier.nvme_tokens,
            }
        tracing.record_generation(run.run_id, times, attributes, phase_attributes=phases, parent=run.trace_parent)

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
        self.num_held_pages = len(self._held_keys()) if self._pins else 0
        counts = self.engine.pool.counts()
        hbm = TierOccupancy(
            tier=Tier.HBM,
            total_pages=counts.total,
            free_pages=counts.free,
            cached_pages=counts.cached,
            in_use_pages=counts.in_use,
            pinned_pages=counts.pinned,
            reclaimable_pages=self._free_hbm() - counts.free,
        )
        tiers = [hbm]
        manager = self.engine.tiers
        if manager is not None:
            by_tier = self.engine.index.count_by_tier()
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
        scheduler = self.engine.scheduler
        return EngineLoad(
            tiers=tuple(tiers), queue_depth=len(scheduler.waiting), num_running_seqs=len(scheduler.running),
            tenant_pages=self._tenant_pages(),
        )

    def _tenant_pages(self) -> tuple[TenantPages, ...]:
        quotas = self.engine.quotas
        if quotas is None:
            return ()
        configured = {q.tenant for q in quotas.table.quotas} - {DEFAULT_TENANT}
        keys = sorted({(tenant, tier) for tenant in configured for tier in Tier} | set(quotas.overage()))
        return tuple(TenantPages(tenant, tier, quotas.num_pages(tenant, tier), quotas.limit(tenant, tier))
                     for tenant, tier in keys)

    def _check_integrity(self) -> IntegrityResult:
        checks: list[tuple[str, Tier | None, Callable[[], None]]] = [
            ("pool", Tier.HBM, self.engine.pool.check_integrity),
            ("radix", Tier.HBM, self.engine.index.check_integrity),
            ("engine", None, self.engine.check_integrity),  # includes the DRAM/NVMe tiers
            ("engine_loop", None, self._check_runs),
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

    def _check_runs(self) -> None:
        scheduler = self.engine.scheduler
        in_engine = {seq.request_id for seq in [*scheduler.waiting, *scheduler.running]}
        if in_engine != set(self._runs):
            raise IntegrityError(
                f"{len(in_engine)} requests in the scheduler but {len(self._runs)} runs in flight "
                f"({len(in_engine - set(self._runs))} without a run, {len(set(self._runs) - in_engine)} without a request)"
            )
        missing = [node for node in self.engine.index.nodes() if node.key not in self._key_digest]
        if missing:
            raise IntegrityError(
                f"{len(missing)} cached pages have no namespace (e.g. {short(missing[0].key)})"
            )

    # ---- page events (engine thread: the index calls these) ---------------------------
    def _on_insert(self, node: RadixNode) -> None:
        digest = self._digest_of(node)
        if digest is None:
            log.error("a cached page matches no admitted namespace", extra={"page": short(node.key)})
            return
        self._key_digest[node.key] = digest
        parent_key = node.parent.key if node.parent is not None else self._roots[digest]
        self._buffer(PageEvent.insert(digest, node.key, parent_key, node.depth, node.tier))

    def _on_remove(self, node: RadixNode) -> None:
        digest = self._key_digest.pop(node.key, None)
        if digest is not None:
            self._buffer(PageEvent.drop(digest, node.key, node.tier))

    def _on_move(self, node: RadixNode, from_tier: Tier) -> None:
        digest = self._key_digest.get(node.key)
        if digest is not None:
            self._buffer(PageEvent.move(digest, node.key, node.tier, from_tier))

    def _digest_of(self, node: RadixNode) -> NamespaceDigest | None:
        if node.namespace is not None:
            return node.namespace
        if node.parent is not None:
            return self._key_digest.get(node.parent.key)
        for digest, root in self._roots.items():
            if next_key(root, node.tokens) == node.key:
                return digest
        return None

    def _buffer(self, event: PageEvent) -> None:
        with self._events_lock:
            if len(self._events) >= MAX_BUFFERED_PAGE_EVENTS:
                self._events.clear()
                self._events_lost = True
            if not self._events_lost:
                self._events.append(event)

    def _inventory(self, reset_page_events: bool) -> list[NamespaceInventory]:
        if reset_page_events:
            with self._events_lock:
                self._events.clear()
                self._events_lost = False
        groups: dict[tuple[NamespaceDigest, Tier], list[InventoryPage]] = {}
        for node in sorted(self.engine.index.nodes(), key=lambda n: n.depth):
            digest = self._key_digest.get(node.key)
            if digest is None:
                continue
            parent_key = node.parent.key if node.parent is not None else self._roots[digest]
            page = InventoryPage(page_key=node.key, parent_key=parent_key, depth=node.depth)
            groups.setdefault((digest, node.tier), []).append(page)
        return [
            NamespaceInventory(namespace_digest=digest, tier=tier, pages=tuple(pages))
            for (digest, tier), pages in groups.items()
        ]

    def _drop_pages(self, digest: NamespaceDigest, keys: tuple[PageKey, ...], whole_namespace: bool) -> DropOutcome:
        index = self.engine.index
        targets: set[PageKey] = set()
        num_missing = 0
        if whole_namespace:
            targets = {key for key, d in self._key_digest.items() if d == digest}
        for key in keys:
            if key in index and self._key_digest.get(key) == digest:
                targets.add(key)
            else:
                num_missing += 1
        if not targets:
            return DropOutcome(num_dropped=0, num_kept=0, num_missing=num_missing)
        # Descendants of a target go too; one pass in depth order finds them.
        subtree: list[RadixNode] = []
        for node in sorted(index.nodes(), key=lambda n: n.depth):
            if node.key in targets or (node.parent is not None and node.parent.key in targets):
                targets.add(node.key)
                subtree.append(node)
        num_dropped = 0
        for node in reversed(subtree):  # leaves before their parents
            if index.is_evictable(node):
                index.remove(node.key)
                num_dropped += 1
        return DropOutcome(
            num_dropped=num_dropped, num_kept=len(subtree) - num_dropped, num_missing=num_missing
        )

    # ---- invalidation and pins (engine thread) -----------------------------------------
    def _invalidate(self, scope: InvalidationScope, epoch: int) -> PageCounts:
        for digest, identity in self._identities.items():
            if identity.policy_epoch < epoch and scope.matches(identity):
                self._stale.add(digest)
        for pin_id in [p for p, pin in self._pins.items() if pin.digest in self._stale]:
            self._release_pin(pin_id)  # a stale page is worth nothing: nothing may keep it
        for session in [s for s, pin in self._lapsed.items() if pin.digest in self._stale]:
            del self._lapsed[session]
        num_dropped, num_kept = self._reclaim_stale()
        log.info("namespaces invalidated", extra={
            "policy_epoch": epoch, "num_stale_namespaces": len(self._stale),
            "num_dropped": num_dropped, "num_kept": num_kept})
        return PageCounts(num_done=num_dropped, num_kept=num_kept)

    def _run_ended(self, run: _Run) -> None:
        if self._stale and run.digest in self._stale:
            self._reclaim_due = True  # its pages are idle now (and cached, if it finished)

    def _reclaim_stale(self) -> tuple[int, int]:
        """Drop the idle pages of stale namespaces, leaves first; (dropped, left for later).

        A stale namespace is forgotten once it has no page and no sequence left (a running
        sequence caches its pages when it finishes; a later pass drops them).
        """
        index = self.engine.index
        doomed = [n for n in index.nodes() if self._key_digest.get(n.key) in self._stale]
        doomed.sort(key=lambda n: -n.depth)  # children before their parents
        num_dropped = 0
        for node in doomed:
            if node.is_leaf and index.is_evictable(node):
                index.remove(node.key)
                num_dropped += 1
        scheduler = self.engine.scheduler
        running = {seq.namespace for seq in (*scheduler.waiting, *scheduler.running)}
        running = (running | {run.digest for run in self._awaiting.values()}) & self._stale
        left = {self._key_digest[n.key] for n in doomed if n.key in self._key_digest}
        # Pages no stale sequence explains (in transit): look again soon. Otherwise the next
        # pass comes when a stale sequence ends (``_run_ended``) or the engine goes idle.
        self._reclaim_due = bool(left - running)
        for digest in self._stale - running - left:
            self._stale.discard(digest)
            self._identities.pop(digest, None)
            self._roots.pop(digest, None)
            self.engine.forget_namespace(digest)
        return num_dropped, len(doomed) - num_dropped

    def _pin(self, command: PinCommand) -> PageCounts:
        existing = self._pins.get(command.pin_id)
        if existing is not None:
            return PageCounts(num_done=len(existing.nodes), num_kept=len(command.page_keys) - len(existing.nodes))
        if command.namespace_digest in self._stale:
            return PageCounts(num_done=0, num_kept=len(command.page_keys))
        index = self.engine.index
        nodes: list[RadixNode] = []
        for key in command.page_keys:
            node = index.get(key)
            if node is None or self._key_digest.get(key) != command.namespace_digest or node.tier > command.tier:
                continue
            # A page on its way to a slower tier is pinned too: its demotion, once it lands,
            # leaves a pinned page where it was (``TierManager._apply_demotion``).
            index.pin(key)
            nodes.append(node)
        self._pins[command.pin_id] = _Pin(command.namespace_digest, nodes, command.expires_at_ms)
        return PageCounts(num_done=len(nodes), num_kept=len(command.page_keys) - len(nodes))

    def _release_pin(self, pin_id: PinId) -> int:
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return 0
        index = self.engine.index
        released = 0
        for node in pin.nodes:
            if index.get(node.key) is node and node.pins > 0:  # gone with a failed checksum: nothing to release
                index.unpin(node.key)
                released += 1
        return released

    def _expire_pins(self) -> None:
        now_ms = time.time() * 1000.0
        for pin_id in [p for p, pin in self._pins.items()
                       if pin.expires_at_ms is not None and pin.expires_at_ms <= now_ms]:
            released = self._release_pin(pin_id)
            log.info("pin expired", extra={"pin_id": pin_id, "num_released": released})

    def _idle_wait_s(self) -> float | None:
        """Seconds until a timed pin lapses or quota / TTL work is due (None: nothing timed)."""
        waits = [w for w in (self._pin_wait_s(), self.engine.limits_wait_s()) if w is not None]
        return min(waits) if waits else None

    def _pin_wait_s(self) -> float | None:
        """Seconds until the next pin lapses (None: no timed pin), so the idle thread wakes for it."""
        deadlines = [p.expires_at_ms for p in self._pins.values() if p.expires_at_ms is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) / 1000.0 - time.time())

    # ---- sessions (engine thread) ------------------------------------------------------
    def _track(
        self, ticket: MoveTicket, done: asyncio.Future[MoveOutcome], then: Callable[[], None] | None = None
    ) -> None:
        """Resolve ``done`` with ``ticket``'s outcome once it is applied (the engine thread
        polls transfers at every step and while idle), after running ``then``."""
        def finish(outcome: MoveOutcome) -> None:
            self._moves.discard(done)
            if then is not None:
                then()
            _deliver(done.get_loop(), _set_result, done, outcome)

        if ticket.is_done:
            finish(ticket.outcome)
        else:
            self._moves.add(done)
            ticket.on_done = finish

    def _prefetch(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None, hold_s: float | None,
        done: asyncio.Future[MoveOutcome], since: float | None = None, *, expected: ExpectedReturn | None = None,
    ) -> None:
        chain = self._resolve(digest, keys, session)
        # Room first, in the background (module doc): the pages coming up need free HBM pages,
        # and taking them by spilling would hold the engine thread on the link.
        now = time.monotonic()
        since = now if since is None else since
        rank = None  # the hold the pages will have: only weaker holds yield to them
        if session is not None and hold_s:
            rank = _hold_rank(expected, time.time() * 1000.0 + hold_s * 1000.0)
        if now - since < MAX_PREFETCH_ROOM_WAIT_S * self._wait_scale and self._needs_room(
            sum(n.tier is not Tier.HBM for n in chain), rank=rank, session=session
        ):
            self._defer(lambda: self._prefetch(digest, keys, session, hold_s, done, since, expected=expected), done)
            return
        ticket = self._tiers().start_prefetch(chain, spared=self._spared(rank))
        if session is None:
            self._track(ticket, done)
            return
        pages = self._sessions.get(session)

        def landed() -> None:
            # Not once the session's next generation has finished (it released the hold and
            # cached its pages as usual) or the session ended meanwhile.
            if self._sessions.get(session) is not pages:
                return
            self._note_prefetched(session, ticket.promoted)
            if hold_s:
                self._hold_session(digest, session, chain, hold_s, num_moved=ticket.outcome.num_moved,
                                   expected=expected)

        self._track(ticket, done, landed)

    def _needs_room(self, num_pages: int, *, rank: float | None = None, session: SessionId | None = None) -> bool:
        """Fewer than ``num_pages`` HBM pages free to take (free, or clean: ``_free_hbm``), and room
        for them on its way (``_make_room``; ``rank``: that of the hold the pages will have, so only
        weaker holds yield to them, and pages brought up for sessions due back no later are not
        free to take: ``TierManager.start_prefetch``; ``session``: whose pages they are, so its own
        hold never yields to them)."""
        short = num_pages - self._free_hbm(sparing=rank)
        return short > 0 and self._make_room(short, weaker_than=rank, sparing=session)

    def _free_hbm(self, *, sparing: float | None = None) -> int:
        """HBM pages free to take at no copy: free, or idle with an intact copy below
        (``TierManager.num_reclaimable``; ``sparing``: for a prefetch of that hold rank)."""
        tiers = self.engine.tiers
        if tiers is None:
            return self.engine.pool.num_free
        return tiers.num_reclaimable() - (0 if sparing is None else self._num_spared(sparing))

    def _num_spared(self, rank: float) -> int:
        """Clean HBM pages a prefetch of hold rank ``rank`` may not take: those brought up for a
        session due back no later (``TierManager.start_prefetch``)."""
        tiers, index = self._tiers(), self.engine.index
        nodes = (index.get(key) for key in self._spared(rank))
        return sum(1 for node in nodes if node is not None and tiers.is_clean(node))

    def _lower_tier(self) -> Tier | None:
        tiers = self._tiers()
        return next((t for t in (Tier.DRAM, Tier.NVME) if tiers.is_usable(t)), None)

    def _make_room(
        self, short: int, *, protect: Callable[[], None] | None = None, weaker_than: float | None = None,
        sparing: SessionId | None = None,
    ) -> bool:
        """Free ``short`` HBM pages in the background: True when pages already leaving HBM
        cover them or a demotion started (``protect`` runs first); False when nothing can
        leave HBM now.

        The coldest idle pages go first. When they are not enough, session holds yield, the
        weakest first (``_Pin.hold_rank``: the session due back last): a hold is a prediction,
        the pages asked for are needed now (a request waiting for admission) or sooner (a
        prefetch for a session due back first: only holds weaker than ``weaker_than``, a
        ``_Pin.hold_rank``, yield to it), and never the hold of the session they are for,
        ``sparing`` (a top-up's prediction can rank a hair before the one its session is held
        by, and that hold then yielded the pages the top-up was keeping; a request's own pages
        are pinned by ``protect``, so its hold frees nothing)."""
        tiers = self._tiers()
        more = short - tiers.num_leaving(Tier.HBM)  # pages on their way out free room too
        if more <= 0:
            return True
        lower = self._lower_tier()
        if lower is None:
            return False
        if protect is not None:
            protect()
        freed = tiers.demote(Tier.HBM, lower, more, TransferReason.WATERMARK, dirty_only=True)
        started, more = freed > 0, more - freed
        # A dirty-only demotion leaves the count as it is (its pages have no copy below, and the
        # clean pages above them stay behind them while they move): a yield's gain is its own.
        before = tiers.num_reclaimable() if more > 0 else 0
        while more > 0:
            if not self._yield_hold(weaker_than, sparing=sparing):
                break
            after = tiers.num_reclaimable()
            gained, before = after - before, after  # its clean pages are free to take now
            more -= gained
            freed = tiers.demote(Tier.HBM, lower, more, TransferReason.WATERMARK, dirty_only=True) if more > 0 else 0
            if freed == 0 and gained == 0:
                break  # the tier below is full, or the pages are on a move already
            started, more = True, more - freed
        return started

    def _holds_due_soon(self, before_ms: float) -> bool:
        """Whether a session hold ranks at or before ``before_ms`` (``_Pin.hold_rank``) for a
        session not back yet or running its turn (its hold ends with it); the hold of a session
        whose request waits for room too does not count: that request would wait for itself."""
        here = {_hold_id(r.request.session_id) for r in self._awaiting.values() if r.request.session_id}
        return any(pin_id not in here and pin.hold_rank() <= before_ms for pin_id, pin in self._holds())

    def _holds(self) -> Iterator[tuple[PinId, _Pin]]:
        """The session holds that pin a page (admin pins aside)."""
        return ((pin_id, pin) for pin_id, pin in self._pins.items() if pin_id.startswith(HOLD_PREFIX) and pin.nodes)

    def _yield_hold(self, weaker_than: float | None = None, *, sparing: SessionId | None = None) -> bool:
        """Release the weakest session hold (``_Pin.hold_rank``; only one weaker than
        ``weaker_than`` when given, and not ``sparing``'s); False when none may yield. Also the
        scheduler's ``release_pin``: a hold is a prediction, a preemption recomputes for
        certain."""
        own = None if sparing is None else _hold_id(sparing)
        holds = [(pin.hold_rank(), pin_id) for pin_id, pin in self._holds() if pin_id != own]
        holds = [h for h in holds if weaker_than is None or h[0] > weaker_than]
        if not holds:
            return False
        pin_id = max(holds)[1]
        self._lapse(pin_id)
        self.hold_outcomes["yielded"] += 1
        log.info("session hold yielded", extra={"pin_id": pin_id})
        return True

    def _lapse(self, pin_id: PinId) -> None:
        """Release a session hold before its session is back (yielded or displaced), remembering
        it for ``_retake``."""
        pin = self._pins.get(pin_id)
        if pin is not None:
            self._lapsed[SessionId(pin_id.removeprefix(HOLD_PREFIX))] = pin
            self._release_pin(pin_id)

    def _retake(self) -> None:
        """Hold again the sessions whose holds went before they were back (``_lapsed``), the one
        due back first first, bringing their pages back up if they left, while HBM has free room.

        A hold yields or is displaced for room needed then (a request being admitted, a session
        due back sooner); the prediction behind it still stands. Without this, the session's
        next turn promotes its pages on arrival, as if nothing had been prefetched, though the
        room usually comes back within a turn or two: the turns that took it finish and are
        parked. Bounded on every side, so it cannot thrash: it runs only while no request waits
        for room, no admitted one waits for its first pages and no commanded prefetch is
        deferred (all come first); it uses free pages only, and leaves the HBM watermark's low
        mark free (so no idle page is pushed out, and the next admission finds room); it stays
        within the holds' cap; and it stops at the time the hold would have lapsed (the session
        is overdue then: no longer a prediction). The pages it moves are counted
        (``retaken_pages``), and apart those a prefetch had brought up before
        (``retaken_waste_pages``): the controller, which sees the pages in HBM at the session's
        next Route, cannot tell that they went down unused in between. Decision 0008,
        revision 4."""
        tiers = self.engine.tiers
        if tiers is None:  # no tier to bring pages back from (holds need one: none can be here)
            self._lapsed.clear()
            return
        pool = self.engine.pool
        reserve = (1.0 - tiers.config.hbm_watermark.low) * pool.num_pages
        if pool.num_free < reserve:
            return  # the common case while HBM is crowded: nothing to look at
        room = self.hold_cap_pages
        held = self._held_keys()
        now_ms = time.time() * 1000.0
        for session, pin in sorted(self._lapsed.items(), key=lambda item: item[1].hold_rank()):
            pages = self._sessions.get(session)
            if pages is None or pages.namespace_digest != pin.digest or (pin.expires_at_ms or 0) <= now_ms:
                del self._lapsed[session]
                continue
            chain = self._cached_chain(pages.page_keys)
            if any(n.moving and n.tier is not Tier.HBM for n in chain):
                continue  # on a move between lower tiers or up already: looked at again once it lands
            if chain and len(held) + self._num_new_held(chain[-1], held) > room:
                continue  # a smaller one may fit
            if pool.num_free - sum(n.tier is not Tier.HBM for n in chain) < reserve:
                return  # no later session takes the room before this one
            del self._lapsed[session]
            held.update(n.key for n in chain)  # its hold comes once the pages land
            ticket = tiers.start_prefetch(chain)
            self.hold_outcomes["retaken"] += 1
            log.info("session hold retaken", extra={"session_id": session, "num_pages": len(chain)})
            if ticket.is_done:
                self._hold_retaken(session, pages, pin, ticket)
            else:
                ticket.on_done = functools.partial(self._hold_retaken, session, pages, pin, ticket)

    def _hold_retaken(
        self, session: SessionId, pages: SessionPages, pin: _Pin, ticket: MoveTicket, _: MoveOutcome | None = None
    ) -> None:
        outcome = ticket.outcome
        self.retaken_pages += outcome.num_moved
        self.retaken_waste_pages += min(outcome.num_moved, pin.num_moved)
        if self._sessions.get(session) is pages:
            self._note_prefetched(session, ticket.promoted)
        hold_s = ((pin.expires_at_ms or 0) - time.time() * 1000.0) / 1000.0
        # Not once its next generation has finished or the session ended meanwhile (``_prefetch``),
        # nor over a newer hold (a prefetch the controller sent meanwhile). Pages up for the
        # session and not yet counted as wasted: those just moved, and those of the last
        # prefetch that never went down.
        if self._sessions.get(session) is pages and hold_s > 0 and _hold_id(session) not in self._pins:
            self._hold_session(pin.digest, session, self._cached_chain(pages.page_keys), hold_s,
                               num_moved=max(outcome.num_moved, pin.num_moved), expected=pin.expected)

    def _note_prefetched(self, session: SessionId, promoted: list[PageKey]) -> None:
        """Count the pages a move up for ``session`` promoted (``MoveTicket.promoted``) as
        brought up for it (``_prefetched``)."""
        if promoted:
            tally = self._prefetched.setdefault(session, _Prefetched())
            tally.keys.update(promoted)
            tally.num_moved += len(promoted)
            self._awaited.update(dict.fromkeys(promoted, session))

    def _spared(self, rank: float | None) -> frozenset[PageKey]:
        """Pages brought up for a session due back no later than hold rank ``rank`` (lower is
        sooner) and not used yet: a prefetch for a session of that rank must not take their room
        (``TierManager.start_prefetch(spared=...)``). A session's rank is its hold's
        (``_Pin.hold_rank``), held or lapsed; +inf without one. None: spares nothing."""
        if rank is None:
            return frozenset()
        ranks: dict[SessionId, float] = {}
        for session in set(self._awaited.values()):
            pin = self._pins.get(_hold_id(session)) or self._lapsed.get(session)
            ranks[session] = float("inf") if pin is None else pin.hold_rank()
        return frozenset(key for key, session in self._awaited.items() if ranks[session] <= rank)

    def _settle_prefetched(self, session: SessionId, why: Literal["arrived", "finished", "gone"] = "arrived") -> None:
        """Count the page moves that brought pages up for ``session`` since its last generation
        (``_prefetched``), and those wasted, as of ``why``:

        arrived   its next request: a page in HBM now is used, once; every other move (pages
                  below HBM again or gone, or brought up more than once) was wasted
        finished  its generation: pages that landed after its request arrived (a late
                  prefetch, which the request waited for): none wasted
        gone      the session ended, or was forgotten: all wasted
        """
        tally = self._prefetched.pop(session, None)
        if tally is None:
            return
        for key in tally.keys:
            if self._awaited.get(key) == session:
                del self._awaited[key]
        self.session_prefetched_pages += tally.num_moved
        if why == "arrived":
            index = self.engine.index
            used = sum((node := index.get(k)) is not None and node.tier is Tier.HBM for k in tally.keys)
            self.session_prefetch_wasted_pages += tally.num_moved - used
        elif why == "gone":
            self.session_prefetch_wasted_pages += tally.num_moved

    def _defer(self, retry: Callable[[], None], done: asyncio.Future[MoveOutcome]) -> None:
        """Run ``retry`` again on the loop's next pass (``_retry_deferred``); ``done`` stays a
        move in flight meanwhile (failed if the loop closes)."""
        self._moves.add(done)
        self._deferred.append((retry, done))

    def _retry_deferred(self) -> None:
        """Commanded prefetches waiting for room (``_prefetch``) and demotions waiting for pages
        already on their way down (``_demote``), in order."""
        deferred, self._deferred = self._deferred, []
        for retry, done in deferred:
            try:
                retry()
            except KvtierError as exc:  # the session or its pages went meanwhile: the caller hears
                self._moves.discard(done)
                _deliver(done.get_loop(), _set_exception, done, exc)

    def _hold_session(
        self, digest: NamespaceDigest, session: SessionId, chain: list[RadixNode], hold_s: float,
        *, num_moved: int = 0, expected: ExpectedReturn | None = None,
    ) -> None:
        """Keep a prefetched session's pages in HBM until it is back (at most ``hold_s``;
        ``expected``: when it is expected back, which ranks the hold).

        A prefetch lands ahead of the session's return; idle, and last touched before
        everything that ran since, its pages would be the first an eviction takes: brought
        up only to go down again. One pin on the deepest HBM page holds the chain above it
        (leaves leave first), in ``_pins`` under the session's hold id, so it lapses with the
        other pins, and goes when the session's next generation finishes or the session ends.

        Holds together keep at most ``hold_cap_pages`` (all of HBM by default; an operator may
        leave the rest of HBM to the turns just finished: ``session_hold_fraction``). Since a
        prefetch stopped taking the room of sessions due back sooner (revision 16 of decision
        0008), all of HBM wasted less than 70 % in five paired runs (7.7 % against 11.1 % on
        average), resumes no slower (revision 17; revisions 13-15 measured a trade before it).
        A hold is a prediction, so it yields when the room is needed for certain: a request
        waiting for admission, a prefetch for a session due back sooner (``_make_room``), a running
        sequence that would otherwise be preempted (``_yield_hold``), the weakest hold first
        (the session due back last: Belady's order, by prediction; with holds capped at 0.5 of
        HBM and no yielding, the full emulated-DRAM agent run's resume p50 was 154-231 ms over
        3 seeds, with 0.7 and yielding 39-109 ms over 6, median ~52; decision 0008). Within the
        capped room the same order holds (``_Pin.hold_rank``): a new hold displaces those of
        sessions due back later until it fits, or is not taken; a guard's hold (``num_moved``
        0: its pages never left) ranks like a prefetch's, since a page that leaves HBM goes
        back onto its copy below without a write (decision 0012; revision 3 of decision 0008
        has the numbers).
        """
        self._release_pin(_hold_id(session))
        if self.is_draining:  # a prefetch sent before the drain landed after it (``set_draining``)
            self.hold_outcomes["unheld"] += 1
            log.info("session not held: the worker is draining", extra={"session_id": session})
            return
        index = self.engine.index
        # The deepest page in HBM, on its way down or not: the pin recalls a demotion in flight
        # (a watermark demotion that took the session's idle pages just before its Pause).
        held = next((n for n in reversed(chain) if index.get(n.key) is n and n.tier is Tier.HBM), None)
        if held is None:
            self.hold_outcomes["unheld"] += 1
            log.info("session not held: none of its pages is in HBM", extra={"session_id": session})
            return
        pin = _Pin(digest, [held], round(time.time() * 1000.0 + hold_s * 1000.0), expected=expected,
                   num_moved=num_moved)
        room = self.hold_cap_pages
        # One rank per hold for this decision: an overdue hold's rank moves with the clock.
        rank = pin.hold_rank()
        ranks = {p: h.hold_rank() for p, h in self._pins.items() if p.startswith(HOLD_PREFIX)}
        weaker = sorted((p for p, r in ranks.items() if r > rank), key=ranks.__getitem__, reverse=True)  # weakest first
        displaced: list[PinId] = []
        held_keys = self._held_keys()
        while self._num_new_held(held, held_keys) + len(held_keys) > room and len(displaced) < len(weaker):
            displaced.append(weaker[len(displaced)])
            held_keys = self._held_keys(excluding=set(displaced))
        if self._num_new_held(held, held_keys) + len(held_keys) > room:
            self.hold_outcomes["refused"] += 1
            self._lapsed[session] = pin
            log.info("session not held: holds are at their cap", extra={
                "session_id": session, "num_pages": held.depth, "num_held": len(held_keys), "num_moved": num_moved})
            return
        for pin_id in displaced:
            self._lapse(pin_id)
            log.info("session hold displaced", extra={"pin_id": pin_id, "by_session_id": session})
        self.hold_outcomes["displaced"] += len(displaced)
        self.hold_outcomes["taken"] += 1
        self._lapsed.pop(session, None)  # held anew: nothing to retake
        index.pin(held.key)
        self._pins[_hold_id(session)] = pin
        log.info("session held", extra={"session_id": session, "num_pages": held.depth, "num_held": len(held_keys),
                                        "hold_ms": round(hold_s * 1000.0), "num_moved": num_moved})

    def _held_keys(self, excluding: set[PinId] | None = None) -> set[PageKey]:
        """Pages the session holds keep in HBM: each held page and its ancestors, shared ones once."""
        held: set[PageKey] = set()
        for pin_id, pin in self._holds():
            if excluding and pin_id in excluding:
                continue
            node: RadixNode | None = pin.nodes[0]
            while node is not None and node.key not in held:
                held.add(node.key)
                node = node.parent
        return held

    @staticmethod
    def _num_new_held(node: RadixNode, held: set[PageKey]) -> int:
        """Pages a hold on ``node`` adds to ``held`` (a prefix shared with a held session counts once)."""
        num = 0
        current: RadixNode | None = node
        while current is not None and current.key not in held:
            num += 1
            current = current.parent
        return num

    def _remember_session(self, run: _Run, prompt: list[int], output: list[int]) -> None:
        assert run.request.session_id is not None
        self._lapsed.pop(run.request.session_id, None)
        self._release_pin(_hold_id(run.request.session_id))  # back and done: its pages cache as usual
        digest = run.digest
        assert digest is not None
        fed = [*prompt, *output[:-1]]  # the last sampled token is never fed back: no K/V
        keys = tuple(page_keys(digest, fed, self.engine.pool.page_size))
        self._settle_prefetched(run.request.session_id, "finished")
        self._sessions[run.request.session_id] = SessionPages(digest, keys)
        self._sessions.move_to_end(run.request.session_id)
        while len(self._sessions) > MAX_SESSIONS:
            forgotten, _ = self._sessions.popitem(last=False)
            self._settle_prefetched(forgotten, "gone")

    def _tiers(self) -> TierManager:
        if self.engine.tiers is None:
            raise FailedPrecondition("this worker has no DRAM or NVMe tier; configure one to demote or prefetch")
        return self.engine.tiers

    def _resolve(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None
    ) -> list[RadixNode]:
        """Cached nodes of ``keys`` in the namespace; for a session, the longest cached
        prefix of its last generation's pages (root first)."""
        index = self.engine.index
        if session is None:
            nodes = [index.get(k) for k in keys if self._key_digest.get(k) == digest]
            return [n for n in nodes if n is not None]
        pages = self._sessions.get(session)
        if pages is None or pages.namespace_digest != digest:
            raise NotFound(f"this worker finished no generation for session {session!r} in that namespace",
                           field="session_id")
        return self._cached_chain(pages.page_keys)

    def _demote_targets(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None, whole_namespace: bool
    ) -> list[RadixNode]:
        if whole_namespace:
            return [n for n in self.engine.index.nodes() if self._key_digest.get(n.key) == digest]
        nodes = self._resolve(digest, keys, session)
        if session is not None:
            return nodes
        # A page leaves its tier only after everything below it: the descendants go too.
        seen = {n.key for n in nodes}
        stack = list(nodes)
        while stack:
            for child in stack.pop().children.values():
                if child.key not in seen:
                    seen.add(child.key)
                    nodes.append(child)
                    stack.append(child)
        return nodes

    def _drop_session(self, digest: NamespaceDigest, session: SessionId, drop: bool = True) -> DropOutcome:
        self._lapsed.pop(session, None)
        self._release_pin(_hold_id(session))
        chain = self._resolve(digest, (), session)
        # A prefetch in flight owns its pages (moving: kept); cancelled and applied now, what
        # it brought up is held again, and is released below with the rest.
        if self.engine.tiers is not None and self.engine.tiers.cancel_prefetches(chain):
            self._release_pin(_hold_id(session))
            chain = self._resolve(digest, (), session)
        num_missing = len(self._sessions[session].page_keys) - len(chain)
        index = self.engine.index
        num_dropped = 0
        for node in reversed(chain if drop else ()):
            # Stop at a shared page (another sequence's pages hang below) or a held one.
            if not node.is_leaf or not index.is_evictable(node):
                break
            index.remove(node.key)
            num_dropped += 1
        del self._sessions[session]
        self._settle_prefetched(session, "gone")
        return DropOutcome(num_dropped=num_dropped, num_kept=len(chain) - num_dropped, num_missing=num_missing)


def _num_in_hbm(chain: Sequence[RadixNode]) -> int:
    """How many of ``chain``'s pages, from the root, are in HBM before the first one that is not."""
    return next((i for i, n in enumerate(chain) if n.tier is not Tier.HBM), len(chain))


def _in_range(value: object, most: float) -> bool:
    """``value`` is a number (not a bool) in (0, ``most``]; NaN is not."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= most


def _hold_id(session: SessionId) -> PinId:
    """The pin id of a session's prefetch hold (admin pin ids never start with this)."""
    return PinId(HOLD_PREFIX + session)


def _shutting_down() -> Unavailable:
    return Unavailable("the worker is shutting down; route to another worker")


def _deliver(aloop: asyncio.AbstractEventLoop, setter: Callable[..., None], *args: Any) -> None:
    try:
        aloop.call_soon_threadsafe(setter, *args)
    except RuntimeError:  # the awaiting loop is closed; nobody is waiting any more
        pass


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
