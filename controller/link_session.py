"""One open WorkerLink stream on the controller: its queues, pending commands, directory
incarnation and batch numbers, and the snapshot it is applying (``controller/link_servicer.py``
drives it)."""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier.domain.errors import KvtierError, Unavailable
from kvtier.domain.hashing import NamespaceDigest, PageKey
from kvtier.domain.records import (
    Command,
    CommandAck,
    CommandId,
    ControllerCommand,
    InventorySnapshotChunk,
    PageEvent,
    PageEventBatch,
    Registration,
    SnapshotId,
    WorkerId,
)

RESYNC_POLL_S = 0.1
MAX_RESYNC_BACKOFF_S = 5.0


@dataclass(frozen=True, slots=True)
class LostMessage:
    """Placeholder for a message that did not convert, kept in stream order for the writer."""

    reason: str


QueuedEvent = PageEventBatch | InventorySnapshotChunk | CommandAck | LostMessage


@dataclass(frozen=True, slots=True)
class SnapshotSummary:
    """An applied inventory snapshot. ``roots``: its depth-1 pages per namespace; every other
    page descends from one of them (dropping them drops the worker's whole inventory)."""

    snapshot_id: SnapshotId
    num_pages: int
    roots: Mapping[NamespaceDigest, tuple[PageKey, ...]]


@dataclass(slots=True)
class PendingSnapshot:
    """A snapshot being applied: its chunks so far, pages whose parent is still to come, and the
    batches that arrived meanwhile."""

    snapshot_id: SnapshotId
    as_of_seq: int
    next_chunk: int = 0
    num_pages: int = 0
    roots: dict[NamespaceDigest, list[PageKey]] = field(default_factory=dict)
    deferred: list[PageEvent] = field(default_factory=list)  # parent not applied yet
    batches: list[PageEventBatch] = field(default_factory=list)  # arrived meanwhile


class LinkSession:
    """One open WorkerLink stream of one worker. Lives until the stream ends."""

    def __init__(self, link_id: int, registration: Registration) -> None:
        self.link_id = link_id
        self.registration = registration
        self.outbox: asyncio.Queue[ControllerCommand | KvtierError] = asyncio.Queue()
        self.inbox: collections.deque[QueuedEvent] = collections.deque()
        self.wakeup = asyncio.Event()  # the writer has work: inbox items or a lease renewal
        self.renew_due = False
        self.lock = asyncio.Lock()
        self._pending: dict[CommandId, asyncio.Future[CommandAck]] = {}
        self._next_command_id = 1
        self.last_batch_seq: int | None = None  # the worker's numbering
        self.dir_seq = 0  # next directory batch number of the current incarnation
        self.is_registered = False  # the directory has a current incarnation from this stream
        self.has_entries = False  # something was applied to that incarnation
        self.needs_resync = False
        self.awaiting_snapshot = False  # re-registered; batches are covered by the coming snapshot
        self.snapshot: PendingSnapshot | None = None
        self.resync_task: asyncio.Task[None] | None = None
        self.resync_not_before_s = 0.0
        self.num_resync_failures = 0
        self.last_repair_s = -math.inf
        self.repair_reason: str | None = None  # a repair snapshot is wanted (sent when not throttled)
        self.num_snapshots_applied = 0
        self.applied_snapshots: collections.OrderedDict[SnapshotId, SnapshotSummary] = collections.OrderedDict()
        self.closed = False
        self.credential: str | None = None  # the token entry that opened the stream; None: auth off

    @property
    def worker_id(self) -> WorkerId:
        return self.registration.worker_id

    def send(self, command: Command) -> asyncio.Future[CommandAck]:
        if self.closed:
            raise Unavailable(f"the WorkerLink of worker {self.worker_id!r} is closed")
        command_id = CommandId(self._next_command_id)
        self._next_command_id += 1
        future: asyncio.Future[CommandAck] = asyncio.get_running_loop().create_future()
        self._pending[command_id] = future
        self.outbox.put_nowait(ControllerCommand(command_id, command))
        return future

    def resolve(self, ack: CommandAck) -> bool:
        future = self._pending.pop(ack.command_id, None)
        if future is None:
            return False
        if not future.done():
            future.set_result(ack)
        return True

    def close(self, error: KvtierError | None = None) -> None:
        """End the stream (with ``error`` as its status) and fail the unacknowledged commands."""
        if error is not None and not self.closed:
            self.outbox.put_nowait(error)
        self.closed = True
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(
                    Unavailable(f"the WorkerLink of worker {self.worker_id!r} closed before the command "
                                "was acknowledged")
                )

    def new_incarnation(self) -> None:
        self.is_registered, self.has_entries, self.dir_seq = True, False, 0

    def next_dir_seq(self) -> int:
        seq, self.dir_seq = self.dir_seq, self.dir_seq + 1
        return seq

    def resync_failed(self) -> None:
        """Try again later, backing off: a worker that cannot snapshot must not be flooded."""
        self.needs_resync, self.awaiting_snapshot = True, False
        self.num_resync_failures += 1
        delay_s = min(MAX_RESYNC_BACKOFF_S, RESYNC_POLL_S * 2**self.num_resync_failures)
        self.resync_not_before_s = time.monotonic() + delay_s


def quiet(future: asyncio.Future[CommandAck]) -> None:
    """A done-callback for commands nobody awaits (repairs, ticket keys): retrieves the outcome."""
    if not future.cancelled():
        future.exception()


def snapshot_inserts(chunk: InventorySnapshotChunk) -> list[PageEvent]:
    """The chunk's pages as INSERT events, shallowest first (a parent before its children)."""
    events = [
        PageEvent.insert(inv.namespace_digest, page.page_key, page.parent_key, page.depth, inv.tier)
        for inv in chunk.inventories
        for page in inv.pages
    ]
    events.sort(key=insert_depth)
    return events


def insert_depth(event: PageEvent) -> int:
    """An INSERT's depth, which every INSERT carries (``PageEvent.insert``)."""
    assert event.depth is not None
    return event.depth
