"""Operator actions on workers: list them, drain (and resume) one, snapshot their inventories.

Drain — take a worker out of service and empty it::

    Drain(w)  ─► registry: draining (Route skips it from now on) ─► DrainCommand(draining=True),
              acknowledged: the worker refuses new Generate calls and Prefetches and
              has released its session holds (the orchestrator sends it no prefetch from
              the moment the registry marks it) ─► answer DRAINING
    background: wait for a heartbeat, newer than the ack, with nothing running or queued
              ─► RequestSnapshot (applied to the directory before its ack resolves)
              ─► once: its pinned prefixes, then its most valuable pages, move to peers
                 within a byte budget (``controller/migration.py``: a receiver pulls them;
                 pins move with their pages and are released here)
              ─► Drop the snapshot's depth-1 pages of every namespace: their descendants go
                 too, in every tier, so the worker's cache is empty and its page events
                 clear its directory entries
              ─► watch the heartbeats: pages no pin keeps (a TTL pin expired) get another pass
    Drain(w, resume=True) ─► stop the background work ─► DrainCommand(draining=False),
              acknowledged ─► registry: live (Route uses it again)

Pinned prefixes and then the most valuable pages (by the eviction value) move to peers within
``ControllerConfig.drain_migrate_bytes`` (pins move with their pages); the rest is dropped: a drained worker is leaving (maintenance,
scale-down), and whoever gets its next requests reuses a peer's copy through Route's fetch
plans, its own cached prefix, or recomputes.
Running requests finish where they are. A drop keeps (and counts) pages a sequence still
holds; those get another pass after the next idle heartbeat, up to ``MAX_EMPTY_PASSES``, so
only pinned pages stay, and only while pinned. Session holds are not pins that stay: they keep
pages for a session's next turn, which Route now sends elsewhere (a hold left standing, or taken
by a prefetch that raced the drain, kept its pages past every pass, and ``drain --wait`` never
saw the worker empty).

The drain flag lives in the leader's registry and survives a reconnect of the same worker
process; a restarted worker process, or a new leader, starts with the worker live.

Snapshot — ``RequestSnapshot`` to the named (or every live) worker; with ``wait``, the
answer comes once each worker's snapshot was applied to the directory (its ack resolves
after its chunks), or failed; ``num_pages`` is the pages it listed so far.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from kvtier.controller.link_servicer import SNAPSHOT_ACK_TIMEOUT_S, WorkerLinks
from kvtier.controller.link_session import SnapshotSummary
from kvtier.controller.migration import DrainMigration
from kvtier.controller.registry import Registry, WorkerEntry
from kvtier.domain.errors import KvtierError, NotFound, Unavailable
from kvtier.domain.records import (
    CommandAck,
    DrainCommand,
    DrainRequest,
    DropCommand,
    SnapshotRequest,
    WorkerId,
    WorkerInfo,
    WorkerSnapshot,
)
from kvtier.rpc.convert.limits import MAX_COMMAND_PAGES
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.worker_admin")

COMMAND_TIMEOUT_S = 5.0
IDLE_POLL_S = 0.05
EMPTY_RETRY_S = 1.0
MAX_EMPTY_PASSES = 3
MAX_WATCH_BACKOFF_S = 30.0


class WorkerAdmin:
    """Admin.ListWorkers, Admin.Drain and Admin.Snapshot over the registry and the worker links."""

    def __init__(self, registry: Registry, links: WorkerLinks, migration: DrainMigration | None = None) -> None:
        self.registry = registry
        self.links = links
        self.migration = migration  # moves a draining worker's pinned prefixes to peers first
        self._emptying: dict[WorkerId, asyncio.Task[None]] = {}

    def list_workers(self) -> list[WorkerInfo]:
        """Every known worker, by id."""
        return [self.registry.worker_info(e) for e in self.registry.workers()]

    # ---- drain ------------------------------------------------------------------------------

    async def drain(self, request: DrainRequest) -> WorkerInfo:
        """Drain (or resume) ``request.worker_id`` (module docstring).

        ``NotFound`` naming ``worker_id`` for a worker without an open link to this
        controller; ``Unavailable`` when it does not acknowledge (a drained worker then stays
        out of routing: retry)."""
        worker = request.worker_id
        entry = self._entry(worker)
        if request.resume:
            self._stop_emptying(worker)
            await self._command(worker, DrainCommand(draining=False))
            entry = self._entry(worker)
            entry.is_draining = False
            log.info("worker resumed", extra={"worker_id": worker})
        else:
            entry.is_draining = True  # out of Route before the worker even hears of it
            await self._command(worker, DrainCommand(draining=True))
            entry = self._entry(worker)
            task = self._emptying.get(worker)
            if task is None or task.done():
                self._emptying[worker] = asyncio.create_task(
                    self._empty(worker, entry.last_seen_s), name=f"kvtier-drain-{worker}")
            log.info("worker draining", extra={"worker_id": worker})
        return self.registry.worker_info(entry)

    async def stop(self) -> None:
        tasks = list(self._emptying.values())
        for worker in list(self._emptying):
            self._stop_emptying(worker)
        await asyncio.gather(*tasks, return_exceptions=True)

    def _entry(self, worker: WorkerId) -> WorkerEntry:
        entry = self.registry.get(worker)
        if entry is None or worker not in self.links.sessions:
            connected = [e.worker_id for e in self.registry.workers() if e.is_connected]
            shown = ", ".join(connected[:10]) + (f" and {len(connected) - 10} more" if len(connected) > 10 else "")
            raise NotFound(f"worker {worker!r} has no open WorkerLink to this controller (connected: "
                           f"{shown or 'none'}; see `kvtier workers`)", field="worker_id")
        return entry

    def _stop_emptying(self, worker: WorkerId) -> None:
        task = self._emptying.pop(worker, None)
        if task is not None:
            task.cancel()

    async def _command(self, worker: WorkerId, command: DrainCommand | DropCommand) -> CommandAck:
        try:
            ack = await asyncio.wait_for(self.links.send_command(worker, command), COMMAND_TIMEOUT_S)
        except TimeoutError:
            raise Unavailable(f"worker {worker!r} did not acknowledge {type(command).__name__} within "
                              f"{COMMAND_TIMEOUT_S:g} s; retry") from None
        if isinstance(command, DrainCommand) and not ack.ok:
            raise Unavailable(f"worker {worker!r} refused the drain command ({ack.error_code}: "
                              f"{ack.error_message}); retry")
        return ack

    async def _empty(self, worker: WorkerId, ack_seen_s: float) -> None:
        """Drop the draining worker's whole inventory once it is idle, and again whenever pages
        no pin keeps show up; ends when the drain ends. Pages a pass had to keep (a sequence
        still held them: the load a heartbeat carries can be a few ms old) get another pass
        after the next idle heartbeat, up to ``MAX_EMPTY_PASSES``; after that only pinned pages
        are left, and they stay while pinned. Then the heartbeats are watched: pages no pin
        keeps (an operator's TTL pin expired, a move started before the drain landed) get
        another pass. A pass that drops nothing doubles the wait before the next one (up to
        ``MAX_WATCH_BACKOFF_S``), so pages a pin keeps in a way the count cannot tell apart
        cost a drop now and then, not a stream of them."""
        try:
            passes, backoff_s = 0, EMPTY_RETRY_S
            migrated = self.migration is None
            while True:
                summary = await self._idle_snapshot(worker, ack_seen_s)
                if summary is None:
                    return
                if not migrated:
                    assert self.migration is not None
                    migrated = True
                    try:
                        await self.migration.migrate(worker, summary.roots)
                    except Exception as exc:  # a failed move never stops the drain: the pages are dropped
                        log.warning("drain migration failed; the worker's pages are dropped",
                                    extra={"worker_id": worker, "reason": f"{type(exc).__name__}: {exc}"})
                num_dropped = num_kept = 0
                for namespace, roots in summary.roots.items():
                    for start in range(0, len(roots), MAX_COMMAND_PAGES):
                        drop = DropCommand(namespace, roots[start:start + MAX_COMMAND_PAGES])
                        ack = await self._command(worker, drop)
                        num_dropped += ack.num_pages
                        num_kept += ack.num_skipped_pages
                log.info("drained worker emptied", extra={
                    "worker_id": worker, "num_dropped": num_dropped, "num_kept": num_kept})
                ack_seen_s = self._entry(worker).last_seen_s
                passes = passes + 1 if num_kept else MAX_EMPTY_PASSES
                if passes < MAX_EMPTY_PASSES:
                    continue  # a sequence may have held some: again after the next idle heartbeat
                backoff_s = EMPTY_RETRY_S if num_dropped else min(2 * backoff_s, MAX_WATCH_BACKOFF_S)
                if not await self._wait_unpinned(worker, ack_seen_s, backoff_s):
                    return
                passes = 0
        except (KvtierError, TimeoutError) as exc:
            # The link closed or the worker stopped answering; Drain again to retry.
            log.warning("drained worker not emptied", extra={"worker_id": worker, "reason": str(exc)})

    async def _wait_unpinned(self, worker: WorkerId, after_s: float, poll_s: float) -> bool:
        """True once a heartbeat after ``after_s`` shows pages no pin keeps (cached or in use,
        ``TierOccupancy.unpinned_pages``), looked for every ``poll_s``; False when the worker is
        no longer draining."""
        return await self._wait_heartbeat(
            worker, after_s, lambda entry: any(occ.unpinned_pages for occ in entry.tiers), poll_s)

    async def _idle_snapshot(self, worker: WorkerId, ack_seen_s: float) -> SnapshotSummary | None:
        """The worker's inventory once it is idle (None: it stopped draining), retrying while
        a snapshot cannot be applied."""
        while await self._wait_idle(worker, ack_seen_s):
            snapshot_id, ack = self.links.request_snapshot(worker)
            if (await asyncio.wait_for(ack, SNAPSHOT_ACK_TIMEOUT_S)).ok:
                _, _, summary = self.links.snapshot_progress(worker, snapshot_id)
                if summary is not None:
                    return summary
            await asyncio.sleep(EMPTY_RETRY_S)
        return None

    async def _wait_idle(self, worker: WorkerId, ack_seen_s: float) -> bool:
        """True once a heartbeat after ``ack_seen_s`` shows nothing running or queued; False
        when the worker is no longer draining (resumed, restarted or forgotten)."""
        return await self._wait_heartbeat(
            worker, ack_seen_s, lambda entry: entry.num_running_seqs == 0 and entry.queue_depth == 0, IDLE_POLL_S)

    async def _wait_heartbeat(
        self, worker: WorkerId, after_s: float, shows: Callable[[WorkerEntry], bool], poll_s: float,
    ) -> bool:
        """True once a heartbeat after ``after_s`` ``shows`` what the caller waits for, looked
        for every ``poll_s``; False when the worker is no longer draining."""
        while True:
            entry = self.registry.get(worker)
            if entry is None or not entry.is_draining:
                return False
            if entry.last_seen_s > after_s and shows(entry):
                return True
            await asyncio.sleep(poll_s)

    # ---- snapshot ---------------------------------------------------------------------------

    async def snapshot(self, request: SnapshotRequest) -> list[WorkerSnapshot]:
        """Ask each named (default: every live) worker for a snapshot (module docstring)."""
        workers: Sequence[WorkerId] = request.worker_ids or [e.worker_id for e in self.registry.live_workers()]
        for worker in workers:
            self._entry(worker)
        sent = [(worker, *self.links.request_snapshot(worker)) for worker in sorted(set(workers))]
        for _, _, ack in sent:
            ack.add_done_callback(_retrieved)
        if request.wait:
            await asyncio.gather(*(self._settled(ack) for _, _, ack in sent))
        snapshots = []
        for worker, snapshot_id, _ in sent:
            is_complete, num_pages, _ = self.links.snapshot_progress(worker, snapshot_id)
            snapshots.append(WorkerSnapshot(worker, snapshot_id, is_complete, num_pages))
        return snapshots

    @staticmethod
    async def _settled(ack: asyncio.Future[CommandAck]) -> None:
        """Wait for the ack; a failed or missing one shows as an incomplete snapshot."""
        with contextlib.suppress(KvtierError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(ack), SNAPSHOT_ACK_TIMEOUT_S)


def _retrieved(future: asyncio.Future[CommandAck]) -> None:
    if not future.cancelled():
        future.exception()  # a snapshot nobody waits for may fail unobserved
