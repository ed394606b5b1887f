"""Copies of pinned prefixes between workers: the receiver pulls from a holder (peer fetch).

    PrefixCopier.copy(pin, source, receiver)
        FetchCommand(source, digest, keys) ─► receiver: pulls the group from the source,
            verifies each page, installs it, publishes page events (the directory lists it)
        ─► the pin again, to the receiver: it pins the pages that arrived (``Holds.pin``)

    ReplicaKeeper (every ``replica_check_interval_s``, and when a pin with replicas is made)
        for each pin with ``replicas`` N: the live workers that hold its whole prefix
        (directory lookup), draining ones not counted; fewer than N and a survivor holds it
        ─► copy from the survivor to the receivers with the most room, until N hold it

A receiver is a live, connected worker that is not draining, serves the pin's namespace
(``WorkerEntry.serves``) and has free HBM and DRAM pages for the whole prefix (a fetch takes no
page from anyone). A lost holder shows as a directory miss once its lease expires, a drained
one as ``is_draining`` at once; either way a copy is made from whoever still holds the prefix.
Only one copy of a pin is in flight at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from kvtier.controller.cache_admin import CacheAdmin, pin_command
from kvtier.controller.cache_store import PinSpec
from kvtier.controller.registry import Registry, WorkerEntry
from kvtier.controller.resync import REDIS_ERRORS
from kvtier.domain.errors import KvtierError
from kvtier.domain.hashing import NamespaceIdentity, PageKey
from kvtier.domain.records import Command, CommandAck, FetchCommand, PinId, WorkerId
from kvtier.domain.tiers import Tier
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.replicas")

# A copy is a fetch of at most a few groups; the receiver gives each group 60 s.
COPY_TIMEOUT_S = 180.0
PIN_TIMEOUT_S = 10.0


def free_pages(entry: WorkerEntry) -> int:
    """Pages a fetch may install into: free HBM and DRAM pages at the last heartbeat."""
    return sum(occ.free_pages for occ in entry.tiers if occ.tier in (Tier.HBM, Tier.DRAM))


class PrefixCopier:
    """Finds holders and receivers of a prefix and copies it between them."""

    def __init__(self, cache: CacheAdmin, registry: Registry) -> None:
        self.cache = cache
        self.registry = registry
        self.num_copies = 0
        self.num_failed = 0

    async def holders(self, pin: PinSpec, keys: Sequence[PageKey] | None = None) -> dict[WorkerId, int]:
        """Live workers holding pages of ``keys`` (default: the pin's) from depth 1: worker → pages held."""
        lookup = await self.cache.router.access.directory.lookup(pin.namespace_digest, list(keys or pin.page_keys))
        return {m.worker: m.num_pages for m in lookup.matches}

    def receivers(self, identity: NamespaceIdentity, num_pages: int, exclude: set[WorkerId]) -> list[WorkerId]:
        """Workers that can take ``num_pages`` pages of ``identity``'s namespace, most room first."""
        entries = [
            e for e in self.registry.live_workers()
            if e.worker_id not in exclude and not e.is_draining and e.is_connected
            and e.worker_id in self.cache.links.sessions and e.serves(identity) and free_pages(e) >= num_pages
        ]
        entries.sort(key=lambda e: (-free_pages(e), e.worker_id))
        return [e.worker_id for e in entries]

    async def copy(self, pin: PinSpec, keys: tuple[PageKey, ...], source: WorkerId, receiver: WorkerId) -> bool:
        """``keys`` (a chain from the pin's root) from ``source`` to ``receiver``, then the pin to
        ``receiver``; True when the receiver then holds every page of ``keys``."""
        ack = await self.send(receiver, FetchCommand(source, pin.namespace_digest, keys), COPY_TIMEOUT_S)
        if ack is None or not ack.ok:
            self.num_failed += 1
            log.warning("prefix copy failed", extra={
                "pin_id": pin.pin_id, "source": source, "receiver": receiver,
                "reason": "no answer" if ack is None else ack.error_message})
            return False
        await self.send(receiver, pin_command(pin), PIN_TIMEOUT_S)
        self.num_copies += 1
        log.info("prefix copied", extra={"pin_id": pin.pin_id, "source": source, "receiver": receiver,
                                         "num_pages": len(keys), "num_installed": ack.num_pages})
        return True

    async def send(self, worker: WorkerId, command: Command, timeout_s: float) -> CommandAck | None:
        try:
            return await asyncio.wait_for(self.cache.links.send_command(worker, command), timeout_s)
        except (KvtierError, TimeoutError):
            return None


class ReplicaKeeper:
    """Keeps ``PinSpec.replicas`` workers holding each replicated pin (module docstring)."""

    def __init__(self, copier: PrefixCopier, interval_s: float) -> None:
        self.copier = copier
        self.interval_s = interval_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._copying: set[PinId] = set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvtier-replica-keeper")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            if not self.copier.cache.router.access.is_leader:
                continue
            try:
                await self.check()
            except REDIS_ERRORS as exc:
                self.copier.cache.router.access.report_failure(exc)
            except Exception as exc:  # the next pass tries again
                log.warning("replica check failed", extra={"reason": f"{type(exc).__name__}: {exc}"})

    async def check(self) -> int:
        """One pass over the replicated pins; the copies made."""
        cache = self.copier.cache
        pins = [p for p in await cache.store.pins() if p.replicas and not cache.epochs.is_stale(p.identity)]
        num_copies = 0
        for pin in pins:
            if pin.pin_id not in self._copying:
                self._copying.add(pin.pin_id)
                try:
                    num_copies += await self._keep(pin)
                finally:
                    self._copying.discard(pin.pin_id)
        return num_copies

    async def _keep(self, pin: PinSpec) -> int:
        held = await self.copier.holders(pin)
        whole = [w for w, n in held.items() if n == len(pin.page_keys)]
        if not whole:
            return 0  # nobody holds the whole prefix: nothing to copy from (a request computes it)
        registry = self.copier.registry
        serving = [w for w in whole if (e := registry.get(w)) is not None and not e.is_draining]
        missing = pin.replicas - len(serving)
        if missing <= 0:
            return 0
        source = serving[0] if serving else whole[0]
        num_copies = 0
        for receiver in self.copier.receivers(pin.identity, len(pin.page_keys), set(whole))[:missing]:
            num_copies += await self.copier.copy(pin, pin.page_keys, source, receiver)
        return num_copies
