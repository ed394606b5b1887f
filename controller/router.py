"""Routing: rank the live workers for a request by cached prefix, tier and load (DESIGN §3).

The score and the ranking are pure (``kvtier/policy/routing.py``): the prefix each worker
holds, by the fastest tier of each page (``Directory.lookup``), weighed against its load as
of its last heartbeat; the session's worker first while it is not overloaded. Every live
worker that serves the namespace is listed, so a client can fall back down the list. When
none does, Route fails and says why (``unserved_reason``): UNAVAILABLE when no worker is live
or all that serve it are draining, NOT_FOUND naming the first namespace field no live worker
has, with the served values.

When the directory cannot be read the prefix terms are 0 (the ranking is affinity, then
least loaded) and the decision is ``degraded`` with the reason; Route never fails because
Redis did. Derivation and examples: ``docs/decisions/0003-controller.md``.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

import grpc
import grpc.aio

from kvtier.cache.epochs import EpochTable
from kvtier.controller.cost_model import rank_entries_by_ttft
from kvtier.controller.directory_records import PrefixLookup
from kvtier.controller.registry import Registry, WorkerEntry
from kvtier.controller.resync import REDIS_ERRORS, DirectoryAccess
from kvtier.controller.route_hashing import RouteHashing
from kvtier.domain.errors import NotFound, ResourceExhausted, Unavailable
from kvtier.domain.hashing import (
    NamespaceDigest,
    NamespaceIdentity,
    PackedKeys,
    PageKey,
    namespace_digest,
    page_keys,
)
from kvtier.domain.records import (
    LookupRequest,
    LookupResult,
    ModelIdentity,
    Policy,
    Prefix,
    RouteDecision,
    RouteRequest,
    ServedModel,
    TokenPrefix,
    TokensByTier,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.policy.routing import Candidate, RouterParams, WorkerLoad, rank_workers
from kvtier.rpc._gen import router_pb2, router_pb2_grpc
from kvtier.rpc.auth import Principal
from kvtier.rpc.auth_interceptor import principal_name as principal_name
from kvtier.rpc.auth_interceptor import principal_tenant as principal_tenant
from kvtier.rpc.auth_interceptor import resolve_tenant as resolve_tenant
from kvtier.rpc.convert.router import (
    to_proto_route_decision,
    to_proto_served_models,
)
from kvtier.rpc.status import rpc_errors
from kvtier.rpc.tickets import TicketSigner
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


# The namespace fields a worker must match to serve a request, in the order a reason names the
# first that differs (``unserved_reason``): the model, then what changes its KV bytes.
_SERVED_FIELDS = ("model_id", "weights_digest", "rope_config", "kv_dtype", "page_size")


def _served_value(entry: WorkerEntry, name: str) -> object:
    return entry.registration.page_size if name == "page_size" else getattr(entry.registration.model, name)


def unserved_reason(namespace: NamespaceIdentity, live: Sequence[WorkerEntry]) -> Unavailable | NotFound:
    """Why no candidate serves ``namespace`` among the ``live`` workers: none is live, those that
    serve it are draining (both UNAVAILABLE: retry later), or the first namespace field, in
    ``_SERVED_FIELDS`` order, that no live worker matching the fields before it has (NOT_FOUND,
    naming the field and the served values)."""
    if not live:
        return Unavailable("no live worker is registered with the controller; start one, or check `kvtier workers`")
    if any(e.serves(namespace) for e in live):
        return Unavailable(f"every worker serving model {namespace.model_id!r} is draining; retry, or resume one "
                           "with `kvtier drain --resume`")
    matching = list(live)
    for name in _SERVED_FIELDS:
        narrowed = [e for e in matching if _served_value(e, name) == getattr(namespace, name)]
        if not narrowed:
            served = sorted({repr(_served_value(e, name)) for e in matching})
            where = "" if name == "model_id" else f" for model {namespace.model_id!r}"
            return NotFound(
                f"namespace.{name} is {getattr(namespace, name)!r}, which no live worker serves{where}; served: "
                f"{', '.join(served)}. Router.ListModels (`kvtier models`) lists the exact namespace fields to send",
                field=f"namespace.{name}",
            )
        matching = narrowed
    adapters = sorted({a for e in matching for a in e.registration.adapters})
    return NotFound(
        f"namespace.adapter {namespace.adapter!r} is not loaded on any live worker serving model "
        f"{namespace.model_id!r}; loaded: {', '.join(map(repr, adapters)) or 'none (the base model only)'}",
        field="namespace.adapter",
    )


def served_models(live: Sequence[WorkerEntry], tenant: str) -> tuple[ServedModel, ...]:
    """The models ``live`` workers serve, one per distinct set of namespace fields, sorted by
    model id then page size; ``tenant`` fills each namespace's tenant field."""
    groups: dict[tuple[ModelIdentity, int], list[WorkerEntry]] = {}
    for entry in live:
        if not entry.is_draining:
            groups.setdefault((entry.registration.model, entry.registration.page_size), []).append(entry)
    models = []
    for (model, page_size), entries in groups.items():
        namespace = NamespaceIdentity(
            model_id=model.model_id, weights_digest=model.weights_digest, tokenizer_digest=model.tokenizer_digest,
            rope_config=model.rope_config, kv_dtype=model.kv_dtype, page_size=page_size, tenant=tenant,
        )
        facts = next((e.registration.facts for e in entries if e.registration.facts is not None), None)
        adapters = tuple(sorted({a for e in entries for a in e.registration.adapters}))
        models.append(ServedModel(namespace=namespace, facts=facts, adapters=adapters, num_workers=len(entries)))
    return tuple(sorted(models, key=lambda m: (m.namespace.model_id, m.namespace.page_size,
                                                m.namespace.weights_digest, m.namespace.kv_dtype)))


