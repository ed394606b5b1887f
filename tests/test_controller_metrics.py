"""A running controller's Prometheus endpoint, scraped over HTTP (issue #8 item 3): the
DESIGN §9 families the controller owns exist with units and descriptions, and move after a
Route and after Pause → prefetch → next turn; waste is counted both when a session ends
unused and when its prefetched pages leave HBM before it comes back. Real controller (gRPC
on loopback, real valkey), real worker (tiny checkpoint, ``serve_worker`` + ``WorkerLink``)."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
import pytest_asyncio

from kvtier.controller.orchestrator_params import OrchestratorParams
from kvtier.domain import errors
from kvtier.domain.records import TokenPrefix
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.tiers.manager import TierConfig
from kvtier.worker.servicer import serve_worker

from hf_checkpoints import build_checkpoint
from live_controller import orchestrated
from polling import eventually

in_module_loop = pytest.mark.asyncio(loop_scope="module")

PAGE_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)

# Prometheus names: real units (s, By) become suffixes, annotations ({page}) do not;
# counters are typed with their _total name, histograms export _bucket/_count/_sum.
FAMILIES = {
    "kvtier_controller_rpc_latency_seconds": "histogram",
    "kvtier_controller_directory_op_latency_seconds": "histogram",
    "kvtier_controller_mirror_lookups_total": "counter",
    "kvtier_controller_mirror_entries": "gauge",
    "kvtier_controller_workers": "gauge",
    "kvtier_controller_sessions": "gauge",
    "kvtier_controller_prefetches_total": "counter",
    "kvtier_controller_prefetch_bytes_total": "counter",
    "kvtier_controller_prefetch_wasted_total": "counter",
    "kvtier_controller_prefetch_wasted_bytes_total": "counter",
    "kvtier_controller_prefetch_lead_seconds": "histogram",
    "kvtier_controller_prediction_abs_error_seconds": "histogram",
    "kvtier_controller_pages_moved_total": "counter",
    "kvtier_controller_bytes_moved_bytes_total": "counter",
}



@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def worker(tmp_path_factory):
    ckpt = build_checkpoint(tmp_path_factory.mktemp("ctrl-metrics") / "llama", "llama", seed=4)
    engine = Engine.from_pretrained(ckpt, page_size=PAGE_SIZE, num_pages=256, tier_config=TierConfig(dram_pages=128))
    server = await serve_worker(engine, worker_id="w-cm")
    yield server
    await server.stop(0)


def cluster(worker, redis_url, tmp_path, **params):
    # The test waits until the directory shows a move before routing, so no settling time.
    params = OrchestratorParams(directory_lag_ms=0.0, **params)
    return orchestrated(worker, redis_url, tmp_path, params, metrics_port=0)


async def scrape(port: int) -> str:
    """An HTTP scrape from another thread, as Prometheus does (the endpoint reads controller
    state on the event loop, so this test's loop must keep running meanwhile)."""

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()

    return await asyncio.to_thread(get)


def value(text: str, family: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(family + "{") and not line.startswith(family + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def pages_in(client, namespace, tokens, tier: Tier) -> int:
    result = await client.lookup(namespace, TokenPrefix(tuple(tokens)))
    return sum(m.matched_tokens.for_tier(tier) for m in result.matches) // PAGE_SIZE


@in_module_loop
async def test_families_exist_with_units_and_move_after_route_and_prefetch(worker, flushed_redis_url, tmp_path):
    namespace = worker.engine.namespace
    page_bytes = worker.engine.pool.geometry.page_bytes
    async with cluster(worker, flushed_redis_url, tmp_path) as (controller, client):
        port = controller.metrics.port
        assert port and controller.config.metrics_port == 0
        before = await scrape(port)

        # A Route (inside complete) of a new session: RPC and directory latency, an ACTIVE session.
        prompt = [9, 18, 27, 36, 45, 54, 63, 72, 81, 90, 99]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-cm")
        history = prompt + out  # 17 tokens: 4 full pages cached
        routed = await scrape(port)
        assert value(routed, "kvtier_controller_rpc_latency_seconds_count", rpc="Route", code="OK") == 1
        assert value(routed, "kvtier_controller_directory_op_latency_seconds_count", op="lookup") >= 1
        assert value(routed, "kvtier_controller_workers", state="live") == 1
        assert value(routed, "kvtier_controller_sessions", state="active") == 1
        assert value(before, "kvtier_controller_sessions", state="active") == 0

        # Pause (a long predicted pause: parked in DRAM), then Returning prefetches at once.
        info = await client.pause("s-cm", tool="search", expected_ms=60_000)
        assert info.parked_tier is Tier.DRAM
        paused = await scrape(port)
        assert value(paused, "kvtier_controller_sessions", state="paused") == 1
        assert value(paused, "kvtier_controller_pages_moved_total", reason="park", src="hbm", dst="dram") == 4
        assert value(paused, "kvtier_controller_bytes_moved_bytes_total", reason="park") == 4 * page_bytes
        await client.returning("s-cm")

        async def back_in_directory() -> bool:  # the waste check reads the directory (lag 0 here)
            return await pages_in(client, namespace, history[:16], Tier.HBM) == 4

        await eventually(back_in_directory, what="the directory to see the prefetched pages in HBM")
        moved = await scrape(port)
        assert value(moved, "kvtier_controller_bytes_moved_bytes_total", reason="returning", src="dram",
                     dst="hbm") == 4 * page_bytes
        assert value(moved, "kvtier_controller_mirror_entries") >= 4  # the leader mirrors what it wrote

        # The next turn closes the pause: on time, its lead and prediction error recorded.
        _, final = await client.complete(namespace, history + [1, 2, 3], GREEDY, session_id="s-cm")
        assert final.usage.promoted_tokens == 0
        after = await scrape(port)
        assert value(after, "kvtier_controller_prefetches_total", outcome="on_time") == 1
        assert value(after, "kvtier_controller_prefetches_total", outcome="late") == 0
        assert value(after, "kvtier_controller_prefetch_bytes_total", outcome="on_time") == 4 * page_bytes
        assert value(after, "kvtier_controller_prefetch_lead_seconds_count") == 1
        assert value(after, "kvtier_controller_prediction_abs_error_seconds_count", source="caller_eta") == 1
        assert value(after, "kvtier_controller_prefetch_wasted_total") == 0
        # The first Route read Redis (the namespace's epoch was unknown); this one, the mirror.
        assert value(after, "kvtier_controller_mirror_lookups_total") >= 1 > value(routed, "kvtier_controller_mirror_lookups_total")
        assert value(after, "kvtier_controller_rpc_latency_seconds_count", rpc="Pause", code="OK") == 1

        # A bad call is timed under its status code.
        with pytest.raises(errors.NotFound):
            await client.returning("s-nobody")
        failed = await scrape(port)
        assert value(failed, "kvtier_controller_rpc_latency_seconds_count", rpc="Returning", code="NOT_FOUND") == 1

        for family, kind in FAMILIES.items():
            assert f"# TYPE {family} {kind}" in after, f"{family} ({kind}) missing from the scrape"
            assert re.search(rf"^# HELP {family} \S", after, re.M), f"{family} has no description"
        # Ids, tenants, tools and tokens never become labels.
        for secret in ("s-cm", "search", "tenant", "token_ids"):
            assert secret not in failed


@in_module_loop
async def test_wasted_prefetches_are_counted_when_ended_and_when_evicted(worker, flushed_redis_url, tmp_path):
    namespace = worker.engine.namespace
    page_bytes = worker.engine.pool.geometry.page_bytes
    # No hold on prefetched pages (max_hold_ms=0): the test demotes them again to see it counted.
    async with cluster(worker, flushed_redis_url, tmp_path, max_hold_ms=0.0) as (controller, client):
        port = controller.metrics.port

        # Ended unused: prefetched (Returning), then End (dropping the pages) instead of a next turn.
        prompt = [5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55]  # + 6 out, the last never fed: 4 pages
        await client.complete(namespace, prompt, GREEDY, session_id="s-ended")
        await client.pause("s-ended", tool="slow", expected_ms=60_000)
        await client.returning("s-ended")
        await client.end("s-ended", drop=True)
        ended = await scrape(port)
        assert value(ended, "kvtier_controller_prefetch_wasted_total", reason="ended") == 1
        assert value(ended, "kvtier_controller_prefetch_wasted_bytes_total", reason="ended") == 4 * page_bytes
        assert value(ended, "kvtier_controller_pages_moved_total", reason="end") >= 1

        # Evicted before use: prefetched, then the worker demotes the pages again (pressure).
        prompt = [201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-evicted")
        history = prompt + out
        await client.pause("s-evicted", tool="slow", expected_ms=60_000)
        await client.returning("s-evicted")
        await worker.loop.call(lambda: worker.engine.tiers.demote_all(Tier.DRAM))

        async def demoted_in_directory() -> bool:
            return await pages_in(client, namespace, history[:16], Tier.DRAM) == 4

        await eventually(demoted_in_directory, what="the directory to see the pages back in DRAM")
        _, final = await client.complete(namespace, history + [7, 8], GREEDY, session_id="s-evicted")
        assert final.usage.promoted_tokens == 16  # the user paid the promotion the prefetch had saved
        evicted = await scrape(port)
        assert value(evicted, "kvtier_controller_prefetches_total", outcome="on_time") == 1
        assert value(evicted, "kvtier_controller_prefetch_wasted_total", reason="evicted") == 1
        assert value(evicted, "kvtier_controller_prefetch_wasted_bytes_total", reason="evicted") == 4 * page_bytes
        stats = controller.orchestrator.stats
        assert stats.wasted_bytes == 8 * page_bytes and stats.prefetched_bytes == 8 * page_bytes
