"""Authentication over real gRPC on loopback (DESIGN §8): a controller and a worker with a
token table, a real WorkerLink, a real valkey-server, and a `kvtier up`-style LocalStack.

For every service: no token and an unknown token are UNAUTHENTICATED, a token of the wrong
role is PERMISSION_DENIED, the right one works, and health needs no token; Generate takes
the Route ticket of its worker, never a bearer token. Frontend tokens are bound to their
tenants: naming another is PERMISSION_DENIED (field namespace.tenant), and identical prompts
of two tenants never share pages. Worker identity (ids, addresses, tickets) in detail:
tests/e2e/test_worker_identity.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import sys
from pathlib import Path

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain import errors
from kvtier.domain.errors import ConfigError
from kvtier.domain.records import (
    BootId,
    EndRequest,
    GenerateRequest,
    ModelIdentity,
    PauseRequest,
    Registration,
    ReturningRequest,
    RouteRequest,
    SessionId,
    SessionState,
    TierCapacity,
    TokenPrefix,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc._gen import (
    admin_pb2,
    admin_pb2_grpc,
    router_pb2_grpc,
    sessions_pb2_grpc,
    worker_link_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from kvtier.rpc.auth import hash_token
from kvtier.rpc.convert.link_events import to_proto_worker_event
from kvtier.rpc.convert.router import to_proto_route_request
from kvtier.rpc.convert.sessions import (
    from_proto_end_response,
    from_proto_pause_response,
    from_proto_returning_response,
    to_proto_end_request,
    to_proto_pause_request,
    to_proto_returning_request,
)
from kvtier.rpc.convert.worker import to_proto_generate_request
from kvtier.rpc.status import FIELD_METADATA_KEY
from kvtier.runtime.config import ControllerConfig
from kvtier.worker.link import WorkerLink
from kvtier.worker.servicer import serve_worker

from polling import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")

PAGE_SIZE = 4
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 3 full pages
TOKENS = {
    "admin": "kvt_test-admin",
    "fe-a": "kvt_test-frontend-a",
    "fe-b": "kvt_test-frontend-b",
    "fe-ab": "kvt_test-frontend-ab",
    "worker": "kvt_test-worker",
    "w-auth": "kvt_test-worker-w-auth",
}
ROLES = {"admin": ("admin", ""), "fe-a": ("frontend", "a"), "fe-b": ("frontend", "b"),
         "fe-ab": ("frontend", "a, b"), "worker": ("worker", ""), "w-auth": ("worker", "")}
WORKER_IDS = {"worker": "w-raw-worker", "w-auth": "w-auth"}  # each worker token registers one id


def write_table(path: Path) -> Path:
    lines = ["tokens:"]
    for name, (role, tenants) in ROLES.items():
        lines += [f"  - name: {name}", f"    role: {role}"]
        if tenants:
            lines.append(f"    tenants: [{tenants}]")
        if name in WORKER_IDS:
            lines.append(f"    worker_id: {WORKER_IDS[name]}")
        lines.append(f"    sha256: {hash_token(TOKENS[name])}")
    path.write_text("\n".join(lines) + "\n")
    return path


def bearer(name: str | None) -> tuple[tuple[str, str], ...]:
    if name is None:
        return ()
    token = TOKENS.get(name, name)
    return (("authorization", f"Bearer {token}"),)



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return write_table(tmp_path_factory.mktemp("auth") / "tokens.yaml")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(redis_url, checkpoint, table, tmp_path_factory):
    """An authenticated controller and worker, the worker linked with its worker token."""
    from kvtier.rpc.auth import TokenTableFile

    controller = await serve_controller(
        ControllerConfig(port=0, state_dir=tmp_path_factory.mktemp("ctl"), auth_token_file=table,
                         lease_ttl_s=2.0, heartbeat_interval_s=0.5),
        redis_url=redis_url,
    )
    worker = await serve_worker(Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=256),
                                worker_id="w-auth", tokens=TokenTableFile(table), identity_token=TOKENS["w-auth"])
    # Serves w-raw-worker's address proofs: the address call_worker_link registers.
    prover = await serve_worker(Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=16),
                                worker_id="w-raw-worker", tokens=TokenTableFile(table),
                                identity_token=TOKENS["worker"])
    link = WorkerLink(worker.loop, controller_address=controller.address, worker_id=worker.worker_id,
                      address=worker.address, boot_id=worker.boot_id, heartbeat_interval_s=0.2,
                      batch_interval_s=0.02, max_backoff_s=0.2, token=TOKENS["w-auth"], tickets=worker.tickets)
    link.start()
    try:
        await wait_for(lambda: controller.registry.get(worker.worker_id) is not None, what="worker registration")
        await wait_for(lambda: worker.tickets.has_key, what="the worker's ticket key")
        channels = {"controller": grpc.aio.insecure_channel(controller.address),
                    "worker": grpc.aio.insecure_channel(worker.address), "prover": prover.address}
        yield controller, worker, channels
        for name in ("controller", "worker"):
            await channels[name].close()
    finally:
        await link.stop()
        await prover.stop(0)
        await worker.stop(0)
        await controller.stop(0)


def namespace(worker, tenant=""):
    import dataclasses

    return dataclasses.replace(worker.engine.namespace, tenant=tenant)


async def code_of(awaitable) -> grpc.StatusCode:
    try:
        await awaitable
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


# -- one call per service, with the token of a caller -------------------------------------------


async def call_route(cluster, who):
    _, worker, ch = cluster
    request = RouteRequest(namespace(worker, "a"), TokenPrefix(tuple(PROMPT)))
    await router_pb2_grpc.RouterStub(ch["controller"]).Route(
        to_proto_route_request(request), metadata=bearer(who), timeout=10)


async def call_sessions_end(cluster, who):
    _, worker, ch = cluster
    await call_route_with_session(cluster, "admin", "s-auth")  # the session exists, so End succeeds
    await sessions_pb2_grpc.SessionsStub(ch["controller"]).End(
        to_proto_end_request(EndRequest(SessionId("s-auth"))), metadata=bearer(who), timeout=10)


async def call_route_with_session(cluster, who, session):
    _, worker, ch = cluster
    request = RouteRequest(namespace(worker, "a"), TokenPrefix(tuple(PROMPT)), session_id=SessionId(session))
    await router_pb2_grpc.RouterStub(ch["controller"]).Route(
        to_proto_route_request(request), metadata=bearer(who), timeout=10)


async def call_admin_status(cluster, who):
    _, _, ch = cluster
    await admin_pb2_grpc.AdminStub(ch["controller"]).Status(admin_pb2.StatusRequest(), metadata=bearer(who),
                                                            timeout=10)


async def call_generate(cluster, metadata, tenant="a"):
    _, worker, ch = cluster
    request = GenerateRequest(namespace(worker, tenant), tuple(PROMPT), SamplingParams(max_tokens=2))
    call = worker_pb2_grpc.WorkerStub(ch["worker"]).Generate(
        to_proto_generate_request(request), metadata=metadata, timeout=30)
    events = [event async for event in call]
    assert events and events[-1].HasField("final")


async def route_ticket(cluster, who, tenant="a"):
    """The Route ticket ``who`` gets for the cluster's worker."""
    controller, worker, _ = cluster
    async with AsyncClient(controller.address, token=TOKENS[who]) as client:
        (ranked,) = (await client.route(namespace(worker, tenant), PROMPT)).workers
    assert ranked.worker_id == worker.worker_id and ranked.ticket
    return ranked.ticket


