"""The worker's gRPC server: ``kvtier.v1.Worker`` plus ``grpc.health.v1`` and reflection.

The servicer is a thin shell (STYLE 7): convert the message, check that the request is
for the model this worker serves, hand it to the ``EngineLoop``, convert the events
back. Status codes come from ``kvtier.rpc.status`` only.

Cancellation: when the caller closes the stream or its deadline passes, grpc cancels
the handler; the ``EngineLoop.submit`` iterator is closed on the way out and aborts the
request in the engine, which releases its pages exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeAlias

import grpc
import grpc.aio
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtier.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.records import BootId, WorkerId, WorkerStats
from kvtier.engine.engine import Engine
from kvtier.rpc._gen import worker_pb2, worker_pb2_grpc
from kvtier.rpc.auth import TokenTable, TokenTableFile
from kvtier.rpc.auth_interceptor import principal_tenant, resolve_tenant, server_interceptors
from kvtier.rpc.convert.worker import (
    from_proto_generate_request,
    to_proto_generate_event,
    to_proto_integrity_result,
    to_proto_worker_stats,
)
from kvtier.rpc.identity import MAX_NONCE_BYTES, MIN_NONCE_BYTES, address_proof, token_key
from kvtier.rpc.server_options import (
    SERVER_OPTIONS,
    advertised_host,
    bind_port,
    check_exposure,
    join_host_port,
)
from kvtier.rpc.status import MalformedRequestInterceptor, rpc_errors
from kvtier.rpc.tickets import TicketVerifier
from kvtier.runtime import tracing
from kvtier.runtime.log import get_logger
from kvtier.runtime.shutdown import run_steps
from kvtier.runtime.telemetry import Telemetry
from kvtier.worker.engine_loop import EngineLoop
from kvtier.worker.metrics import WorkerMetrics
from kvtier.worker.peer_fetch import (
    LocalTransport,
    PeerExporter,
    PeerFetcher,
    PeerOptions,
    fetch_for_generate,
)

log = get_logger("kvtier.worker.servicer")

HealthServicer: TypeAlias = grpc_health.aio.HealthServicer
WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name

# Every kvtier server: messages up to MAX_MESSAGE_BYTES, and client keepalive pings (the
# channels of kvtier.client and the WorkerLink ping every 20 s) are welcome.

# The namespace fields that must equal the worker's own: they change the KV bytes, and a
# digest derived from other values would file this worker's pages under a namespace that
# the controller (deriving from the same request fields) never looks up.
_MODEL_FIELDS = ("weights_digest", "rope_config", "kv_dtype", "page_size")


def check_serves(namespace: NamespaceIdentity, served: NamespaceIdentity) -> None:
    """Raise unless ``namespace`` is for the model ``served`` (tenant and tokenizer are free)."""
    if namespace.model_id != served.model_id:
        raise NotFound(
            f"namespace.model_id {namespace.model_id!r} is not served by this worker; "
            f"it serves {served.model_id!r}",
            field="namespace.model_id",
        )
    if namespace.adapter:
        raise NotFound(
            f"namespace.adapter {namespace.adapter!r} is not loaded on this worker; it serves the base model only",
            field="namespace.adapter",
        )
    for name in _MODEL_FIELDS:
        got, want = getattr(namespace, name), getattr(served, name)
        if got != want:  # NOT_FOUND, as Route answers a namespace no worker serves
            raise NotFound(
                f"namespace.{name} is {got!r} but model {served.model_id!r} on this worker has {want!r}; "
                "Router.ListModels lists the namespace fields to send",
                field=f"namespace.{name}",
            )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, loop: EngineLoop, *, worker_id: WorkerId, boot_id: BootId,
                 identity_token: str | None = None, peers: PeerFetcher | None = None) -> None:
        self._loop = loop
        self._worker_id = worker_id
        self._boot_id = boot_id
        self.peers = peers or PeerFetcher(loop, LocalTransport({}))
        # SHA-256 of the worker's own bearer token: the key of its address proofs.
        self._proof_key = token_key(identity_token) if identity_token else None

    @rpc_errors
    async def ProveAddress(
        self, request: worker_pb2.ProveAddressRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ProveAddressResponse:
        """Answer the controller's challenge for this worker's own id only (decision 0007)."""
        if self._proof_key is None:
            raise FailedPrecondition("this worker has no credential (auth_token_file) to prove its address with")
        if request.worker_id != self._worker_id:
            raise NotFound(f"worker_id {request.worker_id!r} is not served at this address", field="worker_id")
        if not MIN_NONCE_BYTES <= len(request.nonce) <= MAX_NONCE_BYTES:
            raise InvalidArgument(f"nonce must be {MIN_NONCE_BYTES} to {MAX_NONCE_BYTES} bytes, "
                                  f"got {len(request.nonce)}", field="nonce")
        proof = address_proof(self._proof_key, request.worker_id, request.address, request.nonce)
        return worker_pb2.ProveAddressResponse(proof=proof)

    @rpc_errors
    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateEvent]:
        generate = from_proto_generate_request(request)
        namespace = resolve_tenant(generate.namespace, principal_tenant(context))
        check_serves(namespace, self._loop.engine.namespace)
        # The digest is derived with the current policy epoch: invalidated keys are unreachable.
        generate = dataclasses.replace(generate, namespace=self._loop.epochs.apply(namespace))
        # A fetch plan's pages arrive while the request waits outside the engine; never raises for the peer.
        fetch = fetch_for_generate(self.peers, generate, context.time_remaining())
        parent = tracing.remote_parent(context.invocation_metadata())  # None unless tracing is on
        async with contextlib.aclosing(self._loop.submit(generate, trace_parent=parent, fetch=fetch)) as events:
            async for event in events:
                yield to_proto_generate_event(event)

    @rpc_errors
    async def CheckIntegrity(
        self, request: worker_pb2.CheckIntegrityRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CheckIntegrityResponse:
        return to_proto_integrity_result(await self._loop.check_integrity())

    @rpc_errors
    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.StatsResponse:
        return to_proto_worker_stats(await self.stats())

    async def stats(self) -> WorkerStats:
        load = await self._loop.stats()
        return WorkerStats(
            worker_id=self._worker_id,
            boot_id=self._boot_id,
            tiers=load.tiers,
            queue_depth=load.queue_depth,
            num_running_seqs=load.num_running_seqs,
        )


@dataclass(slots=True, eq=False)
class WorkerServer:
    """A running worker server. ``address`` is what the worker registers with the controller."""

    server: grpc.aio.Server
    loop: EngineLoop
    servicer: WorkerServicer
    health: HealthServicer
    worker_id: WorkerId
    boot_id: BootId
    host: str
    port: int
    advertise_host: str
    tickets: TicketVerifier | None = None  # with authentication: checks Route tickets on Generate
    exporter: PeerExporter | None = None  # page groups for peers (``kvtier.worker.peer_fetch``)

    @property
    def address(self) -> str:
        return join_host_port(self.advertise_host, self.port)

    @property
    def engine(self) -> Engine:
        return self.loop.engine

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop admitting, let streams end for ``grace_s``, then stop the engine thread; each
        step runs even when one before it fails or the stop is cancelled (``run_steps``)."""
        await run_steps((("health", self.health.enter_graceful_shutdown),
                         ("grpc server", lambda: self.server.stop(grace_s)),
                         ("engine loop", self.loop.close)), log=log, what="worker stop")


