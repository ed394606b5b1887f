"""The controller's WorkerLink and Router against real peers: real workers (tiny model,
``serve_worker`` + ``WorkerLink``) and a raw test client on the real stream, a real
valkey-server, gRPC on loopback.

Covered: registration, routing by the cached prefix a generation left behind (client routing
end to end, Admin.Lookup and Admin.Status agreeing), tenant isolation, malformed batches
rejected and counted while the stream stays up, a worker that stops heartbeating leaving
Route within its lease, and commands acknowledged by id."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from kvtier.client import AsyncClient
from kvtier.domain import errors
from kvtier.domain.hashing import namespace_digest, page_keys, root_key
from kvtier.domain.records import (
    BootId,
    CommandAck,
    DrainCommand,
    DropCommand,
    Heartbeat,
    InventoryPage,
    InventorySnapshotChunk,
    LookupRequest,
    ModelIdentity,
    NamespaceInventory,
    PageEvent,
    PageEventBatch,
    PageKeyPrefix,
    Registration,
    RequestSnapshotCommand,
    SnapshotId,
    TierCapacity,
    TokenPrefix,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc._gen import admin_pb2, admin_pb2_grpc, worker_link_pb2_grpc
from kvtier.rpc.convert.admin import (
    from_proto_controller_status,
    from_proto_lookup_result,
    from_proto_worker_list,
    to_proto_lookup_request,
)
from kvtier.rpc.convert.limits import MAX_BATCH_EVENTS
from kvtier.rpc.convert.link_commands import from_proto_controller_command
from kvtier.rpc.convert.link_events import to_proto_worker_event
from kvtier.worker.servicer import serve_worker

from live_controller import controller_at, linked
from polling import eventually, wait_for

in_module_loop = pytest.mark.asyncio(loop_scope="module")

PAGE_SIZE = 4
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155]  # 3 full pages + 2




@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def workers(checkpoint):
    servers = [
        await serve_worker(
            Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=256), worker_id=worker_id
        )
        for worker_id in ("w-a", "w-b")
    ]
    yield servers
    for server in servers:
        await server.stop(0)


def matched(decision) -> dict[str, tuple[int, int, int]]:
    return {w.worker_id: (t.hbm_tokens, t.dram_tokens, t.nvme_tokens)
            for w in decision.workers for t in [w.matched_tokens]}


@in_module_loop
async def test_route_ranks_the_worker_holding_the_prefix_first(workers, flushed_redis_url, tmp_path):
    w_a, w_b = workers
    namespace = w_a.engine.namespace
    async with controller_at(flushed_redis_url, tmp_path) as controller, linked(controller, w_a, w_b):
        assert controller.is_leader
        async with AsyncClient(controller.address) as client:
            first = await client.route(namespace, PROMPT)
            assert [w.worker_id for w in first.workers] == ["w-a", "w-b"]  # a tie: by id
            assert not first.is_degraded and matched(first) == {"w-a": (0, 0, 0), "w-b": (0, 0, 0)}

            # The client routes through the controller (to w-a) and streams from the worker.
            sampling = SamplingParams(max_tokens=3, ignore_eos=True)
            tokens, final = await client.complete(namespace, PROMPT, sampling)
            assert len(tokens) == 3 and final.usage.cached_tokens == 0
            full = PROMPT + tokens  # 17 tokens; the last one is never fed back: 4 full pages cached

            async def routed_by_prefix():  # the pages in the directory, and a heartbeat showing w-a idle
                decision = await client.route(namespace, full)
                ranked_first = decision.workers[0].score > decision.workers[1].score
                return decision if matched(decision)["w-a"] == (16, 0, 0) and ranked_first else None

            decision = await eventually(routed_by_prefix, what="w-a's pages in the directory")
            assert [w.worker_id for w in decision.workers] == ["w-a", "w-b"]
            assert matched(decision)["w-b"] == (0, 0, 0)
            assert decision.workers[0].score > decision.workers[1].score

            # The same prompt again goes to w-a and hits its cache.
            _, final = await client.complete(namespace, PROMPT, sampling)
            assert final.usage.cached_tokens == 12

        async with grpc.aio.insecure_channel(controller.address) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            lookup = from_proto_lookup_result(await admin.Lookup(
                to_proto_lookup_request(LookupRequest(namespace, TokenPrefix(tuple(full))))))
            assert lookup.namespace_digest == namespace_digest(namespace) and lookup.num_query_pages == 4
            assert [(m.worker_id, m.matched_tokens.hbm_tokens) for m in lookup.matches] == [("w-a", 16)]
            status = from_proto_controller_status(await admin.Status(admin_pb2.StatusRequest()))
            assert status.is_leader and status.leader_address == controller.address
            assert (status.num_workers, status.num_live_workers) == (2, 2) and status.is_directory_reachable
            assert status.tiers[0].tier is Tier.HBM and status.tiers[0].total_pages == 512
            workers = from_proto_worker_list(await admin.ListWorkers(admin_pb2.ListWorkersRequest()))
            assert [w.worker_id for w in workers] == ["w-a", "w-b"]
        assert controller.links.num_rejected == 0


@in_module_loop
async def test_tenants_with_identical_tokens_never_see_each_others_pages(
    workers, flushed_redis_url, tmp_path
):
    w_a, w_b = workers
    acme = dataclasses.replace(w_a.engine.namespace, tenant="acme")
    globex = dataclasses.replace(acme, tenant="globex")
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    async with controller_at(flushed_redis_url, tmp_path) as controller, linked(controller, w_a, w_b):
        async with AsyncClient(controller.address) as client:
            await client.complete(acme, prompt, SamplingParams(max_tokens=1), worker=w_b.address)

            async def acme_sees_it():
                return matched(await client.route(acme, prompt))["w-b"] == (8, 0, 0)

            await eventually(acme_sees_it, what="acme's pages")
            other = await client.route(globex, prompt)
            assert matched(other) == {"w-a": (0, 0, 0), "w-b": (0, 0, 0)}
            # Page keys of acme's prefix, looked up under globex's namespace, match nothing either.
            acme_keys = page_keys(namespace_digest(acme), prompt, PAGE_SIZE)
            under_globex = LookupRequest(globex, PageKeyPrefix(tuple(acme_keys)))
            lookup = await controller.router.lookup(under_globex, caller=None)
            assert lookup.matches == ()


class RawWorker:
    """A hand-driven WorkerLink stream: sends what a test writes, acks every command."""

    def __init__(self, call, worker_id):
        self.call = call
        self.worker_id = worker_id
        self.commands = []
        self._write_lock = asyncio.Lock()  # a gRPC stream takes one write at a time
        self.reader = asyncio.create_task(self._read())
        self.heartbeats = None

    def keep_heartbeating(self, interval_s=0.1):
        async def beat():
            for seq in itertools.count(1000):
                await self.send(Heartbeat(seq=seq, tiers=()))
                await asyncio.sleep(interval_s)

        self.heartbeats = asyncio.create_task(beat())

    @classmethod
    async def open(cls, channel, worker_id, namespace):
        call = worker_link_pb2_grpc.WorkerLinkStub(channel).Connect()
        registration = Registration(
            worker_id=WorkerId(worker_id), address="127.0.0.1:1", boot_id=BootId("raw"),
            model=ModelIdentity.of(namespace), page_size=PAGE_SIZE,
            capacities=(TierCapacity(Tier.HBM, 64, 64 << 15),),
        )
        await call.write(to_proto_worker_event(registration))
        return cls(call, worker_id)

    async def _read(self):
        async for message in self.call:
            command = from_proto_controller_command(message)
            self.commands.append(command)
            await self.send(CommandAck(command.command_id))

    async def send(self, event):
        async with self._write_lock:
            await self.call.write(to_proto_worker_event(event))

    async def close(self):
        self.call.cancel()
        for task in (self.heartbeats, self.reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, asyncio.InvalidStateError,
                                         grpc.aio.AioRpcError):
                    await task


def chain_inserts(digest, keys, first_depth=1, parent=None):
    events = []
    for i, key in enumerate(keys):
        prev = keys[i - 1] if i else (parent or root_key(digest))
        events.append(PageEvent.insert(digest, key, prev, first_depth + i, Tier.HBM))
    return events


@in_module_loop
async def test_malformed_batches_are_rejected_counted_and_the_stream_stays_up(
    workers, flushed_redis_url, tmp_path
):
    namespace = dataclasses.replace(workers[0].engine.namespace, tenant="raw")
    digest = namespace_digest(namespace)
    tokens = list(range(100, 116))
    keys = page_keys(digest, tokens, PAGE_SIZE)  # 4 pages
    async with controller_at(flushed_redis_url, tmp_path) as controller:
        async with grpc.aio.insecure_channel(controller.address) as channel:
            # The first event must be Register.
            call = worker_link_pb2_grpc.WorkerLinkStub(channel).Connect()
            await call.write(to_proto_worker_event(Heartbeat(seq=1, tiers=())))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "must be `register`, got `heartbeat`" in refused.value.details()

            raw = await RawWorker.open(channel, "raw", namespace)
            try:
                await raw.send(Heartbeat(seq=1, tiers=()))
                await raw.send(PageEventBatch(1, tuple(chain_inserts(digest, keys[:2]))))
                await raw.send(PageEventBatch(1, tuple(chain_inserts(digest, keys[2:3], 3, keys[1]))))
                await raw.send(PageEventBatch(0, ()))
                oversize = chain_inserts(digest, keys[:1]) * (MAX_BATCH_EVENTS + 1)
                await raw.send(PageEventBatch(2, tuple(oversize)))
                await raw.send(PageEventBatch(3, (PageEvent.insert(digest, keys[2], keys[1], 0, Tier.HBM),)))
                stray_parent = page_keys(digest, list(range(900, 908)), PAGE_SIZE)[1]
                await raw.send(PageEventBatch(4, (
                    PageEvent.insert(digest, keys[2], keys[1], 2**32 - 1, Tier.HBM),  # depth -1 as int32
                    PageEvent.insert(digest, keys[3], stray_parent, 4, Tier.HBM),  # parent never held
                )))
                await raw.send(PageEventBatch(5, tuple(chain_inserts(digest, keys[2:3], 3, keys[1]))))
                await raw.send(Heartbeat(seq=2, tiers=()))

                counters = controller.links.counters
                await wait_for(lambda: counters["batches.applied"] == 3, what="the good batches")
                assert {k: v for k, v in counters.items() if k.startswith("rejected.")} == {
                    "rejected.duplicate_seq": 1,
                    "rejected.regressed_seq": 1,
                    "rejected.oversize": 1,
                    "rejected.malformed": 1,
                    "rejected.bad_depth": 1,
                    "rejected.missing_parent": 1,
                }
                assert counters["batches.gap"] == 1 and counters["repairs.requested"] == 1
                assert not raw.call.done()

                async with AsyncClient(controller.address) as client:
                    decision = await client.route(namespace, tokens)
                assert matched(decision) == {"raw": (12, 0, 0)}  # pages 1-3; page 4 was refused
                await controller.directory.check_integrity(digest)

                # Commands go down with ids; the ack resolves the future.
                ack = await asyncio.wait_for(controller.send_command(WorkerId("raw"), DrainCommand(True)), 5)
                assert ack.ok and isinstance(raw.commands[-1].command, DrainCommand)
                assert raw.commands[-1].command_id == ack.command_id
                assert [type(c.command) for c in raw.commands] == [RequestSnapshotCommand, DrainCommand]
            finally:
                await raw.close()


@in_module_loop
async def test_a_snapshot_replaces_the_workers_entries(workers, flushed_redis_url, tmp_path):
    namespace = dataclasses.replace(workers[0].engine.namespace, tenant="snap")
    digest = namespace_digest(namespace)
    k = page_keys(digest, list(range(200, 216)), PAGE_SIZE)  # K1..K4
    old = page_keys(digest, list(range(300, 308)), PAGE_SIZE)  # L1, L2: gone by the snapshot
    async with controller_at(flushed_redis_url, tmp_path) as controller:
        async with grpc.aio.insecure_channel(controller.address) as channel:
            raw = await RawWorker.open(channel, "raw", namespace)
            raw.keep_heartbeating()
            try:
                await raw.send(PageEventBatch(1, tuple(chain_inserts(digest, old))))
                # Two chunks, the parents last; K3 is in DRAM. It reflects batches up to seq 1.
                await raw.send(InventorySnapshotChunk(SnapshotId("s"), 0, False, 1, (
                    NamespaceInventory(digest, Tier.DRAM, (InventoryPage(k[2], k[1], 3),)),
                    NamespaceInventory(digest, Tier.HBM, (InventoryPage(k[1], k[0], 2),)),
                )))
                await raw.send(InventorySnapshotChunk(SnapshotId("s"), 1, True, 1, (
                    NamespaceInventory(digest, Tier.HBM, (InventoryPage(k[0], root_key(digest), 1),)),
                )))
                await raw.send(PageEventBatch(1, ()))  # covered by the snapshot: a duplicate now
                await raw.send(PageEventBatch(2, (PageEvent.insert(digest, k[3], k[2], 4, Tier.DRAM),)))
                counters = controller.links.counters
                await wait_for(lambda: counters["batches.applied"] == 2, what="the batch after the snapshot")
                assert counters["snapshots.applied"] == 1 and counters["rejected.duplicate_seq"] == 1

                directory = controller.directory
                assert [(m.worker, bytes(m.tiers)) for m in (await directory.lookup(digest, k)).matches] == [
                    ("raw", bytes([Tier.HBM, Tier.HBM, Tier.DRAM, Tier.DRAM]))]
                assert (await directory.lookup(digest, old)).matches == ()

                async def purged():  # the sweeper purges the retired incarnation's entries
                    return (await directory.stats(digest)).entries_by_worker == {"raw": 4}

                await eventually(purged, what="the old incarnation's entries to be purged")
                await directory.check_integrity(digest)
                assert controller.links.num_rejected == 1
            finally:
                await raw.close()


@in_module_loop
async def test_a_worker_that_stops_heartbeating_leaves_route_within_its_lease(
    workers, flushed_redis_url, tmp_path
):
    w_a, _ = workers
    namespace = w_a.engine.namespace
    ttl_s = 0.6
    async with (
        controller_at(flushed_redis_url, tmp_path, lease_ttl_s=ttl_s, heartbeat_interval_s=0.2) as controller,
        grpc.aio.insecure_channel(controller.address) as channel,
        AsyncClient(controller.address) as client,
    ):
        async with linked(controller, w_a):
            raw = await RawWorker.open(channel, "raw", namespace)
            try:
                loop = asyncio.get_running_loop()
                for seq in range(1, 6):
                    await raw.send(Heartbeat(seq=seq, tiers=()))
                    last_heartbeat = loop.time()
                    await asyncio.sleep(0.1)
                    decision = await client.route(namespace, PROMPT)
                    assert {w.worker_id for w in decision.workers} == {"raw", "w-a"}

                # No more heartbeats: gone from Route once its lease (counted from when the
                # controller read the last heartbeat, a moment after it was sent) runs out.
                await asyncio.sleep(last_heartbeat + ttl_s + 0.1 - loop.time())
                decision = await client.route(namespace, PROMPT)
                assert [w.worker_id for w in decision.workers] == ["w-a"]
                assert not raw.call.done()  # its stream is open; only its lease ran out
                await wait_for(lambda: not controller.directory.is_live(WorkerId("raw")), timeout_s=1.0,
                               what="the directory lease to lapse")
            finally:
                await raw.close()
            # w-a kept heartbeating all along.
            assert [w.worker_id for w in (await client.route(namespace, PROMPT)).workers] == ["w-a"]
        # A closed stream leaves Route at once: with no live worker, Route says so.
        with pytest.raises(errors.Unavailable, match="no live worker"):
            await client.route(namespace, PROMPT)


@in_module_loop
async def test_commands_are_acknowledged_by_id(workers, flushed_redis_url, tmp_path):
    w_a, _ = workers
    namespace = dataclasses.replace(w_a.engine.namespace, tenant="cmd")
    prompt = list(range(300, 313))  # 3 full pages (+1 generated, never fed back)
    digest = namespace_digest(namespace)
    keys = page_keys(digest, prompt, PAGE_SIZE)
    async with controller_at(flushed_redis_url, tmp_path) as controller, linked(controller, w_a) as (link,):
        async with AsyncClient(controller.address) as client:
            await client.complete(namespace, prompt, SamplingParams(max_tokens=1), worker=w_a.address)

            async def holds(num_tokens):
                return matched(await client.route(namespace, prompt)).get("w-a") == (num_tokens, 0, 0)

            await eventually(lambda: holds(12), what="the pages")
            applied = controller.links.counters["snapshots.applied"]
            ack = await asyncio.wait_for(
                controller.send_command(w_a.worker_id, RequestSnapshotCommand(SnapshotId("s-1"))), 5)
            assert ack.ok and controller.links.counters["snapshots.applied"] == applied + 1
            assert await holds(12)  # a snapshot rebuilds the same entries

            drop = DropCommand(digest, (keys[1],))
            ack = await asyncio.wait_for(controller.send_command(w_a.worker_id, drop), 5)
            assert ack.ok
            await eventually(lambda: holds(4), what="the drop to reach the directory")
            with pytest.raises(errors.NotFound):
                controller.send_command(WorkerId("nobody"), DrainCommand(True))

            # The link drops and comes back: a new incarnation, rebuilt from the connect snapshot.
            await link.stop()
            await wait_for(lambda: w_a.worker_id not in controller.links.sessions, what="the disconnect")
            pending_before = controller.links.counters["snapshots.applied"]
            link.start()
            await wait_for(lambda: controller.links.counters["snapshots.applied"] > pending_before,
                           what="the reconnect snapshot")
            assert await holds(4)
        assert controller.links.num_rejected == 0


@in_module_loop
async def test_list_models_gives_the_namespace_fields_and_facts_a_frontend_needs(workers, flushed_redis_url,
                                                                                   tmp_path):
    """From ListModels alone (no checkpoint read, no admin call) a frontend routes and generates,
    and gets a prefix hit on its second request."""
    w_a, w_b = workers
    async with controller_at(flushed_redis_url, tmp_path) as controller, linked(controller, w_a, w_b):
        async with AsyncClient(controller.address) as client:
            (model,) = await client.list_models()
            served = w_a.engine.namespace
            assert model.namespace == dataclasses.replace(served, tenant="")
            assert model.namespace.weights_digest and model.namespace.rope_config == "{}"
            assert model.num_workers == 2 and model.adapters == ()
            assert model.facts.vocab_size == TINY_LLAMA_CONFIG["vocab_size"]
            assert model.facts.max_context_tokens == w_a.engine.max_model_len
            assert model.facts.eos_token_ids == (TINY_LLAMA_CONFIG["eos_token_id"],)
            assert model.facts.has_chat_template is False  # a random checkpoint has no tokenizer files

            namespace = dataclasses.replace(model.namespace, tenant="lm")
            prompt = [t % model.facts.vocab_size for t in PROMPT]
            sampling = SamplingParams(max_tokens=2, ignore_eos=True)
            _, first = await client.complete(namespace, prompt, sampling)
            hit = (len(prompt) // PAGE_SIZE) * PAGE_SIZE

            async def holder_ranked_first() -> bool:  # page events and an idle heartbeat arrived
                best = (await client.route(namespace, prompt)).workers[0]
                return best.matched_tokens.hbm_tokens == hit and best.score > 0

            await eventually(holder_ranked_first, what="the first request's pages in the directory")
            _, second = await client.complete(namespace, prompt, sampling)
            assert first.usage.cached_tokens == 0
            assert second.usage.cached_tokens == hit
