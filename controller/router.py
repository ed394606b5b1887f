"""Routing: rank the live workers for a request by cached prefix, tier and load (DESIGN §3).

The score and the ranking are pure (``kvtier/policy/routing.py``): the prefix each worker
holds, by the fastest tier of each page (``Directory.lookup``), weighed against its load as
of its last heartbeat; the session's worker first while it is not overloaded.

When the directory cannot be read the prefix terms are 0 (the ranking is affinity, then
least loaded) and the decision is ``degraded`` with the reason; Route never fails because
Redis did. Derivation and examples: ``docs/decisions/0003-controller.md``.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

import grpc.aio

from kvtier.cache.epochs import EpochTable
from kvtier.controller.directory_records import PrefixLookup
from kvtier.controller.registry import Registry, WorkerEntry
from kvtier.controller.resync import REDIS_ERRORS, DirectoryAccess
from kvtier.domain.errors import Unavailable
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity, PageKey, namespace_digest, page_keys
from kvtier.domain.records import (
    LookupRequest,
    LookupResult,
    Policy,
    Prefix,
    RouteDecision,
    RouteRequest,
    TokenPrefix,
    TokensByTier,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.policy.routing import Candidate, RouterParams, WorkerLoad, rank_workers
from kvtier.rpc import convert
from kvtier.rpc._gen import router_pb2, router_pb2_grpc
from kvtier.rpc.auth import Principal
from kvtier.rpc.auth_interceptor import principal_name as principal_name
from kvtier.rpc.auth_interceptor import principal_tenant as principal_tenant
from kvtier.rpc.auth_interceptor import resolve_tenant as resolve_tenant
from kvtier.rpc.status import rpc_errors
from kvtier.runtime import tracing
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.router")


def worker_load(entry: WorkerEntry) -> WorkerLoad:
    """The load terms of the score, as of ``entry``'s last heartbeat."""
    hbm = entry.occupancy(Tier.HBM)
    return WorkerLoad(
        queue_depth=entry.queue_depth,
        num_running_seqs=entry.num_running_seqs,
        hbm_total_pages=hbm.total_pages if hbm else 0,
        hbm_available_pages=hbm.free_pages + hbm.cached_pages if hbm else 0,
    )


def prefix_page_keys(namespace: NamespaceIdentity, prefix: Prefix) -> tuple[NamespaceDigest, list[PageKey]]:
    """The server-derived digest and the prefix's page keys under it (given keys are used as is:
    looked up under this digest only, so a key of another namespace or tenant never matches)."""
    digest = namespace_digest(namespace)
    if isinstance(prefix, TokenPrefix):
        return digest, page_keys(digest, prefix.token_ids, namespace.page_size)
    return digest, list(prefix.page_keys)


# -- authentication -----------------------------------------------------------------------------
# The caller comes from kvtier.rpc.auth_interceptor (one definition for every server); re-exported
# here for the controller's servicers. ``resolve_tenant(namespace, principal_tenant(context))``
# binds a request's namespace to the tenants the caller may act for.


# -- the router -------------------------------------------------------------------------------


