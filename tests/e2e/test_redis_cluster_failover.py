"""A Redis Cluster primary killed under load: the controller degrades as for a Redis outage, a
replica takes over, and the directory is rebuilt from the worker's inventory with nothing
wrong served in between.

A real controller (``redis+cluster://`` URL) and a real worker with its WorkerLink; three
masters with one replica each on loopback (``loadtests/redis_cluster.py``). The primary of the
worker's namespace is SIGKILLed while Route is polled. While it is down the worker drops every
page of the prefix Route asks about, so the promoted replica still lists pages nobody holds:
no Route answer may claim them once routing is no longer degraded. Leases are long (10 s), so
the worker's pre-failover incarnation is still live in Redis when the replica takes over.

Skipped without ``redis-server``. The failover's phases (kill → replica promoted → directory
reachable → directory equal to the inventory) are printed; ``loadtests/bench_redis_failover.py``
measures them over several kills.
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from directory_checks import directory_matches_inventory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.client import AsyncClient
from kvtier.controller.directory import Directory
from kvtier.controller.directory_scripts import meta_key
from kvtier.controller.redis_connect import connect
from kvtier.controller.server import serve_controller
from kvtier.domain.hashing import namespace_digest
from kvtier.domain.records import RouteRequest, TokenPrefix
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc._gen import router_pb2_grpc
from kvtier.rpc.convert.router import to_proto_route_request
from kvtier.runtime.config import ControllerConfig
from kvtier.worker.link import WorkerLink
from kvtier.worker.servicer import serve_worker
from loadtests.redis_cluster import LocalRedisCluster, find_binaries, missing_reason

from polling import wait_for

pytestmark = [pytest.mark.skipif(find_binaries() is None, reason=missing_reason()),
              pytest.mark.asyncio(loop_scope="module")]
PAGE_SIZE = 4
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
PREFIX = tuple(range(300, 324))  # six pages


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


@pytest_asyncio.fixture(loop_scope="module")
async def worker(checkpoint):
    server = await serve_worker(
        Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=256), worker_id="w-cluster"
    )
    yield server
    await server.stop(0)


async def test_a_killed_primary_degrades_routing_then_the_directory_is_rebuilt_with_nothing_wrong_served(
    worker, tmp_path
):
    cluster = LocalRedisCluster(tmp_path / "redis-cluster", node_timeout_ms=1000)
    cluster.start()  # from the event loop's thread: the servers die with it (LocalRedisCluster)
    config = ControllerConfig(port=0, state_dir=tmp_path, lease_ttl_s=10.0, heartbeat_interval_s=0.5)
    controller = await serve_controller(config, redis_url=cluster.url)
    link = WorkerLink(worker.loop, controller_address=controller.address, worker_id=worker.worker_id,
                      address=worker.address, boot_id=worker.boot_id, heartbeat_interval_s=0.1,
                      batch_interval_s=0.02, max_backoff_s=0.2)
    link.start()
    namespace = worker.engine.namespace
    digest = namespace_digest(namespace)
    reader_client = connect(cluster.url)
    reader = Directory(reader_client, fence_token=None)
    loop = asyncio.get_running_loop()
    answers: list[tuple[float, bool, int]] = []  # (time, degraded, tokens matched on the worker)
    failures: list[grpc.StatusCode] = []
    health: list[int] = []
    stop = asyncio.Event()

    async def poll_route_and_health(channel):
        router = router_pb2_grpc.RouterStub(channel)
        checker = health_pb2_grpc.HealthStub(channel)
        request = to_proto_route_request(RouteRequest(namespace, TokenPrefix(PREFIX)))
        while not stop.is_set():
            try:
                response = await router.Route(request, timeout=5)
                (only,) = response.workers
                tokens = only.matched_tokens
                matched = tokens.hbm_tokens + tokens.dram_tokens + tokens.nvme_tokens
                answers.append((loop.time(), response.degraded, matched))
            except grpc.aio.AioRpcError as err:
                failures.append(err.code())
            status = (await checker.Check(health_pb2.HealthCheckRequest(service="kvtier.directory"))).status
            if not health or health[-1] != status:
                health.append(status)
            await asyncio.sleep(0.02)

    async def generate(client, prompts):
        for prompt in prompts:
            await client.complete(namespace, list(prompt), SamplingParams(max_tokens=2, ignore_eos=True),
                                  worker=worker.address)

    try:
        async with grpc.aio.insecure_channel(controller.address) as channel, AsyncClient() as client:
            await wait_for(lambda: controller.links.counters["snapshots.applied"] >= 1, what="registration")
            poller = asyncio.create_task(poll_route_and_health(channel))
            await generate(client, [PREFIX + (1, 2, 3)])
            await wait_for(lambda: answers and not answers[-1][1] and answers[-1][2] == len(PREFIX),
                           what="Route to see the prefix cached")

            victim = await asyncio.to_thread(cluster.primary_of, meta_key(digest))
            killed_at = loop.time()
            cluster.kill(victim)
            await generate(client, [(7, 8, 9, 10, 11)])  # events bound for the dead primary
            await wait_for(lambda: health[-1] == NOT_SERVING, what="kvtier.directory NOT_SERVING")
            dropped = await worker.loop.drop_pages(digest, (), whole_namespace=True)
            dropped_at = loop.time()
            assert dropped.num_dropped >= len(PREFIX) // PAGE_SIZE
            await generate(client, [tuple(range(100 + 20 * i, 109 + 20 * i)) for i in range(3)])

            await asyncio.to_thread(cluster.wait_for_failover)
            promoted_at = loop.time()
            await wait_for(lambda: health[-1] == SERVING, timeout_s=15, what="kvtier.directory SERVING again")
            reachable_at = loop.time()
            deadline = loop.time() + 20.0
            while not await directory_matches_inventory(reader, worker):
                assert loop.time() < deadline, (
                    f"the directory did not converge in 20 s: role {controller.access.role.value}, "
                    f"counters {dict(controller.links.counters)}")
                await asyncio.sleep(0.1)
            converged_at = loop.time()
            assert len(await worker.loop.inventory()) == 1, "one namespace"
            num_answered = len(answers)
            await wait_for(lambda: len(answers) > num_answered and not answers[-1][1], timeout_s=15,
                           what="a Route no longer degraded")
            stop.set()
            await poller
    finally:
        stop.set()
        await link.stop()
        await controller.stop(0)
        await reader_client.aclose()
        await asyncio.to_thread(cluster.stop)
    print(f"\nRedis Cluster failover (node timeout {cluster.node_timeout_ms} ms): replica promoted "
          f"{promoted_at - killed_at:.2f} s after the kill, directory reachable {reachable_at - killed_at:.2f} s, "
          f"rebuilt {converged_at - killed_at:.2f} s")
    assert not failures, f"Route must never fail: {failures}"
    assert any(degraded for _, degraded, _ in answers)
    wrong = [(round(t - dropped_at, 2), matched) for t, degraded, matched in answers
             if t > dropped_at and not degraded and matched]
    assert not wrong, f"Route claimed dropped pages after the failover (s after the drop, tokens): {wrong}"
    assert any(t > dropped_at and not degraded for t, degraded, _ in answers)
    assert health[:2] == [SERVING, NOT_SERVING] and health[-1] == SERVING
