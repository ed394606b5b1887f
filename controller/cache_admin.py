"""Operator actions on cached pages: Invalidate, Pin / Unpin, Evict (DESIGN §5.3, §6).

Every action names namespaces by identity fields and resolves them as Route does
(``Router.resolve_namespace``: the caller's tenant, the current policy epoch), never from
a raw digest, so an operator reaches exactly the pages Route would.

Invalidate — raise the policy epoch of a scope (a namespace, a tenant, a model, all)::

    Invalidate(scope) ─► CacheStore.bump_epoch (Redis, fenced: a new epoch above all before)
        ─► the router's EpochTable: Route and Lookup derive the new digests at once
        ─► forget the pins the new epoch makes stale
        ─► InvalidateCommand(scope, epoch) to every connected worker, acknowledged once the
           worker derives new digests too; it drops the stale pages (now, or in background
           passes while running sequences hold them), and its DROP page events remove the
           old namespaces' directory entries (nothing here deletes them: a worker's later
           DROP of an entry deleted behind its back would read as divergence)
    answer: the new epoch, and how many workers acknowledged it

Every (re)connecting worker is sent the whole epoch table first (``on_open``), then every
pin: a restarted worker derives current digests from its first request on, and one that
missed an invalidation while disconnected reclaims what it missed.

Pin — keep a prefix's pages in their tier under pressure: the prefix's page keys under
the current digest are stored as a pin (Redis, expiring with its TTL) and sent as a
PinCommand to every connected worker; each pins the pages it holds in ``tier`` or faster.
With ``replicas`` N the pin also keeps N workers holding the prefix (``controller/replicas.py``).
Unpin removes the stored pin (NOT_FOUND for an unknown or lapsed id) and sends UnpinCommand.

Evict — Drop (or Demote to ``demote_to_tier``) the prefix's pages and everything below
them, or the whole namespace (``whole_namespace`` commands: each worker resolves what it
holds), on one worker or all. Pages held by running sequences or pinned are kept; the
answer counts the pages dropped or demoted, the log counts the kept ones.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NamedTuple, TypeVar

from kvtier.cache.epochs import EpochTable
from kvtier.controller.cache_store import CacheStore, PinSpec
from kvtier.controller.link_servicer import WorkerLinks
from kvtier.controller.resync import REDIS_ERRORS, describe
from kvtier.controller.router import Router, prefix_page_keys, resolve_tenant
from kvtier.domain.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity, PageKey, namespace_digest
from kvtier.domain.records import (
    Command,
    CommandAck,
    DemoteCommand,
    DropCommand,
    EvictRequest,
    EvictResult,
    InvalidateCommand,
    InvalidateRequest,
    InvalidateResult,
    InvalidationScope,
    PinCommand,
    PinId,
    PinRequest,
    PinResult,
    Prefix,
    TokenPrefix,
    UnpinCommand,
    UnpinRequest,
    UnpinResult,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.rpc.auth import Principal, Role
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.cache_admin")

T = TypeVar("T")

COMMAND_TIMEOUT_S = 10.0
_ERRORS: dict[str, type[KvtierError]] = {
    cls.code: cls for cls in (InvalidArgument, NotFound, ResourceExhausted, FailedPrecondition, PermissionDenied,
                              Unavailable, DeadlineExceeded, Cancelled)
}


class _Reply(NamedTuple):
    worker: WorkerId
    ack: CommandAck | None  # None: the worker did not answer (link closed, timeout)


def _quiet(future: asyncio.Future[CommandAck]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: nobody awaits a re-sent command


def resolve_scope(scope: InvalidationScope, caller: Principal | None) -> InvalidationScope:
    """The scope bound to what the caller may act for: an admin (and anyone while authentication
    is off) any scope; a tenant-bound caller its own tenant, or namespaces of it, only."""
    if caller is None or caller.role is Role.ADMIN:
        if scope.namespace is not None:
            return InvalidationScope(namespace=resolve_tenant(scope.namespace, caller))
        return scope
    if (namespace := scope.namespace) is not None:
        return InvalidationScope(namespace=_rebased(lambda: resolve_tenant(namespace, caller),
                                                    "scope.namespace.tenant"))
    if scope.tenant is not None:
        tenant = scope.tenant
        return InvalidationScope(tenant=_rebased(lambda: caller.tenant_for(tenant), "scope.tenant"))
    raise PermissionDenied("scope: only an admin may invalidate a whole model or every namespace; "
                           "name a tenant", field="scope")


def _rebased(resolve: Callable[[], T], field: str) -> T:
    """``resolve()``, its tenant errors naming ``field`` (the tenant sits elsewhere in a scope)."""
    try:
        return resolve()
    except KvtierError as err:
        raise type(err)(err.message.replace("namespace.tenant", field, 1), field=field) from None


class CacheAdmin:
    """Admin.Invalidate, Pin, Unpin and Evict over the router, the worker links and Redis."""

    def __init__(self, router: Router, links: WorkerLinks, store: CacheStore) -> None:
        self.router = router
        self.links = links
        self.store = store
        self._tasks: set[asyncio.Task[None]] = set()
        # Held from reading or writing the stored pins until their commands are queued, so the
        # commands reach each stream in the order of the store's changes (a pin re-sent on a
        # reconnect can never land after the Unpin that removed it).
        self._pins_lock = asyncio.Lock()
        self.on_replicated_pin: Callable[[], None] | None = None  # wakes the replica keeper

    @property
    def epochs(self) -> EpochTable:
        return self.router.epochs

    # ---- start-up and reconnects ------------------------------------------------------------

    async def load(self) -> None:
        """Merge the stored epoch table into the router's (epochs only rise); ``Unavailable``
        without Redis."""
        try:
            entries = await self.store.load_epochs()
        except REDIS_ERRORS as exc:
            self.router.access.report_failure(exc)
            raise Unavailable(f"the epoch table (Redis) is unreachable: {describe(exc)}") from None
        for entry in entries:
            self.epochs.install(entry.scope, entry.epoch)

    def on_resync(self, everything: bool) -> None:
        """After an election or a Redis outage: read the epoch table again (another leader may
        have invalidated meanwhile)."""
        self._spawn(self._reload())

    def on_open(self, worker: WorkerId) -> None:
        """A worker (re)connected: the epoch table goes first, then every pin."""
        for entry in self.epochs.entries():
            self.links.send_command(worker, InvalidateCommand(entry.scope, entry.epoch)).add_done_callback(_quiet)
        self._spawn(self._resend_pins(worker))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload(self) -> None:
        try:
            await self.load()
        except Unavailable:
            pass  # reported; the next resync (Redis back) reloads

    async def _resend_pins(self, worker: WorkerId) -> None:
        async with self._pins_lock:
            try:
                pins = [p for p in await self.store.pins() if not self.epochs.is_stale(p.identity)]
            except REDIS_ERRORS as exc:
                self.router.access.report_failure(exc)
                return
            for pin in pins:
                try:
                    self.links.send_command(worker, pin_command(pin)).add_done_callback(_quiet)
                except KvtierError:
                    return  # the stream closed again: the next one sends them
        if pins:
            log.info("pins sent to a connected worker", extra={"worker_id": worker, "num_pins": len(pins)})

    # ---- Invalidate -------------------------------------------------------------------------

    async def invalidate(self, request: InvalidateRequest, caller: Principal | None) -> InvalidateResult:
        scope = resolve_scope(request.scope, caller)
        fence_token = self.router.access.directory.fence_token
        if fence_token is None:
            raise Unavailable("this controller is not the leader (any more); retry on the leader")
        try:
            epoch = await self.store.bump_epoch(scope, fence_token=fence_token, floor=self.epochs.max_epoch + 1)
        except REDIS_ERRORS as exc:
            self.router.access.report_failure(exc)
            raise Unavailable(f"the epoch table (Redis) is unreachable: {describe(exc)}; retry") from None
        if epoch is None:
            await self.router.access.fenced()
            raise Unavailable("a newer leader exists; retry on the leader")
        self.epochs.install(scope, epoch)
        await self._forget_stale_pins()
        replies = await self._broadcast(self._live_workers(), InvalidateCommand(scope, epoch))
        notified = sum(1 for r in replies if r.ack is not None and r.ack.ok)
        log.info("namespaces invalidated", extra={
            "scope": _describe_scope(scope), "policy_epoch": epoch, "num_workers_notified": notified,
            "num_workers": len(replies), "num_pages_dropped": sum(r.ack.num_pages for r in replies if r.ack),
            "reason": request.reason})
        return InvalidateResult(policy_epoch=epoch, num_workers_notified=notified)

    async def _forget_stale_pins(self) -> None:
        try:
            async with self._pins_lock:
                pins = await self.store.pins()
                await self.store.delete_pins([p.pin_id for p in pins if self.epochs.is_stale(p.identity)])
        except REDIS_ERRORS as exc:
            # The workers release them with the invalidation anyway, and stale pins are never re-sent.
            self.router.access.report_failure(exc)

    # ---- Pin / Unpin ------------------------------------------------------------------------

    async def pin(self, request: PinRequest, caller: Principal | None) -> PinResult:
        if request.ttl_s is not None and request.ttl_s < 1:
            raise InvalidArgument(f"ttl_s must be >= 1 second, got {request.ttl_s}; leave it unset for no expiry",
                                  field="ttl_s")
        identity, digest, keys = self._resolve(request.namespace, request.prefix, caller)
        expires_at_ms = None if request.ttl_s is None else int(time.time() * 1000) + request.ttl_s * 1000
        pin = PinSpec(PinId(f"pin-{uuid.uuid4().hex[:16]}"), identity, digest, tuple(keys), request.tier,
                      expires_at_ms, request.replicas)
        async with self._pins_lock:
            try:
                await self.store.put_pin(pin)
            except REDIS_ERRORS as exc:
                self.router.access.report_failure(exc)
                raise Unavailable(f"the pin store (Redis) is unreachable: {describe(exc)}; retry") from None
            sent = self._send_all(self._live_workers(), pin_command(pin))
        replies = await self._acks(sent)
        num_pinned = sum(r.ack.num_pages for r in replies if r.ack is not None and r.ack.ok)
        log.info("prefix pinned", extra={"pin_id": pin.pin_id, "tier": pin.tier.label, "num_pages": len(keys),
                                         "num_pinned": num_pinned, "ttl_s": request.ttl_s,
                                         "replicas": request.replicas})
        if request.replicas and self.on_replicated_pin is not None:
            self.on_replicated_pin()
        return PinResult(pin_id=pin.pin_id, num_pinned_pages=num_pinned, expires_at_ms=expires_at_ms)

    async def unpin(self, request: UnpinRequest) -> UnpinResult:
        async with self._pins_lock:
            try:
                existed = await self.store.delete_pins([request.pin_id])
            except REDIS_ERRORS as exc:
                self.router.access.report_failure(exc)
                raise Unavailable(f"the pin store (Redis) is unreachable: {describe(exc)}; retry") from None
            if not existed:
                raise NotFound(f"pin_id {request.pin_id!r} names no pin (it expired, was released, or its "
                               "namespace was invalidated)", field="pin_id")
            sent = self._send_all(self._live_workers(), UnpinCommand(request.pin_id))
        replies = await self._acks(sent)
        released = sum(r.ack.num_pages for r in replies if r.ack is not None and r.ack.ok)
        log.info("pin released", extra={"pin_id": request.pin_id, "num_released": released})
        return UnpinResult(num_unpinned_pages=released)

    # ---- Evict ------------------------------------------------------------------------------

    async def evict(self, request: EvictRequest, caller: Principal | None) -> EvictResult:
        if request.demote_to_tier is Tier.HBM:
            raise InvalidArgument("demote_to_tier must be a tier below HBM (dram or nvme); leave it unset "
                                  "to drop the pages", field="demote_to_tier")
        if request.prefix is None:
            identity = self.router.resolve_namespace(request.namespace, caller)
            digest = namespace_digest(identity)
            keys: tuple[PageKey, ...] = ()
        else:
            identity, digest, key_list = self._resolve(request.namespace, request.prefix, caller)
            keys = tuple(key_list)
        if request.worker_id is not None:
            if request.worker_id not in self.links.sessions:
                raise NotFound(f"worker_id {request.worker_id!r} is not connected to this controller; "
                               "`kvtier workers` lists them", field="worker_id")
            workers = [request.worker_id]
        else:
            workers = self._live_workers()
        command: Command
        if request.demote_to_tier is None:
            command = DropCommand(digest, keys, whole_namespace=not keys)
        else:
            command = DemoteCommand(digest, keys, request.demote_to_tier, whole_namespace=not keys)
        replies = await self._broadcast(workers, command)
        answered = [r.ack for r in replies if r.ack is not None]
        # A Drop that had to keep pages answers FAILED_PRECONDITION with its counts: still done.
        done = [a for a in answered if a.ok or a.num_pages or a.num_skipped_pages]
        failed = [a for a in answered if a not in done]
        if failed and not done:
            first = failed[0]
            raise _ERRORS.get(first.error_code or "", FailedPrecondition)(first.error_message)
        num_pages = sum(a.num_pages for a in done)
        log.info("pages evicted", extra={
            "action": "drop" if request.demote_to_tier is None else f"demote to {request.demote_to_tier.label}",
            "whole_namespace": not keys, "num_pages": num_pages,
            "num_kept": sum(a.num_skipped_pages for a in done), "num_workers": len(workers),
            "num_failed": len(failed) + len(replies) - len(answered)})
        return EvictResult(num_pages=num_pages, num_workers=len(workers))

    # ---- helpers ----------------------------------------------------------------------------

    def _resolve(
        self, namespace: NamespaceIdentity, prefix: Prefix, caller: Principal | None
    ) -> tuple[NamespaceIdentity, NamespaceDigest, Sequence[PageKey]]:
        identity = self.router.resolve_namespace(namespace, caller)
        digest, keys = prefix_page_keys(identity, prefix)
        if not keys:
            field = "token_ids" if isinstance(prefix, TokenPrefix) else "page_keys"
            raise InvalidArgument(f"{field} covers no full page (pages hold {identity.page_size} tokens); "
                                  "only full pages are cached", field=field)
        return identity, digest, keys

    def _live_workers(self) -> list[WorkerId]:
        return sorted(w for w, s in self.links.sessions.items() if not s.closed)

    def _send_all(
        self, workers: Sequence[WorkerId], command: Command
    ) -> list[tuple[WorkerId, asyncio.Future[CommandAck] | None]]:
        """Queue ``command`` on each worker's stream now (None where the stream is gone)."""
        sent: list[tuple[WorkerId, asyncio.Future[CommandAck] | None]] = []
        for worker in workers:
            try:
                sent.append((worker, self.links.send_command(worker, command)))
            except KvtierError:
                sent.append((worker, None))
        return sent

    async def _acks(self, sent: list[tuple[WorkerId, asyncio.Future[CommandAck] | None]]) -> list[_Reply]:
        """The acks of queued commands (None for a worker that did not answer in time)."""
        async def one(worker: WorkerId, future: asyncio.Future[CommandAck] | None) -> _Reply:
            if future is None:
                return _Reply(worker, None)
            try:
                return _Reply(worker, await asyncio.wait_for(future, COMMAND_TIMEOUT_S))
            except (TimeoutError, KvtierError) as exc:
                log.warning("worker did not acknowledge a cache command",
                            extra={"worker_id": worker, "reason": str(exc) or "timeout"})
                return _Reply(worker, None)

        return list(await asyncio.gather(*(one(w, f) for w, f in sent)))

    async def _broadcast(self, workers: Sequence[WorkerId], command: Command) -> list[_Reply]:
        """Send ``command`` to each worker and wait for the acks (None for a worker that did not answer)."""
        return await self._acks(self._send_all(workers, command))


def pin_command(pin: PinSpec) -> PinCommand:
    return PinCommand(pin.pin_id, pin.namespace_digest, pin.page_keys, pin.tier, pin.expires_at_ms)


def _describe_scope(scope: InvalidationScope) -> str:
    """For logs: names and ids only (a namespace by model and tenant)."""
    if scope.all_namespaces:
        return "all namespaces"
    if scope.tenant is not None:
        return f"tenant {scope.tenant}"
    if scope.model_id is not None:
        return f"model {scope.model_id}"
    assert scope.namespace is not None
    return f"namespace of model {scope.namespace.model_id}, tenant {scope.namespace.tenant or '-'}"
