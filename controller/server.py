"""The controller process: gRPC services, leader lease, lease sweeper, background reclaim.

    serve_controller(config) ─► Redis (config.redis_url, or an embedded valkey-server under
    state_dir) ─► campaign once ─► gRPC: Router, WorkerLink, Admin, grpc.health.v1, reflection
    background: lease renewal + Redis monitor (resync.py), link resyncs, Directory.sweep every
    lease_ttl/2, Directory.reclaim_step every RECLAIM_INTERVAL_S — the last two on the leader only.

Health services: "" SERVING while the server runs (standbys too: they answer UNAVAILABLE
and the Helm chart keeps them Ready); "kvtier.directory" NOT_SERVING while Redis is
unreachable; "kvtier.leader" SERVING on the leader only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from dataclasses import dataclass, field
from importlib import metadata

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from kvtier.controller.admin import AdminServicer
from kvtier.controller.cache_admin import CacheAdmin
from kvtier.controller.cache_store import CacheStore
from kvtier.controller.caller_limits import CallerLimits, limits_of
from kvtier.controller.directory import Directory
from kvtier.controller.directory_records import Outcome
from kvtier.controller.link_servicer import WorkerLinks, WorkerLinkServicer
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.migration import DrainMigration
from kvtier.controller.orchestrator import Orchestrator
from kvtier.controller.orchestrator_params import OrchestratorParams
from kvtier.controller.policy_store import PolicyInForce, PolicyStore, seed_policy
from kvtier.controller.predictor import ToolReturnPredictor
from kvtier.controller.redis_connect import RedisClient, connect
from kvtier.controller.registry import Registry
from kvtier.controller.replicas import PrefixCopier, ReplicaKeeper
from kvtier.controller.resync import REDIS_ERRORS, DirectoryAccess
from kvtier.controller.route_hashing import RouteHashing
from kvtier.controller.router import Router, RouterServicer, add_router_servicer
from kvtier.controller.sessions import SessionsServicer, SessionStore
from kvtier.controller.worker_admin import WorkerAdmin
from kvtier.controller.worker_identity import WorkerIdentity
from kvtier.domain.errors import Unavailable
from kvtier.domain.records import Command, CommandAck, ControllerStatus, SessionState, TierOccupancy, WorkerId
from kvtier.domain.tiers import Tier
from kvtier.policy.prediction import PredictorParams
from kvtier.policy.routing import RouterParams
from kvtier.rpc._gen import (
    admin_pb2,
    admin_pb2_grpc,
    router_pb2,
    sessions_pb2,
    sessions_pb2_grpc,
    worker_link_pb2,
    worker_link_pb2_grpc,
)
from kvtier.rpc.auth import TokenTableFile
from kvtier.rpc.auth_interceptor import server_interceptors
from kvtier.rpc.server_options import (
    SERVER_OPTIONS,
    advertised_host,
    bind_port,
    check_exposure,
    join_host_port,
    serve_health_only,
)
from kvtier.rpc.status import MalformedRequestInterceptor
from kvtier.rpc.tickets import TicketSigner
from kvtier.rpc.tls import ClientTls, server_credentials
from kvtier.runtime.config import ControllerConfig
from kvtier.runtime.embedded_redis import EmbeddedRedis, without_credentials
from kvtier.runtime.log import get_logger
from kvtier.runtime.shutdown import Step, run_steps
from kvtier.runtime.telemetry import Telemetry

log = get_logger("kvtier.controller.server")

# Same as every kvtier server: messages up to MAX_MESSAGE_BYTES, client keepalive pings welcome
# (WorkerLink channels ping every 20 s).
SERVICES = tuple(
    module.DESCRIPTOR.services_by_name[name].full_name
    for module, name in (
        (router_pb2, "Router"), (worker_link_pb2, "WorkerLink"), (admin_pb2, "Admin"), (sessions_pb2, "Sessions")
    )
)
RECLAIM_INTERVAL_S = 1.0
SWEEP_MAX_ITEMS = 1000
# Fail fast when Redis is gone: Route must answer (degraded) within its lookup timeout.
REDIS_SOCKET_TIMEOUT_S = 1.0
REDIS_CONNECT_TIMEOUT_S = 0.5
REDIS_RETRY = Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.05), retries=1)


def _version() -> str:
    try:
        return metadata.version("kvtier")
    except metadata.PackageNotFoundError:
        return "unknown"


def _sum_tiers(occupancies: list[TierOccupancy]) -> tuple[TierOccupancy, ...]:
    totals: dict[Tier, list[int]] = {}
    for o in occupancies:
        t = totals.setdefault(o.tier, [0, 0, 0, 0, 0, 0])
        for i, n in enumerate((o.total_pages, o.free_pages, o.cached_pages, o.in_use_pages, o.pinned_pages,
                               o.reclaimable_pages)):
            t[i] += n
    return tuple(TierOccupancy(tier, *totals[tier]) for tier in sorted(totals))


@dataclass(eq=False)
class ControllerServer:
    """A running controller. ``address`` is what workers and clients dial."""

    server: grpc.aio.Server
    config: ControllerConfig
    controller_id: str
    address: str
    redis_url: str  # without credentials: safe to show and record
    access: DirectoryAccess
    registry: Registry
    links: WorkerLinks
    router: Router
    health: health_aio.HealthServicer
    started_at_s: float
    _client: RedisClient
    _lookup_client: RedisClient
    _embedded: EmbeddedRedis | None = None
    health_port: int | None = None  # the bound plaintext health-only port (config.health_port)
    _health_server: grpc.aio.Server | None = None
    orchestrator: Orchestrator | None = None  # sessions, tool-return prediction, park/prefetch
    metrics: ControllerMetrics | None = None  # the Prometheus endpoint (config.metrics_port)
    policy: PolicyInForce | None = None  # the tiering policy version in force
    worker_admin: WorkerAdmin | None = None  # drain, snapshot
    cache_admin: CacheAdmin | None = None  # invalidate (policy epochs), pin, evict
    route_hashing: RouteHashing | None = None  # large Routes decoded and hashed off the event loop
    replicas: ReplicaKeeper | None = None  # pins with --replicas keep that many holders
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopped: bool = False

    @property
    def is_leader(self) -> bool:
        return self.access.is_leader

    @property
    def embedded_redis(self) -> EmbeddedRedis | None:
        """The Valkey this controller started (no Redis URL configured), else None."""
        return self._embedded

    @property
    def directory(self) -> Directory:
        """The current Directory (a Redis restart replaces it)."""
        return self.access.directory

    def send_command(self, worker: WorkerId, command: Command) -> asyncio.Future[CommandAck]:
        """Send a command down the worker's WorkerLink; the future resolves with its ack."""
        return self.links.send_command(worker, command)

    def status(self) -> ControllerStatus:
        live = self.registry.live_workers()
        sessions = self.orchestrator.session_counts() if self.orchestrator is not None else {}
        return ControllerStatus(
            controller_id=self.controller_id,
            is_leader=self.is_leader,
            leader_address=self.access.leader_address,
            version=_version(),
            uptime_s=int(asyncio.get_running_loop().time() - self.started_at_s),
            num_workers=len(self.registry.workers()),
            num_live_workers=len(live),
            num_active_sessions=sessions.get(SessionState.ACTIVE, 0),
            num_paused_sessions=sessions.get(SessionState.PAUSED, 0),
            num_resuming_sessions=sessions.get(SessionState.RESUMING, 0),
            tiers=_sum_tiers([t for e in live for t in e.tiers]),
            policy_version=self.policy.version if self.policy is not None else 0,
            is_directory_reachable=self.access.is_reachable,
        )

    async def stop(self, grace_s: float = 1.0) -> None:
        """Close worker links, hand the lease over, stop serving; stops an embedded Redis too.

        Every step runs even when one before it fails or the stop is cancelled (``run_steps``):
        the gRPC servers always stop and the Redis clients always close."""
        if self._stopped:
            return
        self._stopped = True
        await run_steps(self._stop_steps(grace_s), log=log, what="controller stop")
        log.info("controller stopped", extra={"controller_id": self.controller_id})

    def _stop_steps(self, grace_s: float) -> list[Step]:
        async def end_tasks() -> None:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        steps: list[Step] = [("health", self.health.enter_graceful_shutdown)]
        steps += [(name, part.stop) for name, part in (
            ("orchestrator", self.orchestrator), ("replica keeper", self.replicas),
            ("worker admin", self.worker_admin), ("cache admin", self.cache_admin)) if part is not None]
        steps += [
            ("background tasks", end_tasks),
            ("worker links", lambda: self.links.close_all(
                None, reason=f"controller {self.controller_id} is shutting down; reconnect")),
            ("directory access", self.access.close),
            ("grpc server", lambda: self.server.stop(grace_s)),
        ]
        if (hashing := self.route_hashing) is not None:
            steps.append(("route hashing", hashing.close))
        if (health_server := self._health_server) is not None:
            steps.append(("health server", lambda: health_server.stop(0)))
        steps += [("redis client", self._client.aclose), ("redis lookup client", self._lookup_client.aclose)]
        if self.metrics is not None:
            steps.append(("metrics", self.metrics.close))
        if (embedded := self._embedded) is not None:
            steps.append(("embedded redis", lambda: asyncio.to_thread(embedded.stop)))
        return steps

    # -- background work (leader only) ------------------------------------------------------

    async def _sweep_loop(self) -> None:
        interval_s = max(0.05, self.config.lease_ttl_s / 2)
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._sweep()
            except Exception as exc:  # a bug: keep sweeping rather than lose the loop silently
                log.error("lease sweep failed", exc_info=exc)

    async def _sweep(self) -> None:
        while self.access.can_write:
            try:
                result = await self.access.directory.sweep(SWEEP_MAX_ITEMS)
            except REDIS_ERRORS as exc:
                self.access.report_failure(exc)
                return
            if result.outcome is Outcome.FENCED:
                await self.access.fenced()
                return
            if result.retired or result.num_removed:
                log.info("expired worker leases reclaimed", extra={
                    "workers": ",".join(result.retired), "num_removed": result.num_removed})
            if result.is_done:
                return

    async def _reclaim_loop(self) -> None:
        while True:
            await asyncio.sleep(RECLAIM_INTERVAL_S)
            try:
                await self._reclaim()
            except Exception as exc:  # a bug: keep reclaiming rather than lose the loop silently
                log.error("background reclaim failed", exc_info=exc)

    async def _reclaim(self) -> None:
        if not self.access.can_write:
            return
        try:
            result = await self.access.directory.reclaim_step()
        except REDIS_ERRORS as exc:
            self.access.report_failure(exc)
            return
        if result.outcome is Outcome.FENCED:
            await self.access.fenced()
        elif result.num_deleted:
            log.info("invalidated entries reclaimed", extra={
                "num_deleted": result.num_deleted, "num_pending_namespaces": result.num_pending_namespaces})