async def call_worker_stats(cluster, who):
    _, _, ch = cluster
    await worker_pb2_grpc.WorkerStub(ch["worker"]).Stats(worker_pb2.StatsRequest(), metadata=bearer(who),
                                                         timeout=10)


async def call_worker_link(cluster, who):
    """Register a second (fake) worker over a raw stream; it must show up in the registry."""
    controller, worker, ch = cluster
    call = worker_link_pb2_grpc.WorkerLinkStub(ch["controller"]).Connect(metadata=bearer(who))
    worker_id = WorkerId(f"w-raw-{who}")
    registration = Registration(
        worker_id=worker_id, address=ch["prover"], boot_id=BootId("raw"),
        model=ModelIdentity.of(worker.engine.namespace), page_size=PAGE_SIZE,
        capacities=(TierCapacity(Tier.HBM, 64, 64 << 15),),
    )
    try:
        with contextlib.suppress(asyncio.InvalidStateError):  # a refused call may end before the write
            await call.write(to_proto_worker_event(registration))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while controller.registry.get(worker_id) is None:
            if call.done():
                await call.read()  # raises the refusal
                raise AssertionError("the stream ended without an error or a registration")
            assert loop.time() < deadline, "neither registered nor refused"
            await asyncio.sleep(0.02)
    finally:
        call.cancel()


