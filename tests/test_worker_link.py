"""The worker's WorkerLink client against an in-test recording WorkerLink servicer (a test
peer on loopback): registration first, heartbeats, page events whose keys, parents and
depths match kvtier.domain.hashing, commands acknowledged by id, and re-registration plus a
fresh snapshot after the controller restarts."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc.aio
import pytest
import pytest_asyncio

from kvtier.client import AsyncClient
from kvtier.domain import errors
from kvtier.domain.hashing import namespace_digest, page_keys, root_key
from kvtier.domain.records import (
    CommandAck,
    CommandId,
    ControllerCommand,
    DemoteCommand,
    DrainCommand,
    DropCommand,
    Heartbeat,
    InventoryPage,
    InventorySnapshotChunk,
    NamespaceInventory,
    PageEventBatch,
    PageEventKind,
    Registration,
    RequestSnapshotCommand,
    SnapshotId,
    TokenChunk,
)
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc._gen import worker_link_pb2_grpc
from kvtier.rpc.convert.link_commands import to_proto_controller_command
from kvtier.rpc.convert.link_events import from_proto_worker_event
from kvtier.tiers.manager import TierConfig
from kvtier.worker.link import WorkerLink, snapshot_chunks
from kvtier.worker.servicer import serve_worker

from polling import wait_for

in_module_loop = pytest.mark.asyncio(loop_scope="module")

PAGE_SIZE = 4
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155]  # 3 full pages + 2


@dataclass
class Connection:
    events: list = field(default_factory=list)
    commands: asyncio.Queue = field(default_factory=asyncio.Queue)

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]

    def ack(self, command_id):
        acks = [e for e in self.of(CommandAck) if e.command_id == command_id]
        return acks[0] if acks else None


class RecordingLink(worker_link_pb2_grpc.WorkerLinkServicer):
    """Records every WorkerEvent per connection; sends what a test puts in ``commands``."""

    def __init__(self) -> None:
        self.connections: list[Connection] = []

    async def Connect(self, request_iterator, context):
        connection = Connection()
        self.connections.append(connection)

        async def read():
            async for message in request_iterator:
                connection.events.append(from_proto_worker_event(message))

        reader = asyncio.create_task(read())
        command = None
        try:
            while True:
                command = asyncio.create_task(connection.commands.get())
                done, _ = await asyncio.wait({command, reader}, return_when=asyncio.FIRST_COMPLETED)
                if reader in done:
                    return
                yield to_proto_controller_command(command.result())
        finally:
            for task in (reader, command):
                if task is not None:
                    task.cancel()


async def start_peer(port: int = 0):
    server = grpc.aio.server()
    peer = RecordingLink()
    worker_link_pb2_grpc.add_WorkerLinkServicer_to_server(peer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, peer, bound



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


@pytest_asyncio.fixture(loop_scope="module")
async def worker(checkpoint):
    server = await serve_worker(
        Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=64), worker_id="w-link"
    )
    yield server
    await server.stop(0)


def make_link(worker, port, **kwargs):
    return WorkerLink(
        worker.loop,
        controller_address=f"127.0.0.1:{port}",
        worker_id=worker.worker_id,
        address=worker.address,
        boot_id=worker.boot_id,
        heartbeat_interval_s=kwargs.pop("heartbeat_interval_s", 0.05),
        batch_interval_s=0.02,
        max_backoff_s=0.3,
        **kwargs,
    )


def inserts(connection):
    return [e for b in connection.of(PageEventBatch) for e in b.events if e.kind is PageEventKind.INSERT]


def drops(connection):
    return [e for b in connection.of(PageEventBatch) for e in b.events if e.kind is PageEventKind.DROP]


def snapshot_keys(connection, snapshot_id=None):
    chunks = [c for c in connection.of(InventorySnapshotChunk) if snapshot_id in (None, c.snapshot_id)]
    return [p.page_key for c in chunks for inv in c.inventories for p in inv.pages]


@in_module_loop
async def test_link_registers_reports_pages_obeys_commands_and_survives_a_controller_restart(worker):
    server, peer, port = await start_peer()
    link = make_link(worker, port)
    link.start()
    try:
        await wait_for(
            lambda: peer.connections and len(peer.connections[0].of(Heartbeat)) >= 3, what="heartbeats"
        )
        conn = peer.connections[0]
        registration = conn.events[0]
        assert isinstance(registration, Registration)
        assert (registration.worker_id, registration.address, registration.boot_id) == (
            "w-link",
            worker.address,
            worker.boot_id,
        )
        assert registration.model.model_id == "tiny" and registration.page_size == PAGE_SIZE
        assert [(c.tier, c.capacity_pages) for c in registration.capacities] == [(Tier.HBM, 64)]
        first_snapshot = conn.events[1]
        assert isinstance(first_snapshot, InventorySnapshotChunk) and first_snapshot.is_last
        assert first_snapshot.num_pages == 0 and first_snapshot.as_of_seq == 0
        assert [h.seq for h in conn.of(Heartbeat)][:3] == [1, 2, 3]
        assert conn.of(Heartbeat)[0].tiers[0].total_pages == 64

        # A generation caches 4 full pages (14 prompt + 3 generated, the last one never fed back).
        async with AsyncClient() as client:
            tokens, _ = await client.complete(
                worker.engine.namespace,
                PROMPT,
                SamplingParams(max_tokens=3, ignore_eos=True),
                worker=worker.address,
            )
        digest = namespace_digest(worker.engine.namespace)
        keys = page_keys(digest, (PROMPT + tokens)[:16], PAGE_SIZE)
        assert len(keys) == 4
        await wait_for(lambda: len(inserts(conn)) == 4, what="INSERT events")
        events = inserts(conn)
        assert [e.page_key for e in events] == keys
        assert [e.parent_key for e in events] == [root_key(digest), *keys[:-1]]
        assert [e.depth for e in events] == [1, 2, 3, 4]
        assert {(e.namespace_digest, e.tier) for e in events} == {(digest, Tier.HBM)}
        batch_seqs = [b.seq for b in conn.of(PageEventBatch)]
        assert batch_seqs == list(range(1, len(batch_seqs) + 1))

        # Drop takes the page and its descendant, leaf first, and acks by id.
        await conn.commands.put(ControllerCommand(CommandId(1), DropCommand(digest, (keys[2],))))
        await wait_for(lambda: conn.ack(1) is not None and len(drops(conn)) == 2, what="drop ack")
        assert conn.ack(1).ok and conn.ack(1).num_pages == 2
        assert [e.page_key for e in drops(conn)] == [keys[3], keys[2]]
        assert worker.engine.pool.counts().cached == 2

        await conn.commands.put(ControllerCommand(CommandId(2), DemoteCommand(digest, (keys[0],), Tier.DRAM)))
        await conn.commands.put(ControllerCommand(CommandId(3), RequestSnapshotCommand(SnapshotId("snap-3"))))
        await wait_for(lambda: conn.ack(3) is not None, what="snapshot ack")
        # This worker has HBM only: nothing to demote into.
        assert not conn.ack(2).ok and conn.ack(2).error_code == "FAILED_PRECONDITION"
        assert conn.ack(3).ok
        assert snapshot_keys(conn, "snap-3") == keys[:2]
        (chunk,) = [c for c in conn.of(InventorySnapshotChunk) if c.snapshot_id == "snap-3"]
        sent_before = conn.events[: conn.events.index(chunk)]
        assert chunk.as_of_seq == max(b.seq for b in sent_before if isinstance(b, PageEventBatch))

        # The controller restarts on the same port: re-register (same boot), fresh snapshot.
        last_heartbeat = conn.of(Heartbeat)[-1].seq
        last_batch = max(b.seq for b in conn.of(PageEventBatch))
        await server.stop(0)
        await wait_for(lambda: not link.is_connected, what="the link to notice")
        server, peer2, _ = await start_peer(port)
        await wait_for(lambda: peer2.connections and peer2.connections[0].of(Heartbeat), what="reconnect")
        conn2 = peer2.connections[0]
        assert isinstance(conn2.events[0], Registration) and conn2.events[0].boot_id == worker.boot_id
        assert isinstance(conn2.events[1], InventorySnapshotChunk)
        assert snapshot_keys(conn2) == keys[:2]
        assert conn2.events[1].as_of_seq >= last_batch
        assert conn2.of(Heartbeat)[0].seq > last_heartbeat
        assert link.num_connections == 2
    finally:
        await link.stop()
        await server.stop(0)
    assert (await worker.loop.check_integrity()).is_ok


@in_module_loop
async def test_drain_command_stops_and_resumes_admission(worker):
    server, peer, port = await start_peer()
    link = make_link(worker, port)
    link.start()
    try:
        await wait_for(lambda: link.is_connected, what="connection")
        conn = peer.connections[0]
        async with AsyncClient() as client:
            await conn.commands.put(ControllerCommand(CommandId(7), DrainCommand(draining=True)))
            await wait_for(lambda: conn.ack(7) is not None, what="drain ack")
            with pytest.raises(errors.Unavailable, match="draining"):
                await client.complete(worker.engine.namespace, PROMPT, worker=worker.address)
            await conn.commands.put(ControllerCommand(CommandId(8), DrainCommand(draining=False)))
            await wait_for(lambda: conn.ack(8) is not None, what="resume ack")
            tokens, _ = await client.complete(
                worker.engine.namespace, PROMPT, SamplingParams(max_tokens=2), worker=worker.address
            )
            assert len(tokens) == 2
    finally:
        await link.stop()
        await server.stop(0)


@in_module_loop
async def test_link_keeps_retrying_until_a_controller_appears(worker):
    server, _, port = await start_peer()
    await server.stop(0)  # the port is known but nobody listens yet
    link = make_link(worker, port)
    link.start()
    try:
        await asyncio.sleep(0.3)
        assert not link.is_connected
        server, peer, _ = await start_peer(port)
        await wait_for(
            lambda: peer.connections and peer.connections[0].events, timeout_s=5, what="connection"
        )
        assert isinstance(peer.connections[0].events[0], Registration)
    finally:
        await link.stop()
        await server.stop(0)


@in_module_loop
async def test_a_large_demotion_is_acknowledged_once_applied_while_decode_keeps_stepping(checkpoint, tmp_path):
    """A park's Demote runs as a background transfer: the engine thread submits it and keeps
    decoding the running request; the ack comes once the pages are where the index says,
    with the real counts (the running request's pages stay and are counted as skipped)."""
    page_size = 16
    fills = [[(37 * i + 5 * j) % 250 + 1 for j in range(160)] for i in range(4)]  # 40 full pages
    page_bytes = Engine.from_pretrained(checkpoint, page_size=page_size, num_pages=4).geometry.page_bytes
    # Paced to take about a second (the budget that paces background demotion): plenty of
    # decode steps of the running request fit in it.
    config = TierConfig(nvme_slots=256, nvme_dir=tmp_path / "nvme", demotion_budget_bytes_per_s=40 * page_bytes)
    engine = Engine.from_pretrained(checkpoint, page_size=page_size, num_pages=256, tier_config=config)
    tiered = await serve_worker(engine, worker_id="w-park")
    long_prompt = [7, 8, 9] * 7
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    reference = Engine.from_pretrained(checkpoint, page_size=page_size, num_pages=256).generate(
        [long_prompt], params)[0].token_ids
    tickets, steps_in_flight = [], []
    start_demotion, step = engine.tiers.start_demotion, engine.step

    def counting_start(nodes, dst):  # engine thread
        tickets.append(start_demotion(nodes, dst))
        return tickets[-1]

    def counting_step(**kwargs):  # engine thread: a decode step while the park's transfer runs
        if tickets and not tickets[0].is_done:
            steps_in_flight.append(len(tickets[0].transfer_ids))
        return step(**kwargs)

    engine.tiers.start_demotion, engine.step = counting_start, counting_step
    server, peer, port = await start_peer()
    link = make_link(tiered, port)
    link.start()
    try:
        await wait_for(lambda: link.is_connected, what="connection")
        conn = peer.connections[0]
        namespace = engine.namespace
        async with AsyncClient() as client:
            for prompt in fills:
                await client.complete(namespace, prompt, SamplingParams(max_tokens=1), worker=tiered.address)
            tokens: list[int] = []
            async with contextlib.aclosing(
                client.generate(namespace, long_prompt, params, worker=tiered.address)
            ) as events:
                async for event in events:
                    if not tokens:  # running: ask for every page of the namespace to go down
                        command = DemoteCommand(namespace_digest(namespace), (), Tier.NVME, whole_namespace=True)
                        await conn.commands.put(ControllerCommand(CommandId(21), command))
                    if isinstance(event, TokenChunk):
                        tokens.extend(event.token_ids)
            await wait_for(lambda: conn.ack(21) is not None, timeout_s=30, what="demote ack")
        ack = conn.ack(21)
        assert ack.ok and ack.num_pages >= 40
        assert ack.num_skipped_pages >= 1  # the running request's prompt pages were held
        assert len(tickets) == 1 and tickets[0].is_done
        assert steps_in_flight, "decode must keep stepping while the demotion's transfer runs"
        inventory = await tiered.loop.inventory()
        assert sum(len(i.pages) for i in inventory if i.tier is Tier.NVME) == ack.num_pages
        assert tokens == reference
        assert (await tiered.loop.check_integrity()).is_ok
    finally:
        await link.stop()
        await server.stop(0)
        await tiered.stop(0)


def test_snapshot_chunks_split_pages_and_mark_the_last():
    digest = b"d" * 16
    pages = tuple(InventoryPage(bytes([i]) * 16, bytes([i + 100]) * 16, i + 1) for i in range(5))
    inventories = [
        NamespaceInventory(digest, Tier.HBM, pages[:3]),
        NamespaceInventory(digest, Tier.HBM, pages[3:]),
    ]
    chunks = snapshot_chunks(SnapshotId("s"), inventories, as_of_seq=9, max_pages=2)
    assert [c.num_pages for c in chunks] == [2, 2, 1]
    assert [c.chunk_index for c in chunks] == [0, 1, 2] and [c.is_last for c in chunks] == [
        False,
        False,
        True,
    ]
    assert [p for c in chunks for inv in c.inventories for p in inv.pages] == list(pages)
    assert {c.as_of_seq for c in chunks} == {9}
    (empty,) = snapshot_chunks(SnapshotId("e"), [], as_of_seq=0)
    assert empty.is_last and empty.num_pages == 0