async def serve_controller(
    config: ControllerConfig,
    *,
    redis_url: str | None = None,
    controller_id: str | None = None,
    advertise_host: str | None = None,
    orchestrator_params: OrchestratorParams | None = None,
    predictor_params: PredictorParams | None = None,
) -> ControllerServer:
    """Start a controller; ``redis_url`` overrides ``config.redis_url`` (unset: embedded Valkey).
    ``orchestrator_params`` (benchmarks, tests) replaces the orchestrator's defaults, and with them
    the setting they take from ``config`` (``session_hold_max_s``)."""
    # Authentication and TLS settings fail here, before anything starts (errors name the field).
    tokens = TokenTableFile(config.auth_token_file) if config.auth_token_file is not None else None
    check_exposure(config.host, what="controller", is_authenticated=tokens is not None,
                   allow_unauthenticated=config.allow_unauthenticated)
    credentials = server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    identity = None if tokens is None else WorkerIdentity(
        TicketSigner(ttl_s=config.route_ticket_ttl_s),
        # Address proofs dial workers: over TLS with tls_ca_file, this controller's certificate as the client's.
        tls=ClientTls.from_files(config.tls_ca_file, *((config.tls_cert_file, config.tls_key_file)
                                                       if config.tls_ca_file is not None else (None, None))))
    url = redis_url or config.redis_url
    embedded: EmbeddedRedis | None = None
    if url is None:
        # Started from this (the event loop's) thread, which lives as long as the process: the
        # server is tied to its starting thread's life (parent-death signal). ~50 ms, start-up only.
        embedded = EmbeddedRedis(config.state_dir.expanduser() / "valkey")
        url = embedded.start()
    # A redis+cluster:// URL gives Redis Cluster clients (controller/redis_connect.py).
    client = connect(
        url,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        retry=REDIS_RETRY,
    )
    # Route's directory lookups only (see Directory.__init__): no socket timeout, the router's
    # own asyncio.timeout bounds them; connecting still fails fast.
    lookup_client = connect(url, socket_timeout=None, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S)
    metrics = None
    if config.metrics_port is not None:
        metrics = ControllerMetrics(Telemetry("kvtier-controller", port=config.metrics_port, host=config.host))
    server = grpc.aio.server(
        options=SERVER_OPTIONS,
        interceptors=(*([metrics.interceptor()] if metrics else []),
                      *server_interceptors(tokens, server="controller"), CallerLimits(limits_of(config)),
                      MalformedRequestInterceptor()),
    )
    access: DirectoryAccess | None = None
    try:
        bound = bind_port(server, config.host, config.port, what="controller", port_hint="--port 0",
                          credentials=credentials)
        address = join_host_port(advertise_host or advertised_host(config.host), bound)
        controller_id = controller_id or f"controller-{socket.gethostname()}-{os.getpid()}-{bound}"

        health = health_aio.HealthServicer()
        access = DirectoryAccess(
            client, controller_id=controller_id, address=address,
            lease_ttl_ms=max(10, round(config.lease_ttl_s * 1000)), health=health,
            lookup_client=lookup_client,
        )
        if metrics is not None:
            access.directory.on_op = metrics.directory_op
        registry = Registry(config.lease_ttl_s)
        links = WorkerLinks(registry, access, identity)
        access.on_resync = links.mark_for_resync
        access.on_standby = links.close_all
        weights = {Tier.HBM: config.tier_weight_hbm, Tier.DRAM: config.tier_weight_dram,
                   Tier.NVME: config.tier_weight_nvme}
        router = Router(registry, access, RouterParams(tier_weights=weights, rank_by_ttft=config.route_by_ttft))
        controller = ControllerServer(
            server=server, config=config, controller_id=controller_id, address=address,
            redis_url=without_credentials(url),
            access=access, registry=registry, links=links, router=router, health=health,
            started_at_s=asyncio.get_running_loop().time(), _client=client, _lookup_client=lookup_client,
            _embedded=embedded,
        )

        predictor = ToolReturnPredictor(client, predictor_params, on_error=access.report_failure)
        if orchestrator_params is None:
            orchestrator_params = OrchestratorParams(max_hold_ms=config.session_hold_max_s * 1000.0,
                                                     max_sessions_per_tenant=config.max_sessions_per_tenant)
        orchestrator = Orchestrator(
            SessionStore(client), predictor, registry, controller.send_command, orchestrator_params
        )
        controller.orchestrator = orchestrator
        if metrics is not None:
            controller.metrics = metrics
            metrics.bind(registry, orchestrator, access)
        router.on_session_route = orchestrator.route_seen
        # Configuration seeds policy version 1; from then on the stored current version rules.
        policy_store = PolicyStore(client, seed=seed_policy(weights, orchestrator.params.budget_bytes_per_s),
                                   on_error=access.report_failure)
        controller.policy = policy = PolicyInForce(
            policy_store, apply=(router.apply_policy, orchestrator.apply_policy))
        cache_admin = CacheAdmin(router, links, CacheStore(client))
        copier = PrefixCopier(cache_admin, registry)
        controller.replicas = ReplicaKeeper(copier, config.replica_check_interval_s)
        cache_admin.on_replicated_pin = controller.replicas.wake
        controller.cache_admin = cache_admin
        controller.worker_admin = worker_admin = WorkerAdmin(
            registry, links, DrainMigration(copier, config.drain_migrate_bytes))
        links.on_open = cache_admin.on_open  # a (re)connected worker hears the epochs and pins first

        def on_resync(everything: bool) -> None:
            links.mark_for_resync(everything)
            cache_admin.on_resync(everything)

        access.on_resync = on_resync
        controller.route_hashing = hashing = RouteHashing()
        add_router_servicer(RouterServicer(router, hashing, tickets=identity.tickets if identity else None), server)
        sessions_pb2_grpc.add_SessionsServicer_to_server(
            SessionsServicer(orchestrator, access.check_serving), server
        )
        worker_link_pb2_grpc.add_WorkerLinkServicer_to_server(WorkerLinkServicer(links), server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(
            router, controller.status, policy=policy, workers=worker_admin, sessions=orchestrator.store,
            cache=cache_admin,
        ), server)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection(
            (*SERVICES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        await access.start()  # one campaign before serving, so `is_leader` means something at once
        try:  # what a previous controller learnt and planned
            await predictor.load()
            await orchestrator.recover()
        except REDIS_ERRORS as exc:
            access.report_failure(exc)
        with contextlib.suppress(Unavailable):  # Redis down: the refresh loop loads it later
            await policy.refresh()
        with contextlib.suppress(Unavailable):  # Redis down: reloaded when it is back (on_resync)
            await cache_admin.load()
        await server.start()
        for service in ("", *SERVICES):
            await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if config.health_port is not None:
            controller._health_server, controller.health_port = await serve_health_only(
                health, config.host, config.health_port
            )
    except BaseException:
        steps: list[Step] = [("directory access", access.close)] if access is not None else []
        steps += [("grpc server", lambda: server.stop(0)), ("redis client", client.aclose),
                  ("redis lookup client", lookup_client.aclose)]
        if embedded is not None:
            steps.append(("embedded redis", lambda: asyncio.to_thread(embedded.stop)))
        if metrics is not None:
            steps.append(("metrics", metrics.close))
        with contextlib.suppress(BaseException):  # the start's own failure is the one to raise
            await run_steps(steps, log=log, what="controller start clean-up")
        raise
    orchestrator.start()
    assert controller.replicas is not None
    controller.replicas.start()
    controller._tasks = [
        asyncio.create_task(links.run_resync_loop(), name="kvtier-controller-resync"),
        asyncio.create_task(controller._sweep_loop(), name="kvtier-controller-sweep"),
        asyncio.create_task(controller._reclaim_loop(), name="kvtier-controller-reclaim"),
        asyncio.create_task(policy.run(), name="kvtier-controller-policy"),
    ]
    log.info("controller serving", extra={
        "controller_id": controller_id, "address": address, "role": access.role.value,
        "redis": "embedded" if embedded else "external"})
    return controller
