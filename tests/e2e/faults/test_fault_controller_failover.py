"""The active controller killed (SIGKILL) under load, with a standby taking over.

``tests/e2e/test_controller_failover.py`` shows the lease changing hands with no worker
attached. Here a worker and a client are attached, as in a deployment behind a Service:
both dial ``ipv4:<leader>,<standby>`` (gRPC's pick-first over an address list), so when the
leader process dies their channels move on to the standby. Streams in flight never touch
the controller and must finish with the oracle's tokens; the standby must lead within two
lease periods, take the worker's link, rebuild the directory from its inventory, and route
by prefix again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import pytest
import pytest_asyncio
import redis
from fault_harness import (
    HEARTBEAT_S,
    LEASE_TTL_S,
    PAGE_SIZE,
    REPO,
    assert_converged,
    assert_no_leak,
    cancel_leftovers,
    complete_checked,
    free_port,
    greedy,
    prompts,
    redis_reader,
    routed_workers,
    slowed,
    start_local_worker,
    stop_controller,
    within,
)

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain.hashing import namespace_digest
from kvtier.engine import Engine
from kvtier.runtime.config import ControllerConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")
STEPS = 40


async def leads(address: str) -> bool:
    async with AsyncClient(address, max_retries=0, timeout_s=2) as client:
        with contextlib.suppress(Exception):
            return (await client.status()).is_leader
    return False


@pytest_asyncio.fixture(loop_scope="module")
async def failover(fault_checkpoint, redis_url, tmp_path):
    flush = redis.Redis.from_url(redis_url)
    flush.flushdb()
    flush.close()
    port_a, port_b = free_port(), free_port()
    log_path = tmp_path / "controller-a.log"
    with open(log_path, "wb") as log_file:
        leader = subprocess.Popen(
            [sys.executable, "-m", "kvtier.controller", "--port", str(port_a), "--redis-url", redis_url,
             "--lease-ttl-s", str(LEASE_TTL_S), "--heartbeat-interval-s", str(HEARTBEAT_S),
             "--controller-id", "ctl-a", "--state-dir", str(tmp_path)],
            stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    standby = worker = None
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not await leads(f"127.0.0.1:{port_a}"):
            assert leader.poll() is None, log_path.read_text()[-3000:]
            assert loop.time() < deadline, "controller A never led"
            await asyncio.sleep(0.1)
        config = ControllerConfig(port=port_b, state_dir=tmp_path, lease_ttl_s=LEASE_TTL_S,
                                  heartbeat_interval_s=HEARTBEAT_S)
        standby = await serve_controller(config, redis_url=redis_url, controller_id="ctl-b")
        assert not standby.is_leader
        both = f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}"
        engine = Engine.from_pretrained(fault_checkpoint, page_size=PAGE_SIZE, num_pages=256)
        worker = await start_local_worker(engine, both, "w-failover")
        reader_client, reader = await redis_reader(redis_url)
        yield leader, standby, worker, both, reader
        await reader_client.aclose()
    finally:
        if leader.poll() is None:
            leader.send_signal(signal.SIGKILL)
            leader.wait(10)
        if worker is not None:
            await worker.stop()
        if standby is not None:
            await stop_controller(standby)
        await cancel_leftovers()


async def test_leader_killed_under_load_the_standby_takes_over_and_the_directory_converges(failover, oracle):
    leader, standby, worker, both, reader = failover
    ns = worker.engine.namespace
    shared = prompts(1, 16, seed=10)[0]
    work = prompts(6, 7, seed=11, prefix=shared)
    async with AsyncClient(both, timeout_s=30, retry_backoff_s=0.1, max_retries=8) as client:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not await routed_workers(client, ns, shared):
            assert loop.time() < deadline, "the worker never registered with the leader"
            await asyncio.sleep(0.05)
        for prompt in work[:2]:
            await complete_checked(client, oracle, ns, prompt, 8)

        # Streams in flight on the worker when the leader dies (slowed, so they still are).
        with slowed(worker.engine, 0.02):
            in_flight = [client.generate(ns, p, greedy(STEPS), deadline_s=60) for p in work[2:]]
            firsts = [await within(events.__anext__(), 60, "a first token") for events in in_flight]
            leader.send_signal(signal.SIGKILL)
            leader.wait(10)
            killed_at = loop.time()
            # When the standby leads, timed from the kill (the streams below take their own time).
            took_over = asyncio.create_task(_first_lead(standby, loop))

            async def finish(first, events, prompt):
                tokens = list(first.token_ids)
                async for event in events:
                    tokens += getattr(event, "token_ids", ())
                assert tokens == await oracle.greedy_off_loop(prompt, STEPS), "a stream in flight lost or changed tokens"

            await within(
                asyncio.gather(*(finish(f, e, p) for f, e, p in zip(firsts, in_flight, work[2:], strict=True))),
                60, "the streams in flight",
            )
            assert loop.time() - killed_at > 0.2, "the streams were still in flight when the leader died"

        led_at = await within(took_over, 30, "the standby to lead")
        assert led_at - killed_at < 2 * LEASE_TTL_S + 2, "the standby did not take over within two leases"
        deadline = loop.time() + 15
        while worker.worker_id not in {e.worker_id for e in standby.registry.live_workers()}:
            assert loop.time() < deadline, "the worker's link never moved to the new leader"
            await asyncio.sleep(0.05)

        await assert_no_leak(client, worker.address)
        digest = namespace_digest(ns)
        await assert_converged(reader, lambda: _one(worker), digests=[digest])
        # The new leader routes by prefix: the shared prefix is matched on the worker.
        decision = await within(client.route(ns, shared + [9]), 30, "Route via the new leader")
        assert decision.workers[0].worker_id == worker.worker_id
        assert decision.workers[0].matched_tokens.hbm_tokens == len(shared)
        _, final = await complete_checked(client, oracle, ns, shared + [9, 8, 7], 8)
        assert final.usage.cached_tokens == len(shared)
        status = await client.status()
        assert status.is_leader and status.controller_id == "ctl-b"
    await assert_converged(reader, lambda: _one(worker), digests=[digest])


async def _first_lead(standby, loop) -> float:
    while not standby.is_leader:
        await asyncio.sleep(0.02)
    return loop.time()


async def _one(worker):
    return [await worker.expected()]