def prefix_page_keys(namespace: NamespaceIdentity, prefix: Prefix) -> tuple[NamespaceDigest, Sequence[PageKey]]:
    """The server-derived digest and the prefix's page keys under it (given keys are used as is:
    looked up under this digest only, so a key of another namespace or tenant never matches)."""
    digest = namespace_digest(namespace)
    if isinstance(prefix, TokenPrefix):
        return digest, page_keys(digest, prefix.token_ids, namespace.page_size)
    keys = prefix.page_keys
    return digest, keys if isinstance(keys, PackedKeys) else list(keys)


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
        if not entries:
            raise unserved_reason(namespace, self.registry.live_workers())
        matched: dict[WorkerId, TokensByTier] = {}
        degraded: str | None = None
        digest, keys = prefix_page_keys(namespace, request.prefix)  # once: the session bookkeeping uses them too
        if entries and keys:
            result, degraded = await self._lookup(digest, keys)
            if result is not None:
                page_size = namespace.page_size
                matched = {m.worker: m.matched_tokens(page_size) for m in result.matches}
        # Sessions are keyed by (tenant, id): another tenant's session of the same id is not this one.
        session = (namespace.tenant, request.session_id) if request.session_id else None
        affinity = self.registry.affinity(session) if session else None
        candidates = [Candidate(e.worker_id, e.address, worker_load(e)) for e in entries]
        if self.params.rank_by_ttft and degraded is None:  # kvtier.controller.cost_model
            prompt_tokens = (len(request.prefix.token_ids) if isinstance(request.prefix, TokenPrefix)
                             else len(keys) * namespace.page_size)
            ranked = rank_entries_by_ttft(entries, candidates, matched, prompt_tokens=prompt_tokens,
                                          page_size=namespace.page_size, params=self.params, affinity=affinity)
            if ranked:  # the pick's queue, until its next heartbeat shows the request
                pick = ranked[0]
                covered = max(pick.matched_tokens.total_tokens, pick.fetch.num_pages * namespace.page_size
                              if pick.fetch is not None else 0)
                self.registry.routed(pick.worker_id, max(prompt_tokens - covered, 1))
        else:
            ranked = rank_workers(candidates, matched, self.params, affinity)
        if request.session_id and self.on_session_route is not None:
            try:
                top = ranked[0].worker_id if ranked else None
                self.on_session_route(
                    request.session_id, tenant=namespace.tenant, worker=top,
                    digest=digest, num_tokens=len(keys) * namespace.page_size,
                    matched=None if degraded or top is None else matched.get(top, TokensByTier()),
                    owner=caller.name if caller is not None else "",
                )
            except ResourceExhausted:  # the tenant is at its cap of live sessions
                raise
            except Exception as exc:  # session bookkeeping must never fail a Route
                log.warning("session bookkeeping on Route failed", extra={
                    "session_id": request.session_id, "reason": str(exc)})
        if session and ranked:
            self.registry.set_affinity(session, ranked[0].worker_id)
        return RouteDecision(workers=ranked, degraded_reason=degraded)

    def list_models(self, caller: Principal | None) -> tuple[ServedModel, ...]:
        """The models live workers serve, with the caller's tenant filled in when its credential
        is bound to exactly one (an admin, several tenants or authentication off: empty)."""
        tenants = caller.tenants if caller is not None else frozenset()
        return served_models(self.registry.live_workers(), next(iter(tenants)) if len(tenants) == 1 else "")

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
    """Thin shell: convert, route, convert back. Standbys answer UNAVAILABLE naming the leader.

    Route takes its request as bytes (``add_router_servicer``): a large one is decoded and
    hashed off the event loop (``kvtier.controller.route_hashing``). With ``tickets``
    (authentication on) every ranked worker comes with a Route ticket for the caller's tenant:
    what the frontend sends that worker's Generate instead of its token."""

    def __init__(self, router: Router, hashing: RouteHashing | None = None, *,
                 tickets: TicketSigner | None = None) -> None:
        self._router = router
        self._hashing = hashing or RouteHashing()
        self._tickets = tickets

    @rpc_errors
    async def Route(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        self._router.access.check_serving()
        caller = principal_tenant(context)
        route = await self._hashing.request(request, caller, self._router.epochs)
        decision = await tracing.traced_route(  # the `route` span (a no-op with tracing off)
            self._router.route(route, caller), route, context.invocation_metadata()
        )
        if self._tickets is not None and caller is not None:
            decision = self._tickets.with_tickets(decision, resolve_tenant(route.namespace, caller).tenant)
        return to_proto_route_decision(decision)

    @rpc_errors
    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        self._router.access.check_serving()  # workers link to the leader: a standby knows none
        return to_proto_served_models(self._router.list_models(principal_tenant(context)))


def add_router_servicer(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """``router_pb2_grpc.add_RouterServicer_to_server``, with Route's request left as bytes."""
    handlers = {
        "Route": grpc.unary_unary_rpc_method_handler(
            servicer.Route, response_serializer=router_pb2.RouteResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=router_pb2.ListModelsRequest.FromString,
            response_serializer=router_pb2.ListModelsResponse.SerializeToString),
    }
    service = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
