"""WorkerLink.Connect on the controller: inventory up, commands down (DESIGN §3, §7).

Per stream (``LinkSession``)::

    Register ─► registry + Directory.register_worker (a new incarnation, empty)
    Heartbeat ─► registry load + Directory.heartbeat (renews the lease)
    PageEventBatch ─► seq check ─► Directory.apply_events (own batch numbers per incarnation)
    InventorySnapshotChunk… ─► fresh incarnation if the current one holds anything,
                               then the pages as INSERTs (parents first, retried once all arrived)
    CommandAck ─► resolves the future ``send_command`` returned
    stream end ─► registry marks it disconnected; its lease expires, the sweeper reclaims it

Validation: a batch whose seq is not above the previous one (duplicate, regressed) is
rejected; a message that does not convert (a malformed event, an oversize batch) is
rejected; the directory rejects single events (bad depth, missing parent, ...). Every
rejection is counted in ``WorkerLinks.counters`` (``rejected.<reason>``) and logged with
the worker id and the reason, and the stream stays up. Lost or divergent events (a seq
gap, a rejected batch, a missing parent) make the controller ask the worker for a fresh
snapshot (at most one per ``REPAIR_MIN_INTERVAL_S``), which rebuilds its entries.

Redis unreachable: heartbeats still update the registry, page events are dropped and the
session is flagged; once Redis is back (and this controller leads) the flagged sessions
*resync*: a new incarnation, then a requested snapshot; batches that arrive before it are
covered by it and skipped. Directory batch numbers are the session's own (``dir_seq``, +1
per ``apply_events`` call, restarting with each incarnation), so a snapshot of any size fits.

Tasks per stream: the *reader* converts each message and never waits on Redis: heartbeats
update the registry and acks resolve at once, so a slow directory or a long snapshot never
makes a live worker look dead; page events and snapshot chunks queue, in order, for the
*writer*, which applies them under ``LinkSession.lock`` and renews the directory lease
between them (and between the parts of a long snapshot). A resync takes the same lock to
re-register, and waits for the snapshot's ack outside it (the chunks arrive meanwhile).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import grpc.aio

from kvtier.controller.directory_records import Outcome, RejectReason
from kvtier.controller.link_session import (
    RESYNC_POLL_S,
    LinkSession,
    LostMessage,
    PendingSnapshot,
    QueuedEvent,
    SnapshotSummary,
    insert_depth,
    quiet,
    snapshot_inserts,
)
from kvtier.controller.registry import Registry
from kvtier.controller.resync import REDIS_ERRORS, DirectoryAccess
from kvtier.controller.worker_identity import WorkerIdentity
from kvtier.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvtier.domain.records import (
    Command,
    CommandAck,
    ControllerCommand,
    Heartbeat,
    InventorySnapshotChunk,
    PageEvent,
    PageEventBatch,
    Registration,
    RequestSnapshotCommand,
    SnapshotId,
    WorkerEvent,
    WorkerId,
)
from kvtier.rpc._gen import worker_link_pb2, worker_link_pb2_grpc
from kvtier.rpc.auth_interceptor import current_principal
from kvtier.rpc.convert.link_commands import to_proto_controller_command
from kvtier.rpc.convert.link_events import from_proto_worker_event
from kvtier.rpc.status import rpc_errors
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.link")

T = TypeVar("T")

MAX_BUFFERED_BATCHES = 1024
"""Batches held while a snapshot arrives; beyond that the snapshot is abandoned and redone."""
MAX_QUEUED_EVENTS = 4096
"""Messages waiting for the writer; beyond that they are dropped and the worker resyncs."""
REPAIR_MIN_INTERVAL_S = 5.0
MAX_SNAPSHOT_SUMMARIES = 16
"""Applied snapshots remembered per stream (for Admin.Snapshot and Admin.Drain)."""
SNAPSHOT_ACK_TIMEOUT_S = 30.0
_DIVERGENCE = frozenset({RejectReason.MISSING_PARENT, RejectReason.NOT_HELD})
_MEMBERS = {Heartbeat: "heartbeat", PageEventBatch: "page_events", InventorySnapshotChunk: "snapshot",
            CommandAck: "ack", Registration: "register"}


class WorkerLinks:
    """Every open stream by worker id, and what their events do to the directory."""

    def __init__(self, registry: Registry, access: DirectoryAccess, identity: WorkerIdentity | None = None) -> None:
        self.registry = registry
        self.access = access
        self.identity = identity  # with authentication: who may register which id, and ticket keys
        self.sessions: dict[WorkerId, LinkSession] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._next_link_id = 0
        # Called with each new stream's worker id before any other command is queued for it:
        # what a (re)connected worker must hear first (the policy epochs and pins, cache_admin).
        self.on_open: Callable[[WorkerId], None] | None = None

    @property
    def num_rejected(self) -> int:
        return sum(n for k, n in self.counters.items() if k.startswith("rejected."))

    # -- streams and commands -------------------------------------------------------------

    def open(self, registration: Registration, credential: str | None = None) -> tuple[LinkSession, LinkSession | None]:
        """A new stream of ``registration``'s worker (opened with token ``credential``), and the
        older one it replaces (now closed); the ticket key goes first, then what ``on_open`` queues.

        Every session ``open`` returns must reach ``close`` (the servicer's ``finally``).
        """
        self._next_link_id += 1
        worker = registration.worker_id
        previous = self.sessions.get(worker)
        if previous is not None:
            self.counters["links.replaced"] += 1
            previous.close(Unavailable(f"worker {worker!r} opened a newer WorkerLink stream"))
        session = self.sessions[worker] = LinkSession(self._next_link_id, registration)
        session.credential = credential
        if self.identity is not None and credential is not None:
            self.identity.welcome(session)
        self.registry.connect(registration, session.link_id)
        log.info("worker connected", extra={"worker_id": worker, "address": registration.address,
                                            "boot_id": registration.boot_id, "link_id": session.link_id})
        if self.on_open is not None:
            self.on_open(worker)
        return session, previous

    async def register(self, session: LinkSession, previous: LinkSession | None) -> None:
        """Start the session's incarnation in the directory (or flag it for a resync)."""
        if previous is not None:
            # Directory writes name the worker, not the incarnation: let the old stream's write
            # in flight finish before the new incarnation exists (closed sessions write nothing).
            async with previous.lock:
                pass
        async with session.lock:
            if not (self.access.can_write and await self._register(session)):
                session.needs_resync = True

    def close(self, session: LinkSession) -> None:
        session.close()
        worker = session.worker_id
        if self.sessions.get(worker) is session:
            del self.sessions[worker]
        self.registry.disconnect(worker, session.link_id)
        if session.resync_task is not None:
            session.resync_task.cancel()
        log.info("worker disconnected", extra={"worker_id": session.worker_id, "link_id": session.link_id})

    def close_all(self, leader: str | None, *, reason: str | None = None) -> None:
        """End every stream so workers reconnect (to the leader: this controller stopped leading)."""
        where = f"the leader is {leader}" if leader else "reconnect to find the leader"
        message = reason or f"controller {self.access.controller_id} is not the leader; {where}"
        for session in list(self.sessions.values()):
            session.close(Unavailable(message))

    def send_command(self, worker: WorkerId, command: Command) -> asyncio.Future[CommandAck]:
        """Send ``command`` down the worker's stream; the future resolves with its ack.

        The ack says whether the worker carried it out (``ack.ok``); the future fails with
        ``Unavailable`` when the stream closes first. ``NotFound`` when the worker has no
        stream to this controller.
        """
        session = self.sessions.get(worker)
        if session is None or session.closed:
            raise NotFound(f"worker {worker!r} has no open WorkerLink to this controller", field="worker_id")
        return session.send(command)

    def request_snapshot(self, worker: WorkerId) -> tuple[SnapshotId, asyncio.Future[CommandAck]]:
        """Ask the worker for a full inventory snapshot, which replaces its directory entries.

        The ack arrives after the chunks and resolves only once they were handled, so when it
        resolves ``snapshot_progress`` says whether the snapshot was applied. ``NotFound`` as
        ``send_command``."""
        snapshot_id = SnapshotId(f"admin-{uuid.uuid4().hex[:12]}")
        return snapshot_id, self.send_command(worker, RequestSnapshotCommand(snapshot_id))

    def snapshot_progress(self, worker: WorkerId, snapshot_id: SnapshotId) -> tuple[bool, int, SnapshotSummary | None]:
        """(is applied, pages so far, its summary once applied) of one snapshot of the worker's
        current stream; an unknown or abandoned snapshot is (False, 0, None)."""
        session = self.sessions.get(worker)
        if session is None:
            return False, 0, None
        summary = session.applied_snapshots.get(snapshot_id)
        if summary is not None:
            return True, summary.num_pages, summary
        if session.snapshot is not None and session.snapshot.snapshot_id == snapshot_id:
            return False, session.snapshot.num_pages, None
        return False, 0, None

    def mark_for_resync(self, everything: bool) -> None:
        if not everything:
            return  # the data survived: only sessions that dropped something resync (they are flagged)
        for session in self.sessions.values():
            session.is_registered, session.needs_resync = False, True
            session.resync_not_before_s, session.num_resync_failures = 0.0, 0

    # -- events ---------------------------------------------------------------------------

    def receive(self, session: LinkSession, event: WorkerEvent | LostMessage) -> None:
        """Take one message from the reader; never waits (directory work goes to the writer).

        Acks queue behind the events that came before them, so a command's future resolves only
        after what the worker sent first has been applied (a snapshot before its ack).
        """
        if isinstance(event, Heartbeat):
            self.registry.heartbeat(session.worker_id, session.link_id, event)
            session.renew_due = True
            session.wakeup.set()
        elif isinstance(event, Registration):
            self.reject(session, "unexpected_register", "register is only valid as the first event")
        elif len(session.inbox) < MAX_QUEUED_EVENTS:
            session.inbox.append(event)
            session.wakeup.set()
        else:
            self.counters["events.overflowed"] += 1
            log.warning("directory writes fell behind; dropping queued events and resyncing",
                        extra={"worker_id": session.worker_id, "num_queued": len(session.inbox)})
            acks = [e for e in session.inbox if isinstance(e, CommandAck)]
            session.inbox.clear()
            session.inbox.extend([*acks, LostMessage("overflow")])

    def reject_message(self, session: LinkSession, err: KvtierError) -> None:
        """A message that did not convert: counted now, and its loss repaired in stream order."""
        reason = "oversize" if isinstance(err, ResourceExhausted) else "malformed"
        self.reject(session, reason, err.message)
        if (err.field or "").startswith(("page_events", "snapshot")):
            self.receive(session, LostMessage(f"a {reason} message"))

    async def run_writer(self, session: LinkSession) -> None:
        """Apply the session's queued events in order, renewing its lease between them."""
        while not session.closed:
            await session.wakeup.wait()
            session.wakeup.clear()
            while not session.closed and (session.renew_due or session.inbox):
                async with session.lock:
                    if session.closed:
                        return
                    try:
                        if session.renew_due:
                            await self._renew(session)
                        else:
                            await self._on_event(session, session.inbox.popleft())
                    except Exception as exc:  # a bug: keep the stream (and the worker's routing) up
                        self.counters["internal_errors"] += 1
                        session.needs_resync = True
                        log.error("worker event handling failed",
                                  extra={"worker_id": session.worker_id}, exc_info=exc)

    async def _on_event(self, session: LinkSession, event: QueuedEvent) -> None:
        if isinstance(event, CommandAck):
            if not session.resolve(event):
                self.counters["acks.unknown"] += 1
        elif isinstance(event, PageEventBatch):
            await self._on_batch(session, event)
        elif isinstance(event, InventorySnapshotChunk):
            await self._on_chunk(session, event)
        else:
            if session.snapshot is not None:
                self.counters["snapshots.abandoned"] += 1
                session.snapshot, session.needs_resync = None, True
            self._request_repair(session, event.reason)

    def reject(self, session: LinkSession, reason: str, detail: str) -> None:
        self.counters[f"rejected.{reason}"] += 1
        log.warning("worker event rejected",
                    extra={"worker_id": session.worker_id, "reason": reason, "detail": detail})

    async def _renew(self, session: LinkSession) -> None:
        session.renew_due = False
        if not (session.is_registered and self.access.can_write):
            return
        outcome = await self._guard(session, self.access.directory.heartbeat(session.worker_id))
        if outcome is Outcome.FENCED:
            await self.access.fenced()
        elif outcome in (Outcome.LEASE_EXPIRED, Outcome.UNKNOWN_WORKER):
            self._lost_incarnation(session, outcome)

    async def _on_batch(self, session: LinkSession, batch: PageEventBatch) -> None:
        last = session.last_batch_seq
        if last is not None and batch.seq <= last:
            reason = "duplicate_seq" if batch.seq == last else "regressed_seq"
            self.reject(session, reason, f"batch seq {batch.seq} is not above the previous one ({last})")
            return
        session.last_batch_seq = batch.seq
        snapshot = session.snapshot
        if snapshot is not None:
            if len(snapshot.batches) < MAX_BUFFERED_BATCHES:
                snapshot.batches.append(batch)
            else:
                self.counters["snapshots.abandoned"] += 1
                session.snapshot, session.needs_resync = None, True
            return
        if session.awaiting_snapshot:
            self.counters["batches.covered_by_snapshot"] += 1
            return
        if last is not None and batch.seq > last + 1:
            self.counters["batches.gap"] += 1
            self._request_repair(session, f"batch seq jumped from {last} to {batch.seq}")
        await self._apply_batch(session, batch)

    async def _apply_batch(self, session: LinkSession, batch: PageEventBatch) -> None:
        if not (session.is_registered and self.access.can_write):
            self.counters["batches.dropped"] += 1
            session.needs_resync = True
            return
        if await self._apply(session, batch.events):
            self.counters["batches.applied"] += 1

    async def _on_chunk(self, session: LinkSession, chunk: InventorySnapshotChunk) -> None:
        snapshot = session.snapshot
        if chunk.chunk_index == 0:
            if snapshot is not None:
                self.counters["snapshots.abandoned"] += 1
            session.snapshot = None
            if not self.access.can_write:
                self.counters["snapshots.dropped"] += 1
                session.needs_resync = True
                return
            if (not session.is_registered or session.has_entries) and not await self._register(session):
                session.needs_resync = True
                return
            # Taken after everything before it in the stream: it covers whatever was lost before,
            # so a pending repair or resync is satisfied (a failure while applying flags it again).
            session.awaiting_snapshot, session.repair_reason, session.needs_resync = False, None, False
            snapshot = session.snapshot = PendingSnapshot(chunk.snapshot_id, chunk.as_of_seq)
        elif snapshot is None:
            self.counters["snapshots.dropped"] += 1  # the rest of a snapshot already given up
            return
        elif (chunk.snapshot_id, chunk.chunk_index, chunk.as_of_seq) != (
            snapshot.snapshot_id, snapshot.next_chunk, snapshot.as_of_seq
        ):
            self.reject(session, "snapshot_out_of_order",
                        f"got chunk {chunk.chunk_index} of {chunk.snapshot_id!r}, expected chunk "
                        f"{snapshot.next_chunk} of {snapshot.snapshot_id!r}")
            session.snapshot, session.needs_resync = None, True
            return
        if not await self._apply(session, snapshot_inserts(chunk), deferred=snapshot.deferred):
            session.snapshot, session.needs_resync = None, True
            return
        snapshot.next_chunk += 1
        snapshot.num_pages += chunk.num_pages
        for inv in chunk.inventories:
            roots = [page.page_key for page in inv.pages if page.depth == 1]
            if roots:
                snapshot.roots.setdefault(inv.namespace_digest, []).extend(roots)
        if chunk.is_last:
            await self._finish_snapshot(session, snapshot)

    async def _finish_snapshot(self, session: LinkSession, snapshot: PendingSnapshot) -> None:
        # Pages whose parent came in a later chunk: retry, shallowest first, while that helps.
        while snapshot.deferred:
            retry, snapshot.deferred = sorted(snapshot.deferred, key=insert_depth), []
            if not await self._apply(session, retry, deferred=snapshot.deferred):
                session.snapshot, session.needs_resync = None, True
                return
            if len(snapshot.deferred) == len(retry):
                break
        for _ in snapshot.deferred:
            self.reject(session, RejectReason.MISSING_PARENT.value,
                        f"snapshot {snapshot.snapshot_id!r}")
        session.snapshot = None
        session.last_batch_seq = max(session.last_batch_seq or 0, snapshot.as_of_seq)
        session.num_snapshots_applied += 1
        session.applied_snapshots[snapshot.snapshot_id] = SnapshotSummary(
            snapshot.snapshot_id, snapshot.num_pages, {ns: tuple(keys) for ns, keys in snapshot.roots.items()})
        while len(session.applied_snapshots) > MAX_SNAPSHOT_SUMMARIES:
            session.applied_snapshots.popitem(last=False)
        session.num_resync_failures = 0
        self.counters["snapshots.applied"] += 1
        log.info("inventory snapshot applied", extra={"worker_id": session.worker_id,
                                                      "snapshot_id": snapshot.snapshot_id,
                                                      "num_pages": snapshot.num_pages})
        for batch in snapshot.batches:
            if batch.seq > snapshot.as_of_seq:  # older ones are in the snapshot already
                await self._apply_batch(session, batch)

    async def _apply(
        self, session: LinkSession, events: Sequence[PageEvent], *,
        deferred: list[PageEvent] | None = None,
    ) -> bool:
        """Apply events in directory-sized batches; False when the session lost its incarnation.

        With ``deferred``, events rejected for a missing parent are collected there instead
        of counted (a snapshot retries them once every chunk is in).
        """
        step = self.access.directory.max_batch_events
        for start in range(0, len(events), step):
            if session.renew_due:  # a long snapshot must not outlast the lease it is filling
                await self._renew(session)
                if not session.is_registered:
                    return False
            part = events[start:start + step]
            call = self.access.directory.apply_events(session.worker_id, session.next_dir_seq(), part)
            result = await self._guard(session, call)
            if result is None:
                return False
            if result.outcome is Outcome.FENCED:
                await self.access.fenced()
                return False
            if result.outcome in (Outcome.LEASE_EXPIRED, Outcome.UNKNOWN_WORKER):
                self._lost_incarnation(session, result.outcome)
                return False
            if result.outcome is not Outcome.OK:  # our own numbering went wrong: a bug
                self.counters[f"directory.{result.outcome.value}"] += 1
                log.error("directory refused a batch", extra={"worker_id": session.worker_id,
                                                              "outcome": result.outcome.value})
                continue
            self.counters["events.applied"] += result.num_applied
            session.has_entries = session.has_entries or result.num_applied > 0
            divergent = False
            for rejected in result.rejected:
                if deferred is not None and rejected.reason is RejectReason.MISSING_PARENT:
                    deferred.append(part[rejected.index])
                    continue
                divergent = divergent or rejected.reason in _DIVERGENCE
                self.reject(session, rejected.reason.value, f"event {start + rejected.index} of the batch")
            if divergent:
                self._request_repair(session, "the directory and the worker disagree")
        return True

    async def _guard(self, session: LinkSession, call: Awaitable[T]) -> T | None:
        """Await a directory call; on a Redis failure report it, flag the session, return None."""
        try:
            return await call
        except REDIS_ERRORS as exc:
            self.counters["directory.errors"] += 1
            self.access.report_failure(exc)
            session.needs_resync = True
            return None

    async def _register(self, session: LinkSession) -> bool:
        registration = await self._guard(session, self.access.directory.register_worker(session.worker_id))
        if registration is None:
            return False
        if registration.outcome is Outcome.FENCED:
            await self.access.fenced()
            return False
        session.new_incarnation()
        return True

    def _lost_incarnation(self, session: LinkSession, outcome: Outcome) -> None:
        self.counters["leases.lost"] += 1
        session.is_registered, session.needs_resync = False, True
        log.warning("worker lease lost; resyncing",
                    extra={"worker_id": session.worker_id, "outcome": outcome.value})

    # -- repair and resync ----------------------------------------------------------------

    def _request_repair(self, session: LinkSession, why: str) -> None:
        """Ask for a snapshot that rebuilds the worker's entries; batches keep applying meanwhile.

        Not needed while a requested snapshot is on its way (it was taken after whatever was
        lost). At most one per ``REPAIR_MIN_INTERVAL_S``; a later one waits, it is not dropped.
        """
        if session.closed or session.awaiting_snapshot:
            return
        session.repair_reason = session.repair_reason or why
        self._send_repair_if_due(session)

    def _send_repair_if_due(self, session: LinkSession) -> None:
        now_s = time.monotonic()
        if (session.repair_reason is None or session.closed or session.snapshot is not None
                or now_s - session.last_repair_s < REPAIR_MIN_INTERVAL_S):
            return
        reason, session.repair_reason, session.last_repair_s = session.repair_reason, None, now_s
        self.counters["repairs.requested"] += 1
        log.warning("asking the worker for a snapshot",
                    extra={"worker_id": session.worker_id, "reason": reason})
        snapshot_id = SnapshotId(f"repair-{uuid.uuid4().hex[:12]}")
        session.send(RequestSnapshotCommand(snapshot_id)).add_done_callback(quiet)

    async def run_resync_loop(self) -> None:
        """Resync flagged sessions whenever this controller may write (runs until cancelled)."""
        while True:
            await asyncio.sleep(RESYNC_POLL_S)
            if not self.access.can_write:
                continue
            now_s = time.monotonic()
            for session in list(self.sessions.values()):  # _resync catches what it expects
                if (session.needs_resync and session.resync_task is None and not session.closed
                        and now_s >= session.resync_not_before_s):
                    session.resync_task = asyncio.create_task(self._resync(session))
                elif not session.needs_resync:
                    self._send_repair_if_due(session)

    async def _resync(self, session: LinkSession) -> None:
        try:
            async with session.lock:
                if session.closed:
                    return
                session.needs_resync, session.snapshot, session.repair_reason = False, None, None
                if not await self._register(session):
                    session.resync_failed()
                    return
                session.awaiting_snapshot = True
            self.counters["resyncs"] += 1
            log.info("resyncing worker from a fresh snapshot", extra={"worker_id": session.worker_id})
            ack = await asyncio.wait_for(
                session.send(RequestSnapshotCommand(SnapshotId(f"resync-{uuid.uuid4().hex[:12]}"))),
                SNAPSHOT_ACK_TIMEOUT_S,
            )
            # The worker sends the chunks before the ack, and they are handled first.
            if not ack.ok or session.awaiting_snapshot:
                log.warning("worker did not send the snapshot it was asked for", extra={
                    "worker_id": session.worker_id, "error_code": ack.error_code or "none"})
                session.resync_failed()
        except (TimeoutError, KvtierError):
            session.resync_failed()
        finally:
            session.resync_task = None


class WorkerLinkServicer(worker_link_pb2_grpc.WorkerLinkServicer):
    """Thin shell: convert each event and hand it to ``WorkerLinks``; commands go back down."""

    def __init__(self, links: WorkerLinks) -> None:
        self._links = links

    @rpc_errors
    async def Connect(
        self, request_iterator: AsyncIterator[worker_link_pb2.WorkerEvent], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_link_pb2.ControllerCommand]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        registration = from_proto_worker_event(first)
        if not isinstance(registration, Registration):
            raise FailedPrecondition(
                "the first WorkerEvent of a WorkerLink stream must be `register`, got "
                f"`{_MEMBERS[type(registration)]}`; send Register first", field="event")
        self._links.access.check_serving()
        caller = current_principal()
        if self._links.identity is not None:  # authentication on: the id, a live stream, the address
            await self._links.identity.admit(registration, caller, self._links.sessions)
        session, previous = self._links.open(registration, caller.name if caller else None)
        reader: asyncio.Task[None] | None = None
        writer: asyncio.Task[None] | None = None
        try:
            await self._links.register(session, previous)
            reader = asyncio.create_task(self._read(session, request_iterator))
            writer = asyncio.create_task(self._links.run_writer(session))
            while (command := await self._next_command(session, reader)) is not None:
                yield to_proto_controller_command(command)
        finally:
            self._links.close(session)
            for task in (reader, writer):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    @staticmethod
    async def _next_command(session: LinkSession, reader: asyncio.Task[None]) -> ControllerCommand | None:
        """The next command to send; None when the worker closed its side. Raises a close error."""
        get = asyncio.ensure_future(session.outbox.get())
        done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            reader.result()
            return None
        item = get.result()
        if isinstance(item, KvtierError):
            raise item
        return item

    async def _read(
        self, session: LinkSession, request_iterator: AsyncIterator[worker_link_pb2.WorkerEvent]
    ) -> None:
        async for message in request_iterator:
            try:
                event = from_proto_worker_event(message)
            except (InvalidArgument, ResourceExhausted) as err:
                self._links.reject_message(session, err)
            else:
                self._links.receive(session, event)
