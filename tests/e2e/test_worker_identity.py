"""Worker identity and Route tickets on a running stack (decision 0007): a controller with a
token table, two real workers linked with their own tokens, real valkey, real gRPC.

The attacks are the ones an adversary holding one credential tries: a fake worker that
registers under another id or at another worker's address and announces pages of a prompt
tenant a never sent; a second stream for a live worker under another credential; a Route
ticket caught by one worker and replayed on another or after it lapsed; a frontend's bearer
token sent straight to a worker. Each is refused, and Route never ranks the fake."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain import errors
from kvtier.domain.hashing import namespace_digest, page_keys, root_key
from kvtier.domain.records import (
    BootId,
    GenerateRequest,
    ModelIdentity,
    PageEvent,
    PageEventBatch,
    Registration,
    TierCapacity,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc._gen import worker_link_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvtier.rpc.auth import TokenTableFile, hash_token
from kvtier.rpc.convert.link_events import to_proto_worker_event
from kvtier.rpc.convert.worker import to_proto_generate_request
from kvtier.rpc.identity import is_valid_proof, new_nonce, token_key
from kvtier.runtime.config import ControllerConfig
from kvtier.worker.link import WorkerLink
from kvtier.worker.servicer import serve_worker

from polling import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")

PAGE_SIZE = 4
SECRET_PROMPT = [40 + i for i in range(3 * PAGE_SIZE + 1)]  # tenant a never sends it before the attack
TOKENS = {"fe-a": "kvt_id-frontend-a", "w-a": "kvt_id-worker-a", "w-b": "kvt_id-worker-b",
          "w-b-2": "kvt_id-worker-b-second", "evil": "kvt_id-worker-evil"}
WORKER_IDS = {"w-a": "w-a", "w-b": "w-b", "w-b-2": "w-b", "evil": "evil"}  # token -> the id it registers


def write_table(path: Path) -> Path:
    lines = ["tokens:", f"  - {{name: fe-a, role: frontend, tenants: [a], sha256: {hash_token(TOKENS['fe-a'])}}}"]
    for name, worker_id in WORKER_IDS.items():
        lines.append(f"  - {{name: {name}, role: worker, worker_id: {worker_id}, sha256: {hash_token(TOKENS[name])}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(redis_url, checkpoint, tmp_path_factory):
    table = write_table(tmp_path_factory.mktemp("auth") / "tokens.yaml")
    controller = await serve_controller(
        ControllerConfig(port=0, state_dir=tmp_path_factory.mktemp("ctl"), auth_token_file=table,
                         lease_ttl_s=2.0, heartbeat_interval_s=0.5),
        redis_url=redis_url,
    )
    workers, links = {}, []
    try:
        for name in ("w-a", "w-b"):
            worker = workers[name] = await serve_worker(
                Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=128), worker_id=name,
                tokens=TokenTableFile(table), identity_token=TOKENS[name])
            link = WorkerLink(worker.loop, controller_address=controller.address, worker_id=name,
                              address=worker.address, boot_id=worker.boot_id, heartbeat_interval_s=0.2,
                              batch_interval_s=0.02, max_backoff_s=0.2, token=TOKENS[name], tickets=worker.tickets)
            link.start()
            links.append(link)
        await wait_for(lambda: all(controller.registry.get(WorkerId(n)) for n in workers), what="registrations")
        await wait_for(lambda: all(w.tickets.has_key for w in workers.values()), what="the workers' ticket keys")
        yield controller, workers, links
    finally:
        for link in links:
            await link.stop()
        for worker in workers.values():
            await worker.stop(0)
        await controller.stop(0)


def namespace(worker, tenant="a"):
    return dataclasses.replace(worker.engine.namespace, tenant=tenant)


def fake_registration(worker, worker_id: str, address: str) -> Registration:
    return Registration(
        worker_id=WorkerId(worker_id), address=address, boot_id=BootId("fake"),
        model=ModelIdentity.of(worker.engine.namespace), page_size=PAGE_SIZE,
        capacities=(TierCapacity(Tier.HBM, 1 << 20, 1 << 35),),
    )


def secret_prompt_pages(worker) -> PageEventBatch:
    """INSERTs of every page of SECRET_PROMPT for tenant a: anyone can compute the keys."""
    digest = namespace_digest(namespace(worker))
    keys = page_keys(digest, SECRET_PROMPT, PAGE_SIZE)
    parents = [root_key(digest), *keys[:-1]]
    events = tuple(PageEvent.insert(digest, key, parent, depth, Tier.HBM)
                   for depth, (key, parent) in enumerate(zip(keys, parents, strict=True), start=1))
    return PageEventBatch(seq=1, events=events)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The status a refused stream ended with, read as from an AioRpcError."""

    status: grpc.StatusCode
    text: str

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self.text