SERVICES = {
    # name: (call, a token that may call it, a token of a role that may not)
    "Router.Route": (call_route, "fe-a", "worker"),
    "Sessions.End": (call_sessions_end, "fe-a", "worker"),
    "Admin.Status": (call_admin_status, "admin", "fe-a"),
    "Worker.Stats": (call_worker_stats, "admin", "fe-a"),
    "WorkerLink.Connect": (call_worker_link, "worker", "admin"),
}


@pytest.mark.parametrize("service", SERVICES)
async def test_every_service_refuses_missing_unknown_and_wrong_role_tokens(cluster, service):
    call, allowed, wrong_role = SERVICES[service]
    assert await code_of(call(cluster, None)) is grpc.StatusCode.UNAUTHENTICATED
    assert await code_of(call(cluster, "kvt_not-a-token")) is grpc.StatusCode.UNAUTHENTICATED
    assert await code_of(call(cluster, hash_token(TOKENS[allowed]))) is grpc.StatusCode.UNAUTHENTICATED
    assert await code_of(call(cluster, wrong_role)) is grpc.StatusCode.PERMISSION_DENIED
    assert await code_of(call(cluster, allowed)) is grpc.StatusCode.OK


async def test_generate_takes_its_workers_route_ticket_and_no_bearer_token(cluster):
    for who in (None, "fe-a", "admin", "kvt_not-a-token"):
        assert await code_of(call_generate(cluster, bearer(who))) is grpc.StatusCode.UNAUTHENTICATED
    ticket = await route_ticket(cluster, "fe-a")
    assert await code_of(call_generate(cluster, (("authorization", f"Ticket {ticket}x"),))) \
        is grpc.StatusCode.UNAUTHENTICATED
    assert await code_of(call_generate(cluster, (("authorization", f"Ticket {ticket}"),))) is grpc.StatusCode.OK


async def test_refusals_explain_without_echoing_the_token(cluster):
    _, _, ch = cluster
    stub = admin_pb2_grpc.AdminStub(ch["controller"])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Status(admin_pb2.StatusRequest(), metadata=bearer(TOKENS["fe-a"]), timeout=10)
    assert "Admin.Status needs role admin" in info.value.details()
    assert TOKENS["fe-a"] not in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Status(admin_pb2.StatusRequest(), metadata=bearer("kvt_leaked?"), timeout=10)
    assert "kvt_leaked" not in info.value.details() and "not valid" in info.value.details()


async def test_health_and_reflection_answer_without_a_token(cluster):
    _, _, ch = cluster
    for channel in (ch["controller"], ch["worker"]):
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name async for r in stream for s in r.list_services_response.service}
        assert "grpc.health.v1.Health" in names


# -- tenant binding ---------------------------------------------------------------------------


@pytest.mark.parametrize("rpc", ["route", "generate"])
async def test_frontend_naming_another_tenant_is_permission_denied(cluster, rpc):
    controller, worker, _ = cluster
    ticket = await route_ticket(cluster, "fe-a")  # acts for tenant a only
    async with AsyncClient(controller.address, token=TOKENS["fe-a"]) as client:
        with pytest.raises(errors.PermissionDenied) as info:
            if rpc == "route":
                await client.route(namespace(worker, "b"), PROMPT)
            else:
                await client.complete(namespace(worker, "b"), PROMPT, SamplingParams(max_tokens=1),
                                      worker=worker.address, ticket=ticket)
    assert info.value.field == "namespace.tenant" and "'b'" in str(info.value)