def default_worker_id() -> WorkerId:
    return WorkerId(f"worker-{socket.gethostname()}-{os.getpid()}")


async def serve_worker(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    worker_id: str | None = None,
    boot_id: str | None = None,
    advertise_host: str | None = None,
    telemetry: Telemetry | None = None,
    tokens: TokenTable | TokenTableFile | None = None,
    identity_token: str | None = None,
    credentials: grpc.ServerCredentials | None = None,
    allow_unauthenticated: bool = False,
    hold_fraction: float | None = None,
    wait_scale: float = 1.0,
    peers: PeerOptions | None = None,
) -> WorkerServer:
    """Start the engine thread and the gRPC server on ``host:port`` (0: a free port).

    With ``telemetry`` the worker's metrics (``kvtier.worker.metrics``) are exported there.
    With ``tokens`` every call but health, reflection and ProveAddress needs a bearer token of
    that table, and Generate a Route ticket, checked with the key the controller link installs
    in ``WorkerServer.tickets`` (``kvtier.rpc.auth_interceptor``). ``identity_token``: the
    worker's own token, which ProveAddress answers with. With ``credentials`` the server speaks
    TLS only.
    Without ``tokens`` it refuses a non-loopback ``host`` unless ``allow_unauthenticated``.
    ``hold_fraction``: the share of HBM session holds may keep (``EngineLoop``; None: its default);
    ``wait_scale``: multiplies the engine loop's fixed waits (``WorkerConfig.wait_scale``).
    ``peers``: how Generate's peer fetches travel and what they carry (``PeerOptions``); pages
    are exported to the workers of ``tokens``.
    """
    check_exposure(host, what="worker", is_authenticated=tokens is not None,
                   allow_unauthenticated=allow_unauthenticated)
    worker_id = WorkerId(worker_id) if worker_id else default_worker_id()
    boot = BootId(boot_id or uuid.uuid4().hex)
    health = HealthServicer()
    aloop = asyncio.get_running_loop()
    background: set[asyncio.Task[None]] = set()

    def on_engine_failure(exc: BaseException) -> None:  # engine thread
        def mark_not_serving() -> None:
            for service in ("", WORKER_SERVICE):
                task = aloop.create_task(health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING))
                background.add(task)
                task.add_done_callback(background.discard)

        with contextlib.suppress(RuntimeError):
            aloop.call_soon_threadsafe(mark_not_serving)

    loop = EngineLoop(engine, on_failure=on_engine_failure, hold_fraction=hold_fraction,
                      wait_scale=wait_scale)
    loop.span_attributes["kvtier.worker_id"] = worker_id
    if telemetry is not None:
        loop.metrics = WorkerMetrics(telemetry, loop, worker_id)
    peers = peers or PeerOptions()
    fetcher = PeerFetcher(loop, peers.transport or LocalTransport({}), credential=peers.credential,
                          worker_id=worker_id)
    servicer = WorkerServicer(loop, worker_id=worker_id, boot_id=boot, identity_token=identity_token, peers=fetcher)
    tickets = TicketVerifier(worker_id) if tokens is not None else None
    server = grpc.aio.server(
        options=SERVER_OPTIONS,
        interceptors=(*server_interceptors(tokens, server="worker", tickets=tickets), MalformedRequestInterceptor()),
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (WORKER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    bound = bind_port(server, host, port, what="worker", port_hint="port 0", credentials=credentials)
    loop.start()
    await server.start()
    for service in ("", WORKER_SERVICE):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    result = WorkerServer(
        server=server,
        loop=loop,
        servicer=servicer,
        health=health,
        worker_id=worker_id,
        boot_id=boot,
        host=host,
        port=bound,
        advertise_host=advertise_host or advertised_host(host),
        tickets=tickets,
        exporter=PeerExporter(loop, tokens, link_bytes_per_s=peers.link_bytes_per_s),
    )
    log.info(
        "worker serving",
        extra={
            "worker_id": worker_id,
            "address": result.address,
            "model_id": engine.namespace.model_id,
            "num_pages": engine.pool.num_pages,
            "page_size": engine.pool.page_size,
        },
    )
    return result
