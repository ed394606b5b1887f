"""kvtier.client against real gRPC servers on loopback: a real worker, and in-test Router,
Sessions and misbehaving-worker servicers (test peers) that script what the controller
or a worker answers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from kvtier.client import AsyncClient, Client
from kvtier.domain import errors
from kvtier.domain.records import (
    GenerateFinal,
    RankedWorker,
    RouteDecision,
    SessionInfo,
    SessionState,
    TokenChunk,
    TokensByTier,
    WorkerId,
)
from kvtier.engine import Engine, FinishReason, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc._gen import router_pb2_grpc, sessions_pb2_grpc, worker_pb2_grpc
from kvtier.rpc.convert.router import from_proto_route_request, to_proto_route_decision
from kvtier.rpc.convert.sessions import (
    from_proto_end_request,
    from_proto_pause_request,
    from_proto_returning_request,
    to_proto_end_response,
    to_proto_pause_response,
    to_proto_returning_response,
)
from kvtier.rpc.convert.worker import to_proto_generate_event
from kvtier.rpc.status import abort_with, rpc_errors
from kvtier.worker.servicer import serve_worker

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(checkpoint):
    server = await serve_worker(
        Engine.from_pretrained(checkpoint, page_size=4, num_pages=256), worker_id="w-live"
    )
    yield server
    await server.stop(0)


@pytest.fixture(scope="module")
def namespace(worker):
    return worker.engine.namespace


@pytest.fixture(scope="module")
def expected_tokens(checkpoint):
    """The same prompt through an offline engine: what every worker must stream."""
    engine = Engine.from_pretrained(checkpoint, page_size=4, num_pages=64)
    return engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids


def dead_address() -> str:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def ranked(*addresses: str) -> RouteDecision:
    return RouteDecision(
        workers=tuple(
            RankedWorker(
                worker_id=WorkerId(f"w{i}"), address=a, score=1.0 - i / 10, matched_tokens=TokensByTier()
            )
            for i, a in enumerate(addresses)
        )
    )


class ScriptedRouter(router_pb2_grpc.RouterServicer):
    """Answers Route with ``decision``; first fails ``num_failures`` calls with ``fail_with``."""

    def __init__(self) -> None:
        self.decision = RouteDecision(workers=())
        self.requests = []
        self.metadata = []
        self.num_failures = 0
        self.fail_with: errors.KvtierError = errors.Unavailable("directory restarting")
        self.delay_s = 0.0

    @rpc_errors
    async def Route(self, request, context):
        self.requests.append(from_proto_route_request(request))
        self.metadata.append(dict(context.invocation_metadata()))
        await asyncio.sleep(self.delay_s)
        if self.num_failures > 0:
            self.num_failures -= 1
            await abort_with(context, self.fail_with)
        return to_proto_route_decision(self.decision)


class ScriptedSessions(sessions_pb2_grpc.SessionsServicer):
    def __init__(self) -> None:
        self.requests = []
        self.num_failures = 0

    async def _answer(self, context, request, state, respond):
        self.requests.append(request)
        if self.num_failures > 0:
            self.num_failures -= 1
            await abort_with(context, errors.Unavailable("controller failing over"))
        return respond(SessionInfo(session_id=request.session_id, state=state))

    @rpc_errors
    async def Pause(self, request, context):
        parsed = from_proto_pause_request(request)
        return await self._answer(context, parsed, SessionState.PAUSED, to_proto_pause_response)

    @rpc_errors
    async def Returning(self, request, context):
        parsed = from_proto_returning_request(request)
        return await self._answer(context, parsed, SessionState.RESUMING, to_proto_returning_response)

    @rpc_errors
    async def End(self, request, context):
        parsed = from_proto_end_request(request)
        return await self._answer(context, parsed, SessionState.ENDED, to_proto_end_response)


class DyingWorker(worker_pb2_grpc.WorkerServicer):
    """Streams one token, then fails UNAVAILABLE (a worker lost mid-stream)."""

    def __init__(self) -> None:
        self.num_calls = 0

    @rpc_errors
    async def Generate(self, request, context):
        self.num_calls += 1
        yield to_proto_generate_event(TokenChunk(token_ids=(1,), index=0))
        await abort_with(context, errors.Unavailable("worker lost its GPU"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def peers():
    server = grpc.aio.server()
    router, sessions, dying = ScriptedRouter(), ScriptedSessions(), DyingWorker()
    router_pb2_grpc.add_RouterServicer_to_server(router, server)
    sessions_pb2_grpc.add_SessionsServicer_to_server(sessions, server)
    worker_pb2_grpc.add_WorkerServicer_to_server(dying, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield {"address": f"127.0.0.1:{port}", "router": router, "sessions": sessions, "dying": dying}
    await server.stop(0)


@pytest.fixture
def router(peers):
    router = peers["router"]
    router.requests.clear()
    router.metadata.clear()
    router.num_failures, router.delay_s = 0, 0.0
    return router


@pytest_asyncio.fixture(loop_scope="module")
async def client(peers):
    async with AsyncClient(controller=peers["address"], timeout_s=10, retry_backoff_s=0.01) as client:
        yield client


def slow_down(monkeypatch, engine, step_s):
    step = engine.step

    def slow_step(**kwargs):
        time.sleep(step_s)
        return step(**kwargs)

    monkeypatch.setattr(engine, "step", slow_step)


# --------------------------------------------------------------------------- generate


async def test_generate_straight_to_a_worker(client, worker, namespace, expected_tokens):
    events = [
        e
        async for e in client.generate(
            namespace, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), worker=worker.address
        )
    ]
    assert all(isinstance(e, TokenChunk) for e in events[:-1]) and isinstance(events[-1], GenerateFinal)
    assert [t for e in events[:-1] for t in e.token_ids] == expected_tokens
    tokens, final = await client.complete(
        namespace, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), worker=worker.address
    )
    assert tokens == expected_tokens
    assert final.finish_reason is FinishReason.LENGTH and final.usage.cached_tokens == 8


async def test_routed_generate_falls_back_past_a_dead_worker(
    client, router, worker, namespace, expected_tokens, caplog
):
    caplog.set_level(logging.INFO, logger="kvtier.client")
    dead = dead_address()
    router.decision = ranked(dead, worker.address)
    tokens, final = await client.complete(
        namespace, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), session_id="s-1"
    )
    assert tokens == expected_tokens
    (route,) = router.requests
    assert route.prefix.token_ids == tuple(PROMPT) and route.session_id == "s-1"
    assert route.namespace == namespace
    skipped = [r for r in caplog.records if "before the first token" in r.getMessage()]
    assert [r.worker for r in skipped] == [dead]


async def test_no_retry_once_a_token_arrived(client, router, peers, worker, namespace):
    router.decision = ranked(peers["address"], worker.address)  # the dying worker ranks first
    finished_before = worker.loop.runs.num_finished
    received = []
    with pytest.raises(errors.Unavailable, match="lost its GPU"):
        async for event in client.generate(namespace, PROMPT):
            received.append(event)
    assert received == [TokenChunk(token_ids=(1,), index=0)]
    assert peers["dying"].num_calls >= 1
    assert worker.loop.runs.num_finished == finished_before, "the next worker must not be tried"


async def test_every_worker_dead_or_none_routed_is_unavailable(client, router, namespace):
    router.decision = ranked(dead_address(), dead_address())
    with pytest.raises(errors.Unavailable):
        await client.complete(namespace, PROMPT)
    router.decision = RouteDecision(workers=())
    with pytest.raises(errors.Unavailable, match=namespace.model_id):
        await client.complete(namespace, PROMPT)


async def test_worker_errors_arrive_as_domain_errors(client, worker, namespace):
    other = dataclasses.replace(namespace, model_id="not-here")
    with pytest.raises(errors.NotFound) as caught:
        await client.complete(other, PROMPT, worker=worker.address)
    assert caught.value.field == "namespace.model_id"
    with pytest.raises(errors.InvalidArgument) as caught:
        await client.complete(namespace, [1, 2, 100_000], worker=worker.address)
    assert caught.value.field == "prompt_token_ids"


# --------------------------------------------------------------------------- deadlines


async def test_route_deadline(client, router, namespace):
    router.delay_s = 2.0
    started = time.monotonic()
    with pytest.raises(errors.DeadlineExceeded):
        await client.route(namespace, PROMPT, timeout_s=0.2)
    assert time.monotonic() - started < 1.5


async def test_generate_deadline_mid_stream_cancels_on_the_worker(client, worker, namespace, monkeypatch):
    slow_down(monkeypatch, worker.engine, 0.01)
    cancelled_before = worker.loop.runs.num_cancelled
    received = 0
    with pytest.raises(errors.DeadlineExceeded):
        async for _ in client.generate(
            namespace,
            PROMPT,
            SamplingParams(max_tokens=400, ignore_eos=True),
            worker=worker.address,
            deadline_s=0.4,
        ):
            received += 1
    assert received > 0
    for _ in range(200):
        if worker.loop.runs.num_cancelled > cancelled_before:
            break
        await asyncio.sleep(0.01)
    assert worker.loop.runs.num_cancelled == cancelled_before + 1
    stats = await client.worker_stats(worker.address)
    assert stats.tiers[0].in_use_pages == 0
    assert (await client.check_integrity(worker.address)).is_ok


# --------------------------------------------------------------------------- retries


async def test_route_retries_unavailable_but_not_other_errors(client, router, peers, worker, namespace):
    router.decision = ranked(worker.address)
    router.num_failures = 2
    decision = await client.route(namespace, PROMPT)
    assert decision.best.address == worker.address and len(router.requests) == 3

    router.requests.clear()
    router.num_failures, router.fail_with = (
        1,
        errors.InvalidArgument("namespace.tenant is odd", field="namespace.tenant"),
    )
    with pytest.raises(errors.InvalidArgument) as caught:
        await client.route(namespace, PROMPT)
    assert caught.value.field == "namespace.tenant" and len(router.requests) == 1
    router.fail_with = errors.Unavailable("directory restarting")

    async with AsyncClient(controller=peers["address"], max_retries=1, retry_backoff_s=0.01) as stingy:
        router.requests.clear()
        router.num_failures = 3
        with pytest.raises(errors.Unavailable):
            await stingy.route(namespace, PROMPT)
        assert len(router.requests) == 2


async def test_session_hints_are_retried_and_converted(client, peers):
    sessions = peers["sessions"]
    sessions.requests.clear()
    sessions.num_failures = 1
    info = await client.pause("s-9", tool="web_search", expected_ms=1500)
    assert info.state is SessionState.PAUSED and info.session_id == "s-9"
    assert len(sessions.requests) == 2
    assert (sessions.requests[-1].tool_name, sessions.requests[-1].expected_ms) == ("web_search", 1500)
    assert (await client.returning("s-9", eta_ms=200)).state is SessionState.RESUMING
    assert sessions.requests[-1].eta_ms == 200
    assert (await client.end("s-9")).state is SessionState.ENDED


async def test_bearer_token_travels_in_metadata(router, peers, worker, namespace):
    router.decision = ranked(worker.address)
    async with AsyncClient(controller=peers["address"], token="sekret") as authed:
        await authed.route(namespace, PROMPT)
    assert router.metadata[-1].get("authorization") == "Bearer sekret"


async def test_no_controller_is_a_clear_error(worker, namespace):
    async with AsyncClient() as bare:
        with pytest.raises(errors.InvalidArgument, match="controller"):
            await bare.route(namespace, PROMPT)


# --------------------------------------------------------------------------- sync client


async def test_sync_client_completes_and_cancels_by_breaking(
    peers, worker, namespace, expected_tokens, monkeypatch
):
    slow_down(monkeypatch, worker.engine, 0.005)  # so the break lands mid-stream
    # The servers run on this test's event loop, so the blocking client runs in a thread.
    await asyncio.to_thread(_use_sync_client, peers, worker, namespace, expected_tokens)


def _use_sync_client(peers, worker, namespace, expected_tokens):
    peers["router"].decision = ranked(worker.address)
    with Client(controller=peers["address"], timeout_s=10) as client:
        tokens, final = client.complete(namespace, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
        assert tokens == expected_tokens and final.usage.generated_tokens == 8
        assert client.route(namespace, PROMPT).best.address == worker.address
        cancelled_before = worker.loop.runs.num_cancelled
        for event in client.generate(
            namespace, PROMPT, SamplingParams(max_tokens=500, ignore_eos=True), worker=worker.address
        ):
            assert isinstance(event, TokenChunk)
            break
        deadline = time.monotonic() + 5
        while worker.loop.runs.num_cancelled == cancelled_before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.loop.runs.num_cancelled == cancelled_before + 1
        stats = client.worker_stats(worker.address)
        assert stats.worker_id == "w-live"