async def test_a_multi_tenant_frontend_must_name_its_tenant(cluster):
    controller, worker, ch = cluster
    request = RouteRequest(namespace(worker), TokenPrefix(tuple(PROMPT)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await router_pb2_grpc.RouterStub(ch["controller"]).Route(
            to_proto_route_request(request), metadata=bearer("fe-ab"), timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata())[FIELD_METADATA_KEY] == "namespace.tenant"


async def test_identical_prompts_of_two_tenants_never_share_pages(cluster):
    controller, worker, _ = cluster
    prompt = [101 + i for i in range(4 * PAGE_SIZE + 1)]  # 4 full pages, unused by other tests
    sampling = SamplingParams(max_tokens=1)
    fe_a = AsyncClient(controller.address, token=TOKENS["fe-a"])
    fe_b = AsyncClient(controller.address, token=TOKENS["fe-b"])
    admin = AsyncClient(controller.address, token=TOKENS["admin"])
    async with fe_a, fe_b, admin:
        # fe-a names no tenant: it acts for its only tenant, a.
        _, first = await fe_a.complete(namespace(worker), prompt, sampling)
        assert first.usage.cached_tokens == 0
        _, again = await fe_a.complete(namespace(worker, "a"), prompt, sampling)
        assert again.usage.cached_tokens == 4 * PAGE_SIZE  # same tenant: the pages are shared
        # Tenant b, identical prompt: nothing cached for it, at the worker or at the router.
        await wait_for_route_match(fe_a, namespace(worker, "a"), prompt, 4 * PAGE_SIZE)
        decision = await fe_b.route(namespace(worker), prompt)
        assert all(w.matched_tokens.total_tokens == 0 for w in decision.workers)
        _, other = await fe_b.complete(namespace(worker), prompt, sampling)
        assert other.usage.cached_tokens == 0
        # An admin may act for either tenant, and sees each one's own pages.
        _, as_admin = await admin.complete(namespace(worker, "a"), prompt, sampling)
        assert as_admin.usage.cached_tokens == 4 * PAGE_SIZE


async def wait_for_route_match(client, ns, prompt, num_tokens):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        decision = await client.route(ns, prompt)
        if decision.workers and decision.workers[0].matched_tokens.total_tokens >= num_tokens:
            return
        assert loop.time() < deadline, "the directory never learnt tenant a's pages"
        await asyncio.sleep(0.05)


# -- refusing to start unauthenticated off loopback ------------------------------------------------


async def test_non_loopback_without_auth_refuses_to_start_and_the_override_starts(redis_url, tmp_path, checkpoint):
    config = ControllerConfig(host="0.0.0.0", port=0, state_dir=tmp_path)
    with pytest.raises(ConfigError) as info:
        await serve_controller(config, redis_url=redis_url)
    assert info.value.field == "auth_token_file" and "--allow-unauthenticated" in info.value.message
    engine = Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=16)
    with pytest.raises(ConfigError) as info:
        await serve_worker(engine, host="0.0.0.0", worker_id="w-open")
    assert info.value.field == "auth_tokens_file"

    import dataclasses

    controller = await serve_controller(dataclasses.replace(config, allow_unauthenticated=True),
                                        redis_url=redis_url)
    try:
        async with AsyncClient(f"127.0.0.1:{controller.address.rsplit(':', 1)[1]}") as client:
            assert (await client.status()).controller_id == controller.controller_id  # serving (a standby here)
    finally:
        await controller.stop(0)
    worker = await serve_worker(engine, host="0.0.0.0", worker_id="w-open", allow_unauthenticated=True)
    try:
        async with AsyncClient() as client:
            stats = await client.worker_stats(f"127.0.0.1:{worker.port}")
        assert stats.worker_id == "w-open"
    finally:
        await worker.stop(0)


# -- the local stack (`kvtier up`) -----------------------------------------------------------------


async def test_local_stack_makes_admin_and_frontend_tokens_that_kvtier_commands_and_frontends_use(local_ray, tmp_path):
    from kvtier.local.stack import StackOptions, start_local_stack

    state = tmp_path / "state"
    stack = await start_local_stack(StackOptions(state_dir=state, controller_port=0, auth=True, max_restarts=0))
    try:
        token_file = state / "auth" / "admin.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE((state / "auth").stat().st_mode) == 0o700
        assert token_file.read_text().strip() == stack.admin_token
        table = (state / "auth" / "tokens.yaml").read_text()
        assert stack.admin_token not in table and hash_token(stack.admin_token) in table
        # One token per worker, bound to its id; the worker registered with it (Route ranks it).
        worker_file = state / "auth" / "worker-0.token"
        assert stat.S_IMODE(worker_file.stat().st_mode) == 0o600
        assert hash_token(worker_file.read_text().strip()) in table and "worker_id: worker-0" in table

        # `kvtier status` with no flags: address and token from the state directory.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvtier.cli.main", "status", "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "KVTIER_STATE_DIR": str(state), "KVTIER_CONTROLLER": "", "KVTIER_TOKEN": ""},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()
        assert json.loads(out)["num_live_workers"] == 1

        async with AsyncClient(stack.controller_address) as anonymous:
            with pytest.raises(errors.Unauthenticated):
                await anonymous.status()
        # The admin token acts for any tenant, end to end (Route, then Generate on the worker).
        async with AsyncClient(stack.controller_address, token=stack.admin_token) as admin:
            ns = namespace_of(stack, "tenant-a")
            _, final = await admin.complete(ns, PROMPT, SamplingParams(max_tokens=2))
            assert final.usage.prompt_tokens == len(PROMPT)
        async with AsyncClient(stack.controller_address) as anonymous:  # workers check tokens too
            with pytest.raises(errors.Unauthenticated):
                await anonymous.complete(ns, PROMPT, worker=stack.workers[0].address)

        # The frontend token: tenant "default", enough for ListModels, Route and Generate, not Admin.
        frontend_file = state / "auth" / "frontend.token"
        assert stat.S_IMODE(frontend_file.stat().st_mode) == 0o600
        assert frontend_file.read_text().strip() == stack.frontend_token
        assert hash_token(stack.frontend_token) in (state / "auth" / "tokens.yaml").read_text()
        async with AsyncClient(stack.controller_address, token=stack.frontend_token) as frontend:
            (model,) = await frontend.list_models()
            assert model.namespace.tenant == "default"
            _, final = await frontend.complete(model.namespace, PROMPT, SamplingParams(max_tokens=2))
            assert final.usage.prompt_tokens == len(PROMPT)
            with pytest.raises(errors.PermissionDenied):
                await frontend.status()
        # A worker of the stack takes Route tickets only: the frontend's own token is refused there.
        request = GenerateRequest(model.namespace, tuple(PROMPT), SamplingParams(max_tokens=1))
        async with grpc.aio.insecure_channel(stack.workers[0].address) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Generate(
                to_proto_generate_request(request), metadata=bearer(stack.frontend_token), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [event async for event in call]
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED and "never a bearer token" in info.value.details()
    finally:
        await stack.stop()


def namespace_of(stack, tenant):
    import dataclasses

    return dataclasses.replace(stack.namespace, tenant=tenant)


async def test_a_frontend_cannot_touch_another_tenants_session(cluster):
    """Sessions are keyed by (tenant, id): Pause/Returning/End of tenant a's session id with
    tenant b's token act on b's own session of that id, answering exactly as for an id nobody
    uses (no oracle for other tenants' session ids); b's Route naming the id leaves a's record as
    it is; a's own token still pauses and ends a's session."""
    _, worker, ch = cluster
    await call_route_with_session(cluster, "fe-a", "s-owned")
    stub = sessions_pb2_grpc.SessionsStub(ch["controller"])
    answers = {}
    for session in ("s-owned", "s-nobodys"):
        answers[session] = [
            from_proto_pause_response(await stub.Pause(to_proto_pause_request(
                PauseRequest(SessionId(session), tool_name="t")), metadata=bearer("fe-b"), timeout=10)).state,
            from_proto_returning_response(await stub.Returning(to_proto_returning_request(
                ReturningRequest(SessionId(session))), metadata=bearer("fe-b"), timeout=10)).state,
            from_proto_end_response(await stub.End(to_proto_end_request(
                EndRequest(SessionId(session))), metadata=bearer("fe-b"), timeout=10)).state,
        ]
    assert answers["s-owned"] == answers["s-nobodys"] == [
        SessionState.PAUSED, SessionState.RESUMING, SessionState.ENDED]
    hijack = RouteRequest(namespace(worker, "b"), TokenPrefix(tuple(PROMPT)), session_id=SessionId("s-owned"))
    await router_pb2_grpc.RouterStub(ch["controller"]).Route(
        to_proto_route_request(hijack), metadata=bearer("fe-b"), timeout=10)
    paused = await stub.Pause(to_proto_pause_request(PauseRequest(SessionId("s-owned"), tool_name="t")),
                              metadata=bearer("fe-a"), timeout=10)
    assert from_proto_pause_response(paused).state is SessionState.PAUSED
    ended = await stub.End(to_proto_end_request(EndRequest(SessionId("s-owned"))),
                           metadata=bearer("fe-a"), timeout=10)
    assert from_proto_end_response(ended).state is SessionState.ENDED
