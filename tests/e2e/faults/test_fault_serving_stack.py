"""Faults on a serving stack of real processes: a storm of client cancellations, deadlines
expiring mid-stream, Redis killed and restarted under load, and a worker process killed.

One stack for the module: valkey-server (a process, on a fixed port so it can come back),
the controller, worker ``w-local`` in this process and worker ``w-proc`` as a
``python -m kvtier.worker`` process, both serving the same checkpoint. After every fault:
completed generations equal the oracle, no page leaked, no call outlived its deadline, and
the directory converges to the workers' inventories (see ``fault_harness``).
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import pytest_asyncio
from fault_harness import (
    HEARTBEAT_S,
    LEASE_TTL_S,
    PAGE_SIZE,
    Expected,
    ProcessWorker,
    assert_converged,
    assert_no_leak,
    cancel_leftovers,
    complete_checked,
    free_port,
    greedy,
    prompts,
    redis_reader,
    routed_workers,
    start_local_worker,
    start_valkey,
    stats_pages,
    stop_controller,
    within,
    worker_args,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain.errors import DeadlineExceeded, Unavailable
from kvtier.domain.hashing import namespace_digest
from kvtier.domain.records import GenerateFinal, TokenChunk
from kvtier.engine import Engine
from kvtier.runtime.config import ControllerConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")
TENANTS = ("storm", "deadline", "redis", "kill")


@dataclasses.dataclass
class Stack:
    valkey: object
    valkey_dir: object
    valkey_port: int
    controller: object
    local: object
    proc: ProcessWorker
    client: AsyncClient
    reader: object
    reader_client: object

    @property
    def namespace(self):
        return self.local.engine.namespace

    def ns(self, tenant: str):
        return dataclasses.replace(self.namespace, tenant=tenant)

    @property
    def digests(self) -> list[bytes]:
        return [namespace_digest(self.ns(t)) for t in TENANTS]

    async def expected(self) -> list[Expected]:
        wanted = [await self.local.expected()]
        if self.proc.process is not None and self.proc.process.poll() is None:
            wanted.append(Expected(self.proc.worker_id, num_pages=await stats_pages(self.client, self.proc.address)))
        return wanted

    async def check_after_fault(self, *, gone=()) -> None:
        addresses = [self.local.address]
        if not gone:
            addresses.append(self.proc.address)
        for address in addresses:
            await assert_no_leak(self.client, address)
        await assert_converged(self.reader, self.expected, digests=self.digests, gone=gone)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(fault_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("serving-faults")
    port = free_port()
    valkey = start_valkey(root / "valkey", port)
    config = ControllerConfig(port=0, state_dir=root, lease_ttl_s=LEASE_TTL_S, heartbeat_interval_s=HEARTBEAT_S)
    controller = await serve_controller(config, redis_url=valkey.url, controller_id="ctl-faults")
    proc = ProcessWorker("w-proc", worker_args(fault_checkpoint, controller.address, "w-proc", root / "proc"),
                         root / "w-proc.log")
    proc.start()  # its start-up (a second Python with torch) overlaps ours
    engine = Engine.from_pretrained(fault_checkpoint, page_size=PAGE_SIZE, num_pages=256)
    local = await start_local_worker(engine, controller.address, "w-local")
    await proc.wait_serving()
    client = AsyncClient(controller.address, timeout_s=30)
    reader_client, reader = await redis_reader(valkey.url)
    s = Stack(valkey, root / "valkey", port, controller, local, proc, client, reader, reader_client)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while len(await routed_workers(client, s.namespace, [1, 2, 3])) < 2:
        assert loop.time() < deadline, f"workers never registered: {proc.log_tail()}"
        await asyncio.sleep(0.1)
    yield s
    await client.close()
    proc.stop()
    await local.stop()
    await stop_controller(controller)
    await reader_client.aclose()
    s.valkey.stop()
    await cancel_leftovers()


async def test_two_hundred_concurrent_cancellations_leak_no_page(stack, oracle):
    ns = stack.ns("storm")
    storm = prompts(200, 12, seed=1, prefix=prompts(1, 8, seed=0)[0])  # a shared 2-page prefix
    num_cut = 0

    async def open_read_cancel(prompt, i):
        nonlocal num_cut
        events = stack.client.generate(ns, prompt, greedy(1500), deadline_s=60)
        first = await within(events.__anext__(), 60, "the first token")
        assert isinstance(first, TokenChunk)
        if i % 2:
            second = await within(events.__anext__(), 60, "the second token")
            assert isinstance(second, TokenChunk), "1500 tokens cannot be done after two events"
        await events.aclose()  # the client cancels the stream; the worker releases every page
        num_cut += 1

    await asyncio.gather(*(open_read_cancel(p, i) for i, p in enumerate(storm)))
    assert num_cut == len(storm)
    await stack.check_after_fault()
    await complete_checked(stack.client, oracle, ns, storm[0], 12, deadline_s=30)
    await stack.check_after_fault()


async def test_deadlines_expiring_mid_stream_end_the_streams_and_free_their_pages(stack, oracle):
    ns = stack.ns("deadline")
    cut = prompts(6, 10, seed=2)
    deadline_s = 1.0

    async def run_out_of_time(prompt, worker):
        received = 0
        with pytest.raises(DeadlineExceeded):
            async for event in stack.client.generate(ns, prompt, greedy(1900), deadline_s=deadline_s, worker=worker):
                assert not isinstance(event, GenerateFinal), "1900 tokens cannot be done within the deadline"
                received += 1
        return received

    workers = [stack.local.address, stack.proc.address]
    received = await within(
        asyncio.gather(*(run_out_of_time(p, workers[i % 2]) for i, p in enumerate(cut))), deadline_s, "6 streams"
    )
    assert all(n > 0 for n in received), f"each deadline must expire mid-stream: {received}"
    await stack.check_after_fault()
    for prompt in cut[:2]:
        await complete_checked(stack.client, oracle, ns, prompt, 8, deadline_s=30)
    await stack.check_after_fault()


async def test_redis_killed_and_restarted_under_load(stack, oracle):
    ns = stack.ns("redis")
    shared = prompts(1, 12, seed=3)[0]
    load_prompts = prompts(40, 9, seed=4, prefix=shared)
    route_errors: list[str] = []
    degraded: list[bool] = []
    reasons: list[str] = []
    done: list[int] = []
    stop = asyncio.Event()

    async def generations():
        i = 0
        while not stop.is_set():
            prompt = load_prompts[i % len(load_prompts)]
            await complete_checked(stack.client, oracle, ns, prompt, 6, deadline_s=30)
            done.append(i)
            i += 1

    async def routes():
        while not stop.is_set():
            try:
                decision = await within(stack.client.route(ns, shared + [1, 2, 3], timeout_s=5), 5, "Route")
                degraded.append(decision.is_degraded)
                reasons.append(decision.degraded_reason or "")
                assert len(decision.workers) == 2, "Route ranks every live worker, Redis or not"
            except Exception as exc:  # noqa: BLE001 - any failure of Route is what we count
                route_errors.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.02)

    async def health_of(service: str) -> int:
        async with grpc.aio.insecure_channel(stack.controller.address) as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        return response.status

    async def wait_for(predicate, what, timeout_s=15.0):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await predicate():
            assert loop.time() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(generations()), asyncio.create_task(generations()), asyncio.create_task(routes())]
    try:
        await wait_for(lambda: _true(len(done) >= 4), "the load to start")
        stack.valkey.stop()  # Redis dies: its data with it (no persistence)
        await wait_for(lambda: _true(bool(degraded) and degraded[-1]), "Route to answer degraded")
        before = len(done)
        await asyncio.sleep(2 * LEASE_TTL_S)  # longer than a lease: the leader's term lapses
        assert len(done) > before, "generation continues while Redis is down"
        stack.valkey = start_valkey(stack.valkey_dir, stack.valkey_port)
        serving = health_pb2.HealthCheckResponse.SERVING
        await wait_for(lambda: _is(health_of("kvtier.directory"), serving), "the directory to be reachable")
        # Stale pooled connections may fail once more after the restart: wait for a steady state.
        num_seen = len(degraded)
        await wait_for(
            lambda: _true(len(degraded) >= num_seen + 10 and not any(degraded[-10:])), "Route to stop degrading"
        )
    finally:
        stop.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    assert not route_errors, f"Route must degrade, never fail: {route_errors[:3]}"
    assert any(degraded) and not degraded[-1], reasons[-5:]
    await stack.check_after_fault()
    # The rebuilt directory routes by prefix again: the shared prefix is matched on its holder.
    decision = await stack.client.route(ns, shared + [5])
    assert decision.workers[0].matched_tokens.hbm_tokens == len(shared) // PAGE_SIZE * PAGE_SIZE


async def test_a_worker_process_killed_mid_stream(stack, oracle):
    ns = stack.ns("kill")
    prompt = prompts(1, 14, seed=5)[0]
    await complete_checked(stack.client, oracle, ns, prompt, 6, deadline_s=30, worker=stack.proc.address)
    events = stack.client.generate(ns, prompt, greedy(1800), deadline_s=30, worker=stack.proc.address)
    assert isinstance(await within(events.__anext__(), 30, "the first token"), TokenChunk)
    stack.proc.kill()
    with pytest.raises(Unavailable):
        await within(_drain(events), 30, "the stream of the killed worker")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 4 * LEASE_TTL_S + 5
    while "w-proc" in await routed_workers(stack.client, ns, prompt):
        assert loop.time() < deadline, "the killed worker is still routed to"
        await asyncio.sleep(0.1)
    for p in [prompt, *prompts(3, 9, seed=6)]:
        _, final = await complete_checked(stack.client, oracle, ns, p, 6, deadline_s=30)
    await stack.check_after_fault(gone=["w-proc"])


async def _drain(events) -> None:
    async for _ in events:
        pass


async def _true(value: bool) -> bool:
    return value


async def _is(awaitable, expected) -> bool:
    return (await awaitable) == expected
