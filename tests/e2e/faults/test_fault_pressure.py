"""Memory pressure on a live stack: a pool exhausted mid-decode, and offload thrashing.

- Pool exhausted mid-decode: a worker whose HBM holds a fraction of what the concurrent
  requests need (admission reserves 4 output tokens, so sequences that were admitted run
  out of pages while decoding). Sequences that cannot grow are preempted — their pages
  spilled to DRAM where the worker has one, recomputed otherwise — and resumed; none is
  cut short, none crashes the worker, every output equals the oracle.
- Offload thrashing: a working set just above HBM, cycled through again and again. Pages
  move down and back up, but no page moves more than twice per round it is used in (down
  once, up once: no oscillation), and the background demotion stays within the configured
  bytes-per-second budget.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import pytest
import pytest_asyncio
import redis
from fault_harness import (
    HEARTBEAT_S,
    LEASE_TTL_S,
    PAGE_SIZE,
    assert_converged,
    assert_no_leak,
    cancel_leftovers,
    complete_checked,
    page_geometry,
    prompts,
    redis_reader,
    start_local_worker,
    stop_controller,
)

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain.hashing import namespace_digest
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SchedulerConfig
from kvtier.runtime.config import ControllerConfig
from kvtier.tiers.manager import TierConfig, Watermark

pytestmark = pytest.mark.asyncio(loop_scope="module")
TIGHT_PAGES = 32  # 128 tokens of HBM for 8 concurrent requests of ~40 tokens each
THRASH_HBM_PAGES = 40
THRASH_BUDGET_BYTES_PER_S = 64 << 10
THRASH_BATCH_PAGES = 4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(fault_checkpoint, redis_url, tmp_path_factory):
    flush = redis.Redis.from_url(redis_url)
    flush.flushdb()
    flush.close()
    root = tmp_path_factory.mktemp("pressure-faults")
    config = ControllerConfig(port=0, state_dir=root, lease_ttl_s=LEASE_TTL_S, heartbeat_interval_s=HEARTBEAT_S)
    controller = await serve_controller(config, redis_url=redis_url, controller_id="ctl-pressure")
    tight = SchedulerConfig(output_reservation_tokens=4)
    thrash_tiers = TierConfig(
        dram_pages=128,
        hbm_watermark=Watermark(high=0.9, low=0.8),
        max_batch_pages=THRASH_BATCH_PAGES,
        demotion_budget_bytes_per_s=THRASH_BUDGET_BYTES_PER_S,
    )
    engines = {
        "w-recompute": Engine.from_pretrained(fault_checkpoint, page_size=PAGE_SIZE, num_pages=TIGHT_PAGES,
                                              scheduler_config=tight),
        "w-spill": Engine.from_pretrained(fault_checkpoint, page_size=PAGE_SIZE, num_pages=TIGHT_PAGES,
                                          scheduler_config=tight, tier_config=TierConfig(dram_pages=64)),
        "w-thrash": Engine.from_pretrained(fault_checkpoint, page_size=PAGE_SIZE, num_pages=THRASH_HBM_PAGES,
                                           tier_config=thrash_tiers),
    }
    workers = {w: await start_local_worker(e, controller.address, w) for w, e in engines.items()}
    client = AsyncClient(controller.address, timeout_s=60)
    reader_client, reader = await redis_reader(redis_url)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while len(controller.registry.live_workers()) < len(workers):
        assert loop.time() < deadline, "workers never registered"
        await asyncio.sleep(0.05)
    yield workers, client, reader
    await client.close()
    for worker in workers.values():
        await worker.stop()
    await stop_controller(controller)
    await reader_client.aclose()
    await cancel_leftovers()


async def _converged(reader, worker, tenant):
    async def expected():
        return [await worker.expected()]

    ns = dataclasses.replace(worker.engine.namespace, tenant=tenant)
    await assert_converged(reader, expected, digests=[namespace_digest(ns)])


@pytest.mark.parametrize("worker_id", ["w-recompute", "w-spill"])
async def test_sequences_that_cannot_grow_are_preempted_and_resumed_exactly(stack, oracle, worker_id):
    workers, client, reader = stack
    worker = workers[worker_id]
    ns = dataclasses.replace(worker.engine.namespace, tenant=worker_id)
    work = prompts(8, 14, seed=40)
    steps = 24  # each request alone needs (14 + 24) / 4 = 10 pages; together 80 of 32
    preemptions = worker.engine.scheduler.num_preemptions if hasattr(worker.engine.scheduler, "num_preemptions") else None
    results = await asyncio.gather(
        *(complete_checked(client, oracle, ns, p, steps, deadline_s=120, worker=worker.address) for p in work)
    )
    usage = [final.usage for _, final in results]
    assert all(u.generated_tokens == steps for u in usage), "no sequence may be cut short"
    resumed = sum(u.recomputed_tokens for u in usage) if worker_id == "w-recompute" else (
        worker.engine.tiers.counters.pages_moved.get((Tier.HBM, Tier.DRAM), 0))
    assert resumed > 0, "the pool must have run out mid-decode"
    if preemptions is not None:
        assert worker.engine.scheduler.num_preemptions > preemptions
    await assert_no_leak(client, worker.address)
    await _converged(reader, worker, worker_id)


async def test_a_working_set_just_above_hbm_moves_within_budget_without_oscillating(stack, oracle):
    workers, client, reader = stack
    worker = workers["w-thrash"]
    engine = worker.engine
    ns = dataclasses.replace(engine.namespace, tenant="thrash")
    work = prompts(8, 21, seed=41)  # 8 x 6 pages = 48 pages cycled through 40 of HBM
    rounds, steps = 4, 4
    moves: collections.Counter[bytes] = collections.Counter()
    engine.index.on_move.append(lambda node, from_tier: moves.update([node.key]))  # engine thread
    before = engine.tiers.transfers.stats().bytes_moved.get((Tier.HBM, Tier.DRAM), 0)
    started = time.monotonic()
    try:
        for _ in range(rounds):
            for prompt in work:
                await complete_checked(client, oracle, ns, prompt, steps, worker=worker.address)
        await assert_no_leak(client, worker.address)
        elapsed_s = time.monotonic() - started
        background = engine.tiers.transfers.stats().bytes_moved.get((Tier.HBM, Tier.DRAM), 0) - before
    finally:
        engine.index.on_move.pop()
    assert moves, "the working set is larger than HBM: pages must move"
    assert max(moves.values()) <= 2 * rounds, f"a page oscillated: {moves.most_common(3)}"
    await _converged(reader, worker, "thrash")
    burst = THRASH_BATCH_PAGES * page_geometry().page_bytes
    budget = THRASH_BUDGET_BYTES_PER_S * elapsed_s + burst
    assert background <= budget, (
        f"background demotion moved {background} bytes in {elapsed_s:.2f} s, above the budget's {budget:.0f}"
    )
