"""Drain migration: before a draining worker's cache is dropped, its pinned prefixes and its most
valuable pages move to peers.

    WorkerAdmin._empty(w), once w is idle ─► DrainMigration.migrate(w)
        for each stored pin (current epoch) whose pages w holds, pins with more replicas first:
            the prefix w holds (directory lookup), unless enough serving workers hold it already
            (max(replicas, 1))
            ─► PrefixCopier.copy: a receiver that serves the namespace and has room pulls the
               pages from w (FetchCommand: verify, install, page events) and pins them
            ─► UnpinCommand(pin) to w only: its copies are now droppable, and the drop that
               follows empties w
        until ``budget_bytes`` (``ControllerConfig.drain_migrate_bytes``) is spent
        then, with what is left of the budget shared among w's namespaces: for each, the
        worker of the same model with the most free pages pulls w's most valuable pages of it
        (FetchCommand without keys: w ranks its pages by the eviction policy's value, each
        with its ancestors, and the receiver fetches those chains)
    then the drain drops the rest

Pins move with their pages: the receiver holds the prefix pinned under the same pin id, and the
directory lists it. A pin whose copy fails (no receiver with room, the fetch stopped short)
stays pinned on w, so its pages stay there, and the drain leaves them as it leaves any pinned
page. The budget counts bytes moved (pages × the worker's page size in bytes), not time: the
copies run one after another, each as fast as the link between the two workers allows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvtier.controller.cache_store import PinSpec
from kvtier.controller.cost_model import entry_bytes_per_token
from kvtier.controller.registry import WorkerEntry
from kvtier.controller.replicas import COPY_TIMEOUT_S, PIN_TIMEOUT_S, PrefixCopier, free_pages
from kvtier.controller.resync import REDIS_ERRORS
from kvtier.domain.hashing import NamespaceDigest
from kvtier.domain.records import FetchCommand, UnpinCommand, WorkerId
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.migration")


class Migrated(NamedTuple):
    num_pins: int  # moved to a peer
    num_pages: int  # copied
    num_bytes: int  # copied (estimated from the worker's page size in bytes)
    num_left: int  # pins the worker holds that did not move (budget spent, no receiver, failed copy)


class DrainMigration:
    """Moves a draining worker's pinned prefixes and most valuable pages to peers within a byte budget."""

    def __init__(self, copier: PrefixCopier, budget_bytes: int) -> None:
        self.copier = copier
        self.budget_bytes = budget_bytes

    async def migrate(self, worker: WorkerId, namespaces: Iterable[NamespaceDigest] = ()) -> Migrated:
        """Pins first, then the most valuable pages of each of ``namespaces`` (module docstring)."""
        pinned = await self._migrate_pins(worker)
        entry = self.copier.registry.get(worker)
        if entry is None:
            return pinned
        page_bytes = _page_bytes(entry)
        digests = sorted(namespaces)
        num_pages = 0
        room = {e.worker_id: free_pages(e) for e in self._peers_of(entry)}
        for i, digest in enumerate(digests):
            share = (self.budget_bytes - pinned.num_bytes - num_pages * page_bytes) // (len(digests) - i)
            receiver = max(room, key=lambda w: (room[w], w), default=None)
            max_pages = min(share // page_bytes, room[receiver]) if receiver is not None else 0
            if receiver is None or max_pages < 1:
                break
            ack = await self.copier.send(receiver, FetchCommand(worker, digest, (), max_pages), COPY_TIMEOUT_S)
            num_installed = ack.num_pages if ack is not None else 0
            room[receiver] -= num_installed
            num_pages += num_installed
        log.info("drained worker's valued pages migrated", extra={
            "worker_id": worker, "num_namespaces": len(digests), "num_pages": num_pages})
        return pinned._replace(num_pages=pinned.num_pages + num_pages,
                               num_bytes=pinned.num_bytes + num_pages * page_bytes)

    def _peers_of(self, entry: WorkerEntry) -> list[WorkerEntry]:
        """Workers that can take ``entry``'s pages: live, connected, admitting, the same model."""
        sessions = self.copier.cache.links.sessions
        return [e for e in self.copier.registry.live_workers()
                if e.worker_id != entry.worker_id and not e.is_draining and e.worker_id in sessions
                and e.registration.model == entry.registration.model
                and e.registration.page_size == entry.registration.page_size and free_pages(e) > 0]

    async def _migrate_pins(self, worker: WorkerId) -> Migrated:
        copier = self.copier
        cache = copier.cache
        entry = copier.registry.get(worker)
        if entry is None or self.budget_bytes <= 0:
            return Migrated(0, 0, 0, 0)
        page_bytes = _page_bytes(entry)
        try:
            pins = [p for p in await cache.store.pins() if not cache.epochs.is_stale(p.identity)]
        except REDIS_ERRORS as exc:
            cache.router.access.report_failure(exc)
            return Migrated(0, 0, 0, 0)
        pins.sort(key=lambda p: (-p.replicas, p.pin_id))
        spent = num_pins = num_pages = num_left = 0
        for pin in pins:
            try:
                held = await copier.holders(pin)
            except REDIS_ERRORS as exc:
                cache.router.access.report_failure(exc)
                break
            num_held = held.get(worker, 0)
            if not num_held:
                continue
            if self._enough_elsewhere(pin, worker, held, num_held):
                await self._release(worker, pin)
                continue
            cost = num_held * page_bytes
            if spent + cost > self.budget_bytes:
                num_left += 1
                continue
            receivers = copier.receivers(pin.identity, num_held, {worker})
            if not receivers or not await copier.copy(pin, pin.page_keys[:num_held], worker, receivers[0]):
                num_left += 1
                continue
            spent += cost
            num_pins += 1
            num_pages += num_held
            await self._release(worker, pin)
        result = Migrated(num_pins, num_pages, spent, num_left)
        log.info("drained worker's pins migrated", extra={"worker_id": worker, **result._asdict()})
        return result

    def _enough_elsewhere(self, pin: PinSpec, worker: WorkerId, held: dict[WorkerId, int], num_held: int) -> bool:
        """Whether max(replicas, 1) serving workers other than ``worker`` hold what it holds."""
        registry = self.copier.registry
        others = [w for w, n in held.items() if w != worker and n >= num_held
                  and (e := registry.get(w)) is not None and not e.is_draining]
        return len(others) >= max(pin.replicas, 1)

    async def _release(self, worker: WorkerId, pin: PinSpec) -> None:
        """The pin leaves ``worker`` only (the stored pin stays, for the workers that hold it)."""
        await self.copier.send(worker, UnpinCommand(pin.pin_id), PIN_TIMEOUT_S)


def _page_bytes(entry: WorkerEntry) -> int:
    return max(1, int(entry_bytes_per_token(entry) * entry.registration.page_size))