async def register_raw(controller, token: str, registration: Registration, pages: PageEventBatch | None = None):
    """Open a raw WorkerLink stream, register, announce ``pages``; the refusal, or None."""
    held = asyncio.Event()

    async def events():
        yield to_proto_worker_event(registration)
        if pages is not None:
            yield to_proto_worker_event(pages)
        await held.wait()  # keep the stream open: a stream admitted would stay up

    async with grpc.aio.insecure_channel(controller.address) as channel:
        call = worker_link_pb2_grpc.WorkerLinkStub(channel).Connect(
            events(), metadata=(("authorization", f"Bearer {token}"),), timeout=30)
        try:
            code = await call.code()  # the server's status (DEADLINE_EXCEEDED had it admitted the stream)
            return None if code is grpc.StatusCode.OK else Refusal(code, await call.details())
        finally:
            held.set()
            call.cancel()


async def assert_never_ranked(controller, worker, fake_id: str) -> None:
    async with AsyncClient(controller.address, token=TOKENS["fe-a"]) as client:
        decision = await client.route(namespace(worker), SECRET_PROMPT)
    assert {w.worker_id for w in decision.workers} == {"w-a", "w-b"}, f"Route ranked {fake_id}"
    assert all(w.matched_tokens.total_tokens == 0 for w in decision.workers), "Route believed the fake's pages"
    entry = controller.registry.get(WorkerId(fake_id))
    assert entry is None or entry.registration.boot_id != "fake", f"the registry took {fake_id}'s registration"


async def test_a_valid_worker_credential_cannot_register_another_id(stack):
    controller, workers, _ = stack
    worker = workers["w-a"]
    for fake_id in ("evil-worker", "w-a"):  # a new id, and a live worker's id
        err = await register_raw(controller, TOKENS["evil"], fake_registration(worker, fake_id, worker.address),
                                 secret_prompt_pages(worker))
        assert err is not None and err.code() is grpc.StatusCode.PERMISSION_DENIED, err
        assert "may register worker 'evil' only" in err.details() and TOKENS["evil"] not in err.details()
        await assert_never_ranked(controller, worker, fake_id)
    assert controller.registry.get(WorkerId("w-a")).address == worker.address  # the real one is untouched
    assert controller.links.identity.counters["refused.wrong_id"] >= 2


async def test_a_worker_credential_cannot_claim_an_address_it_does_not_serve(stack):
    controller, workers, _ = stack
    worker = workers["w-a"]
    # "evil" may register id evil, but neither at w-a's address (w-a cannot prove evil's token)
    # nor at an address where nothing answers.
    for address in (worker.address, "127.0.0.1:1"):
        err = await register_raw(controller, TOKENS["evil"], fake_registration(worker, "evil", address),
                                 secret_prompt_pages(worker))
        assert err is not None and err.code() is grpc.StatusCode.PERMISSION_DENIED, err
        assert f"address {address} did not prove" in err.details()
        await assert_never_ranked(controller, worker, "evil")
    assert controller.links.identity.counters["refused.address_unproven"] >= 2


async def test_a_second_stream_for_a_live_worker_under_another_credential_is_refused(stack, checkpoint, caplog):
    controller, workers, links = stack
    # A second process for slot w-b with its own (also valid) token: it proves its address, but
    # w-b is live under token w-b, so its stream is refused and the live one stays.
    impostor = await serve_worker(Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=16),
                                  worker_id="w-b", identity_token=TOKENS["w-b-2"])
    try:
        err = await register_raw(controller, TOKENS["w-b-2"], fake_registration(workers["w-b"], "w-b",
                                                                                impostor.address))
    finally:
        await impostor.stop(0)
    assert err is not None and err.code() is grpc.StatusCode.PERMISSION_DENIED, err
    assert "connected with another credential" in err.details() and TOKENS["w-b-2"] not in err.details()
    assert controller.links.identity.counters["refused.second_stream"] == 1
    (record,) = [r for r in caplog.records if getattr(r, "reason", None) == "second_stream"]
    assert (record.credential, record.live_credential, record.worker_id) == ("w-b-2", "w-b", "w-b")
    assert not any(token in r.getMessage() + str(r.__dict__) for r in caplog.records for token in TOKENS.values())
    assert controller.registry.get(WorkerId("w-b")).address == workers["w-b"].address
    assert links[1].is_connected and controller.links.sessions[WorkerId("w-b")].credential == "w-b"


