"""Drain migration: before a draining worker's cache is dropped, its pinned prefixes move to peers.

    WorkerAdmin._empty(w), once w is idle ─► DrainMigration.migrate(w)
        for each stored pin (current epoch) whose pages w holds, pins with more replicas first:
            the prefix w holds (directory lookup), unless enough serving workers hold it already
            (max(replicas, 1))
            ─► PrefixCopier.copy: a receiver that serves the namespace and has room pulls the
               pages from w (FetchCommand: verify, install, page events) and pins them
            ─► UnpinCommand(pin) to w only: its copies are now droppable, and the drop that
               follows empties w
        until ``budget_bytes`` (``ControllerConfig.drain_migrate_bytes``) is spent
    then the drain drops the rest, as before

Pins move with their pages: the receiver holds the prefix pinned under the same pin id, and the
directory lists it. A pin whose copy fails (no receiver with room, the fetch stopped short)
stays pinned on w, so its pages stay there, and the drain leaves them as it leaves any pinned
page. Unpinned cached pages are dropped, not moved (see decision 0018).
"""

from __future__ import annotations

from typing import NamedTuple

from kvtier.controller.cache_store import PinSpec
from kvtier.controller.cost_model import entry_bytes_per_token
from kvtier.controller.replicas import PIN_TIMEOUT_S, PrefixCopier
from kvtier.controller.resync import REDIS_ERRORS
from kvtier.domain.records import UnpinCommand, WorkerId
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.migration")


class Migrated(NamedTuple):
    num_pins: int  # moved to a peer
    num_pages: int  # copied
    num_bytes: int  # copied (estimated from the worker's page size in bytes)
    num_left: int  # pins the worker holds that did not move (budget spent, no receiver, failed copy)


class DrainMigration:
    """Moves a draining worker's pinned prefixes to peers within a byte budget."""

    def __init__(self, copier: PrefixCopier, budget_bytes: int) -> None:
        self.copier = copier
        self.budget_bytes = budget_bytes

    async def migrate(self, worker: WorkerId) -> Migrated:
        copier = self.copier
        cache = copier.cache
        entry = copier.registry.get(worker)
        if entry is None or self.budget_bytes <= 0:
            return Migrated(0, 0, 0, 0)
        page_bytes = max(1, int(entry_bytes_per_token(entry) * entry.registration.page_size))
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