class Router:
    """Ranks workers from the registry (who can serve) and the directory (who holds what)."""

    def __init__(self, registry: Registry, access: DirectoryAccess, params: RouterParams) -> None:
        self.registry = registry
        self.access = access
        self.params = params
        # Set by the controller: the session tracker hears every Route that names a session
        # (``Orchestrator.route_seen``: it returns at once, the bookkeeping runs in the background).
        self.on_session_route: Callable[..., None] | None = None
        # Policy epochs (DESIGN §5.3), kept current by kvtier.controller.cache_admin.
        self.epochs = EpochTable()

    def resolve_namespace(self, namespace: NamespaceIdentity, caller: Principal | None) -> NamespaceIdentity:
        """The identity a request's digest is derived from: the caller's tenant, the current epoch.

        Every controller path that turns identity fields into a digest goes through here
        (Route, Lookup, Pin, Evict), so an invalidated digest is unreachable from all of them.
        """
        return self.epochs.apply(resolve_tenant(namespace, caller))

    def apply_policy(self, policy: Policy) -> None:
        """Rank with ``policy``'s tier weights from now on (a tier without one weighs 0)."""
        self.params = dataclasses.replace(self.params, tier_weights=dict(policy.tier_weights))

    async def route(self, request: RouteRequest, caller: Principal | None) -> RouteDecision:
        """Rank workers for ``request`` on behalf of ``caller`` (None: authentication off)."""
        namespace = self.resolve_namespace(request.namespace, caller)
        entries = self.registry.candidates(namespace)
        matched: dict[WorkerId, TokensByTier] = {}
        degraded: str | None = None
        digest, keys = prefix_page_keys(namespace, request.prefix)  # once: the session bookkeeping uses them too
        if entries and keys:
            result, degraded = await self._lookup(digest, keys)
            if result is not None:
                page_size = namespace.page_size
                matched = {m.worker: m.matched_tokens(page_size) for m in result.matches}
        affinity = self.registry.affinity(request.session_id) if request.session_id else None
        candidates = [Candidate(e.worker_id, e.address, worker_load(e)) for e in entries]
        ranked = rank_workers(candidates, matched, self.params, affinity)
        if request.session_id and ranked:
            self.registry.set_affinity(request.session_id, ranked[0].worker_id)
        if request.session_id and self.on_session_route is not None:
            try:
                top = ranked[0].worker_id if ranked else None
                self.on_session_route(
                    request.session_id, tenant=namespace.tenant, worker=top,
                    digest=digest, num_tokens=len(keys) * namespace.page_size,
                    matched=None if degraded or top is None else matched.get(top, TokensByTier()),
                )
            except Exception as exc:  # session bookkeeping must never fail a Route
                log.warning("session bookkeeping on Route failed", extra={
                    "session_id": request.session_id, "reason": str(exc)})
        return RouteDecision(workers=ranked, degraded_reason=degraded)

    async def _lookup(
        self, digest: NamespaceDigest, keys: Sequence[PageKey]
    ) -> tuple[PrefixLookup | None, str | None]:
        """The directory's answer, or None and why not (never raises for Redis trouble)."""
        if not self.access.is_reachable:
            return None, f"directory unreachable ({self.access.last_error}); ranked by affinity and load"
        local = self.access.directory.local_lookup(digest, keys)  # the leader's mirror: no round trip
        if local is not None:
            return local, None
        try:
            # asyncio.timeout, not wait_for: wait_for wraps the lookup in a Task, and the extra
            # event-loop turns cost more than the Redis round trip itself on the Route hot path.
            async with asyncio.timeout(self.params.lookup_timeout_s):
                result = await self.access.directory.lookup(digest, keys)
        except TimeoutError:
            log.warning("directory lookup timed out", extra={"timeout_s": self.params.lookup_timeout_s})
            return None, (f"directory lookup took longer than {self.params.lookup_timeout_s:g} s; "
                          "ranked by affinity and load")
        except REDIS_ERRORS as exc:
            self.access.report_failure(exc)
            return None, f"directory unreachable ({self.access.last_error}); ranked by affinity and load"
        return result, None

    async def lookup(self, request: LookupRequest, caller: Principal | None) -> LookupResult:
        """The directory's view of a prefix (Admin.Lookup); ``Unavailable`` while Redis is down."""
        namespace = self.resolve_namespace(request.namespace, caller)
        digest, keys = prefix_page_keys(namespace, request.prefix)
        if not keys:
            return LookupResult(namespace_digest=digest, num_query_pages=0, matches=())
        try:
            async with asyncio.timeout(self.params.lookup_timeout_s):  # lookups have no socket timeout
                result = await self.access.directory.lookup(digest, keys)
        except TimeoutError:
            raise Unavailable(
                f"the directory (Redis) did not answer within {self.params.lookup_timeout_s:g} s; retry"
            ) from None
        except REDIS_ERRORS as exc:
            self.access.report_failure(exc)
            raise Unavailable(
                f"the directory (Redis) is unreachable: {self.access.last_error}; retry when "
                "`kvtier status` shows it reachable"
            ) from None
        return result.to_result(digest, namespace.page_size)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Thin shell: convert, route, convert back. Standbys answer UNAVAILABLE naming the leader."""

    def __init__(self, router: Router) -> None:
        self._router = router

    @rpc_errors
    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        self._router.access.check_serving()
        route = convert.from_proto_route_request(request)
        decision = await tracing.traced_route(  # the `route` span (a no-op with tracing off)
            self._router.route(route, principal_tenant(context)), route, context.invocation_metadata()
        )
        return convert.to_proto_route_decision(decision)
