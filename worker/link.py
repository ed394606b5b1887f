"""The worker's end of ``WorkerLink.Connect``: inventory up, commands down (DESIGN §3).

The stream carries the worker's bearer token (role worker) and, with ``tls``, runs over TLS,
presenting the worker's certificate to a controller that requires one (mTLS); see
``docs/decisions/0007-authentication.md``.

One bidi stream per connection, reopened with exponential backoff (capped at
``max_backoff_s``) whenever it breaks. On every (re)connect the worker sends, in order:

    Register ─► InventorySnapshotChunk… (as_of_seq = last batch seq) ─► then, interleaved:
    Heartbeat (every heartbeat_interval_s)  PageEventBatch (every batch_interval_s)  CommandAck

Sequence numbers of heartbeats and page-event batches grow by one per message within a
boot (``boot_id``), across reconnects too; batches lost with a broken stream leave a gap
in ``seq``, and the fresh snapshot that follows every reconnect covers it.

Snapshot consistency: buffered page events are discarded on the engine thread in the
same step that lists the inventory, and no batch is drained while a snapshot is being
taken (``_send_lock``), so a snapshot with ``as_of_seq = n`` reflects exactly the
batches up to n and every later batch holds later changes.

Commands: ``Drop`` (idle pages leave the cache; pages a sequence holds or a pin keeps are
kept; by session: the session's private pages, shared prefixes stay), ``Demote`` (idle
pages move down now, with what hangs below them; held ones stay and are counted in
``num_skipped_pages``), ``Prefetch`` (lower-tier pages are promoted into HBM and stay
cached there), ``RequestSnapshot``, ``Drain``, ``Invalidate`` (the epoch is installed in
the engine loop's table before the ack, so every later request derives the new digest;
stale pages are dropped now or in the background), ``Pin`` and ``Unpin`` are carried out.
Demote, Prefetch and Drop may name a session instead of pages (the engine loop resolves its
last generation's pages); Demote and Drop may name the whole namespace. Every command is
acknowledged exactly once, by id.

``TicketKey`` installs the key Generate checks Route tickets with (``kvtier.rpc.tickets``);
an authenticated controller sends it first on every stream.

Demote and Prefetch run as background transfers (DESIGN §5.5): commands are taken in order,
and a move's transfers are submitted before the next command is read, but the engine keeps
stepping while they run and the link reads on. The ack goes when the move has been applied
to the index (the bytes are where the inventory says) with the real counts, on the stream
the command came in on; a stream that broke meanwhile loses it, as it loses any ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc
import grpc.aio

from kvtier.domain.errors import InvalidArgument, KvtierError
from kvtier.domain.records import (
    BootId,
    CommandAck,
    CommandId,
    ControllerCommand,
    DemoteCommand,
    DrainCommand,
    DropCommand,
    FetchCommand,
    Heartbeat,
    InvalidateCommand,
    InventorySnapshotChunk,
    ModelFacts,
    ModelIdentity,
    NamespaceInventory,
    PageEventBatch,
    PinCommand,
    PrefetchCommand,
    Registration,
    RequestSnapshotCommand,
    SnapshotId,
    TicketKeyCommand,
    TierCapacity,
    UnpinCommand,
    WorkerEvent,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.rpc._gen import worker_link_pb2, worker_link_pb2_grpc
from kvtier.rpc.convert.limits import MAX_BATCH_EVENTS, MAX_MESSAGE_BYTES, MAX_SNAPSHOT_CHUNK_PAGES
from kvtier.rpc.convert.link_commands import from_proto_controller_command
from kvtier.rpc.convert.link_events import to_proto_worker_event
from kvtier.rpc.tickets import TicketVerifier
from kvtier.rpc.tls import ClientTls, secure_or_insecure_channel
from kvtier.runtime.log import get_logger
from kvtier.tiers.moves import MoveOutcome
from kvtier.worker.engine_loop import EngineLoop
from kvtier.worker.peer_fetch import PeerFetcher, fetch_command_ack

log = get_logger("kvtier.worker.link")

# Keepalive pings detect a controller that vanished without closing the connection
# (the stream is open for the channel's whole life, so pings never go out idle).
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
)
UNSUPPORTED = "UNSUPPORTED"


def registration_for(
    loop: EngineLoop, *, worker_id: str, address: str, boot_id: str, has_chat_template: bool = False
) -> Registration:
    engine = loop.engine
    pool = engine.pool
    facts = ModelFacts(
        vocab_size=engine.vocab_size,
        max_context_tokens=engine.max_model_len,
        eos_token_ids=tuple(sorted(engine.eos_token_ids)),
        has_chat_template=has_chat_template,
    )
    return Registration(
        worker_id=WorkerId(worker_id),
        address=address,
        boot_id=BootId(boot_id),
        model=ModelIdentity.of(engine.namespace),
        page_size=pool.page_size,
        capacities=tuple(
            TierCapacity(tier=tier, capacity_pages=pages, capacity_bytes=pages * pool.geometry.page_bytes)
            for tier, pages in _tier_pages(loop)
        ),
        facts=facts,
    )


def _tier_pages(loop: EngineLoop) -> list[tuple[Tier, int]]:
    """Pages per tier this worker has: HBM always, DRAM and NVMe when configured."""
    tiers = loop.engine.tiers
    if tiers is None:
        return [(Tier.HBM, loop.engine.pool.num_pages)]
    return [(tier, tiers.capacity(tier)) for tier in tiers.tiers]


def snapshot_chunks(
    snapshot_id: SnapshotId,
    inventories: Sequence[NamespaceInventory],
    as_of_seq: int,
    max_pages: int = MAX_SNAPSHOT_CHUNK_PAGES,
) -> list[InventorySnapshotChunk]:
    """Split inventories into chunks of at most ``max_pages`` pages (always at least one chunk)."""
    chunks: list[list[NamespaceInventory]] = [[]]
    room = max_pages
    for inventory in inventories:
        pages = inventory.pages
        while pages:
            if room == 0:
                chunks.append([])
                room = max_pages
            part, pages = pages[:room], pages[room:]
            chunks[-1].append(NamespaceInventory(inventory.namespace_digest, inventory.tier, tuple(part)))
            room -= len(part)
    return [
        InventorySnapshotChunk(
            snapshot_id=snapshot_id,
            chunk_index=i,
            is_last=i == len(chunks) - 1,
            as_of_seq=as_of_seq,
            inventories=tuple(chunk),
        )
        for i, chunk in enumerate(chunks)
    ]


class WorkerLink:
    """Keeps the worker connected to the controller until ``stop()``."""

    def __init__(
        self,
        loop: EngineLoop,
        *,
        controller_address: str,
        worker_id: str,
        address: str,
        boot_id: str,
        heartbeat_interval_s: float = 1.0,
        batch_interval_s: float = 0.05,
        max_batch_events: int = 512,
        initial_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        token: str | None = None,
        tls: ClientTls | None = None,
        has_chat_template: bool = False,
        tickets: TicketVerifier | None = None,
        peers: PeerFetcher | None = None,
    ) -> None:
        if not 1 <= max_batch_events <= MAX_BATCH_EVENTS:
            raise ValueError(
                f"max_batch_events must be in [1, {MAX_BATCH_EVENTS}], got {max_batch_events}"
            )
        self._loop = loop
        self.controller_address = controller_address
        self.registration = registration_for(
            loop, worker_id=worker_id, address=address, boot_id=boot_id, has_chat_template=has_chat_template
        )
        self._heartbeat_interval_s = heartbeat_interval_s
        self._batch_interval_s = batch_interval_s
        self._max_batch_events = max_batch_events
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._tls = tls  # TLS to the controller (with a client certificate for mTLS), or plaintext
        self._tickets = tickets  # receives the Route-ticket key the controller sends (TicketKeyCommand)
        self._peers = peers  # carries out FetchCommands (None: this worker fetches from no peer)
        self._heartbeat_seq = 0
        self._batch_seq = 0
        self._send_lock = asyncio.Lock()
        self._outbox: asyncio.Queue[WorkerEvent] | None = None
        self._task: asyncio.Task[None] | None = None
        self._move_acks: set[asyncio.Task[None]] = set()  # Demote / Prefetch / Fetch acks still to come
        self.connected = asyncio.Event()
        self.num_connections = 0  # successful registrations so far

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvtier-worker-link")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task in list(self._move_acks):
            task.cancel()
        await asyncio.gather(*self._move_acks, return_exceptions=True)

    @property
    def is_connected(self) -> bool:
        return self.connected.is_set()

    # ---- connection ------------------------------------------------------------------
    async def _run(self) -> None:
        num_failures = 0
        while True:
            try:
                await self._session()
                reason = "the controller closed the stream"
            except grpc.aio.AioRpcError as err:
                reason = f"{err.code().name}: {err.details()}"
            except asyncio.InvalidStateError:
                reason = "the stream finished while writing"
            except KvtierError as err:
                reason = err.message
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug; keep the worker connected anyway
                log.error("worker link session failed", exc_info=exc)
                reason = "internal error"
            was_connected = self.is_connected
            self.connected.clear()
            num_failures = 0 if was_connected else num_failures + 1
            delay = min(self._max_backoff_s, self._initial_backoff_s * 2 ** max(num_failures - 1, 0))
            delay *= random.uniform(0.5, 1.0)  # jitter: workers of a restarted controller spread out
            # Loud once per outage, quiet while retrying.
            log.log(
                logging.WARNING if was_connected or num_failures == 1 else logging.DEBUG,
                "controller link down; reconnecting",
                extra={
                    "controller": self.controller_address,
                    "reason": reason,
                    "retry_in_s": round(delay, 3),
                },
            )
            await asyncio.sleep(delay)

    async def _session(self) -> None:
        async with secure_or_insecure_channel(self.controller_address, self._tls, CHANNEL_OPTIONS) as channel:
            call = worker_link_pb2_grpc.WorkerLinkStub(channel).Connect(metadata=self._metadata)
            try:
                await call.write(to_proto_worker_event(self.registration))
                self._outbox = outbox = asyncio.Queue[WorkerEvent]()
                await self._send_snapshot(SnapshotId(f"connect-{uuid.uuid4().hex[:12]}"))
                tasks = [
                    asyncio.create_task(self._write_loop(call, outbox)),
                    asyncio.create_task(self._read_loop(call)),
                    asyncio.create_task(self._heartbeat_loop()),
                    asyncio.create_task(self._event_loop()),
                ]
                self.num_connections += 1
                self.connected.set()
                log.info(
                    "registered with the controller",
                    extra={"controller": self.controller_address, "worker_id": self.registration.worker_id},
                )
                try:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                for task in done:
                    task.result()  # re-raise what ended the session
            finally:
                self._outbox = None
                call.cancel()

    async def _write_loop(self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[WorkerEvent]) -> None:
        while True:
            event = await outbox.get()
            await call.write(to_proto_worker_event(event))

    async def _read_loop(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                return
            await self._execute(message)

    def _send(self, event: WorkerEvent, outbox: asyncio.Queue[WorkerEvent] | None = None) -> None:
        if outbox is None:
            outbox = self._outbox
        if outbox is not None:
            outbox.put_nowait(event)

    # ---- outgoing ----------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            load = self._loop.latest_load
            self._heartbeat_seq += 1
            self._send(
                Heartbeat(
                    seq=self._heartbeat_seq,
                    tiers=load.tiers,
                    queue_depth=load.queue_depth,
                    num_running_seqs=load.num_running_seqs,
                    costs=self._loop.costs.snapshot(),
                )
            )
            await asyncio.sleep(self._heartbeat_interval_s)

    async def _event_loop(self) -> None:
        while True:
            await asyncio.sleep(self._batch_interval_s)
            if self._loop.consume_page_events_lost():
                log.warning("page events overflowed while disconnected; sending a full snapshot")
                await self._send_snapshot(SnapshotId(f"overflow-{uuid.uuid4().hex[:12]}"))
                continue
            async with self._send_lock:
                events = self._loop.drain_page_events()
                for start in range(0, len(events), self._max_batch_events):
                    self._batch_seq += 1
                    batch = tuple(events[start : start + self._max_batch_events])
                    self._send(PageEventBatch(seq=self._batch_seq, events=batch))

    async def _send_snapshot(self, snapshot_id: SnapshotId) -> int:
        async with self._send_lock:
            inventories = await self._loop.inventory(reset_page_events=True)
            chunks = snapshot_chunks(snapshot_id, inventories, as_of_seq=self._batch_seq)
            for chunk in chunks:
                self._send(chunk)
        num_pages = sum(c.num_pages for c in chunks)
        log.info("inventory snapshot sent", extra={"snapshot_id": snapshot_id, "num_pages": num_pages})
        return num_pages

    # ---- commands ------------------------------------------------------------------------
    async def _execute(self, message: worker_link_pb2.ControllerCommand) -> None:
        command_id = CommandId(message.command_id)
        try:
            command = from_proto_controller_command(message)
            if isinstance(command.command, DemoteCommand | PrefetchCommand):
                self._ack_when_applied(command, await self._start_move(command))
                return
            if isinstance(command.command, FetchCommand):
                self._spawn_ack(fetch_command_ack(self._peers, command.command_id, command.command))
                return
            ack = await self._carry_out(command)
        except KvtierError as err:
            ack = CommandAck(command_id, error_code=err.code, error_message=err.message)
        self._send(ack)

    async def _start_move(self, command: ControllerCommand) -> asyncio.Future[MoveOutcome]:
        """Submit a Demote's or Prefetch's transfers; the future resolves once they are applied."""
        body = command.command
        if isinstance(body, DemoteCommand):
            return await self._loop.start_demote(body.namespace_digest, body.page_keys, body.session_id,
                                                 body.target_tier, whole_namespace=body.whole_namespace)
        assert isinstance(body, PrefetchCommand)
        if body.target_tier is not Tier.HBM:
            raise InvalidArgument("this worker prefetches into HBM only", field="target_tier")
        # The deadline is when the session is back at the latest: the pages are held in HBM until
        # then, so an eviction meanwhile does not undo the prefetch. When it is expected back
        # ranks the hold against others (the one due back last yields first).
        # How long the session has been away and the prediction's spread rank it once overdue.
        hold_s = body.deadline_ms / 1000.0 if body.deadline_ms else None
        due_s = body.return_in_ms / 1000.0 if body.return_in_ms is not None else None
        away_s = body.away_ms / 1000.0 if body.away_ms is not None else None
        return await self._loop.start_prefetch(body.namespace_digest, body.page_keys, body.session_id,
                                               hold_s=hold_s, due_s=due_s, away_s=away_s, spread=body.return_spread)

    def _ack_when_applied(self, command: ControllerCommand, applied: asyncio.Future[MoveOutcome]) -> None:
        """Ack ``command`` on this stream once its move is applied, without holding up the
        commands behind it."""
        outbox = self._outbox
        body = command.command
        assert isinstance(body, DemoteCommand | PrefetchCommand)

        async def ack_when_applied() -> None:
            try:
                moved = await applied
            except KvtierError as err:
                self._send(CommandAck(command.command_id, error_code=err.code, error_message=err.message), outbox)
                return
            log.info(
                f"{type(body).__name__.removesuffix('Command').lower()} command carried out",
                extra={
                    "command_id": command.command_id,
                    "session_id": body.session_id,
                    "num_moved": moved.num_moved,
                    "num_skipped": moved.num_skipped,
                },
            )
            ack = CommandAck(command.command_id, num_pages=moved.num_moved, num_skipped_pages=moved.num_skipped)
            self._send(ack, outbox)

        self._spawn_ack(ack_when_applied(), send=False)

    def _spawn_ack(self, ack: Coroutine[Any, Any, Any], *, send: bool = True) -> None:
        """Run ``ack`` without holding up the commands behind it; with ``send`` its result (a
        ``CommandAck``) goes on this stream."""
        outbox = self._outbox

        async def run() -> None:
            result = await ack
            if send:
                self._send(result, outbox)

        task = asyncio.create_task(run(), name="kvtier-command-ack")
        self._move_acks.add(task)
        task.add_done_callback(self._move_acks.discard)

    async def _carry_out(self, command: ControllerCommand) -> CommandAck:
        body = command.command
        if isinstance(body, DropCommand) and body.session_id is not None:
            outcome = await self._loop.drop_session(body.namespace_digest, body.session_id, drop=not body.keep_pages)
            log.info("session drop carried out", extra={
                "command_id": command.command_id, "session_id": body.session_id,
                "num_dropped": outcome.num_dropped, "num_kept": outcome.num_kept})
            return CommandAck(command.command_id, num_pages=outcome.num_dropped, num_skipped_pages=outcome.num_kept)
        if isinstance(body, DropCommand):
            outcome = await self._loop.drop_pages(body.namespace_digest, body.page_keys,
                                                  whole_namespace=body.whole_namespace)
            log.info(
                "drop command carried out",
                extra={
                    "command_id": command.command_id,
                    "num_dropped": outcome.num_dropped,
                    "num_kept": outcome.num_kept,
                    "num_missing": outcome.num_missing,
                },
            )
            if outcome.num_kept:
                return CommandAck(
                    command.command_id,
                    num_pages=outcome.num_dropped,
                    num_skipped_pages=outcome.num_kept,
                    error_code="FAILED_PRECONDITION",
                    error_message=f"{outcome.num_kept} of {outcome.num_kept + outcome.num_dropped} pages are "
                    "held by running sequences or pinned and were kept",
                )
            return CommandAck(command.command_id, num_pages=outcome.num_dropped)
        if isinstance(body, RequestSnapshotCommand):
            await self._send_snapshot(body.snapshot_id)
            return CommandAck(command.command_id)
        if isinstance(body, DrainCommand):
            released = await self._loop.set_draining(body.draining)
            log.info("drain state changed", extra={"draining": body.draining, "num_holds_released": released})
            return CommandAck(command.command_id)
        if isinstance(body, InvalidateCommand):
            # Installed before anything awaits: no request admitted from now on derives a stale digest.
            self._loop.epochs.install(body.scope, body.policy_epoch)
            counts = await self._loop.invalidate(body.scope, body.policy_epoch)
            return CommandAck(command.command_id, num_pages=counts.num_done, num_skipped_pages=counts.num_kept)
        if isinstance(body, PinCommand):
            counts = await self._loop.pin(body)
            log.info("pin carried out", extra={"command_id": command.command_id, "pin_id": body.pin_id,
                                               "num_pinned": counts.num_done, "num_skipped": counts.num_kept})
            return CommandAck(command.command_id, num_pages=counts.num_done, num_skipped_pages=counts.num_kept)
        if isinstance(body, TicketKeyCommand):
            if self._tickets is None:
                return CommandAck(command.command_id, error_code="FAILED_PRECONDITION",
                                  error_message="this worker checks no Route tickets (no auth_tokens_file)")
            self._tickets.install(body.key)
            log.info("route ticket key installed", extra={"command_id": command.command_id})
            return CommandAck(command.command_id)
        if isinstance(body, UnpinCommand):
            released = await self._loop.unpin(body.pin_id)
            log.info("unpin carried out", extra={"command_id": command.command_id, "pin_id": body.pin_id,
                                                 "num_released": released})
            return CommandAck(command.command_id, num_pages=released)
        return CommandAck(
            command.command_id,
            error_code=UNSUPPORTED,
            error_message=f"this worker does not carry out {type(body).__name__} yet",
        )