async def test_prove_address_answers_for_its_own_worker_only(stack):
    _, workers, _ = stack
    worker = workers["w-a"]
    nonce = new_nonce()
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        reply = await stub.ProveAddress(worker_pb2.ProveAddressRequest(
            worker_id="w-a", address=worker.address, nonce=nonce), timeout=10)  # no token needed
        assert is_valid_proof(token_key(TOKENS["w-a"]), "w-a", worker.address, nonce, reply.proof)
        assert not is_valid_proof(token_key(TOKENS["w-b"]), "w-a", worker.address, nonce, reply.proof)
        for request, code in (
            (worker_pb2.ProveAddressRequest(worker_id="w-b", address=worker.address, nonce=nonce),
             grpc.StatusCode.NOT_FOUND),
            (worker_pb2.ProveAddressRequest(worker_id="w-a", address=worker.address, nonce=b"short"),
             grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ProveAddress(request, timeout=10)
            assert info.value.code() is code


async def generate_with(worker, metadata) -> grpc.StatusCode:
    request = GenerateRequest(namespace(worker), (1, 2, 3, 4, 5), SamplingParams(max_tokens=1))
    async with grpc.aio.insecure_channel(worker.address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Generate(to_proto_generate_request(request),
                                                            metadata=metadata, timeout=30)
        try:
            events = [event async for event in call]
        except grpc.aio.AioRpcError as err:
            generate_with.details = err.details()
            return err.code()
    assert events[-1].HasField("final")
    return grpc.StatusCode.OK


async def test_a_stolen_route_ticket_works_on_no_other_worker_nor_after_it_expires(stack):
    controller, workers, _ = stack
    async with AsyncClient(controller.address, token=TOKENS["fe-a"]) as client:
        decision = await client.route(namespace(workers["w-a"]), [1, 2, 3, 4, 5])
    tickets = {w.worker_id: w.ticket for w in decision.workers}
    assert set(tickets) == {"w-a", "w-b"} and all(tickets.values()) and tickets["w-a"] != tickets["w-b"]
    ticket_a = (("authorization", f"Ticket {tickets['w-a']}"),)
    # w-b caught w-a's ticket: it is no use on w-b (nor anywhere but w-a).
    assert await generate_with(workers["w-b"], ticket_a) is grpc.StatusCode.PERMISSION_DENIED
    assert "for worker 'w-a', not this worker ('w-b')" in generate_with.details
    assert await generate_with(workers["w-a"], ticket_a) is grpc.StatusCode.OK  # where it belongs, in time
    verifier = workers["w-a"].tickets
    verifier.clock = lambda: time.time() + controller.config.route_ticket_ttl_s + 1  # the worker's clock, later
    try:
        assert await generate_with(workers["w-a"], ticket_a) is grpc.StatusCode.UNAUTHENTICATED
        assert "expired" in generate_with.details
    finally:
        verifier.clock = time.time


async def test_a_frontend_bearer_token_is_refused_by_workers_and_never_sent_to_one(stack):
    controller, workers, _ = stack
    bearer = (("authorization", f"Bearer {TOKENS['fe-a']}"),)
    for worker in workers.values():
        assert await generate_with(worker, bearer) is grpc.StatusCode.UNAUTHENTICATED
        assert "never a bearer token" in generate_with.details and TOKENS["fe-a"] not in generate_with.details
    # What a worker sees from the client: a Route ticket, never the bearer token.
    seen: list[tuple[tuple[str, str], ...]] = []

    class Recorder(worker_pb2_grpc.WorkerServicer):
        async def Generate(self, request, context):
            seen.append(tuple(context.invocation_metadata()))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "recording only")
            yield worker_pb2.GenerateEvent()  # pragma: no cover

    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(Recorder(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncClient(controller.address, token=TOKENS["fe-a"]) as client:
            (best, *_) = (await client.route(namespace(workers["w-a"]), [1, 2, 3])).workers
            with pytest.raises(errors.Unavailable):
                await client.complete(namespace(workers["w-a"]), [1, 2, 3], worker=f"127.0.0.1:{port}",
                                      ticket=best.ticket)
            with pytest.raises(errors.Unavailable):
                await client.complete(namespace(workers["w-a"]), [1, 2, 3], worker=f"127.0.0.1:{port}")
            # Routed, the client reaches a real worker with that worker's ticket.
            _, final = await client.complete(namespace(workers["w-a"]), [1, 2, 3], SamplingParams(max_tokens=1))
            assert final.usage.prompt_tokens == 3
    finally:
        await server.stop(0)
    assert len(seen) == 2
    assert all(TOKENS["fe-a"] not in value for metadata in seen for _, value in metadata)
    assert dict(seen[0])["authorization"] == f"Ticket {best.ticket}" and "authorization" not in dict(seen[1])
