"""Route by estimated TTFT end to end: a real controller (``route_by_ttft``) and Valkey, two
workers on loopback gRPC linked to it. While the holder of a prefix is idle Route picks it; once
its queue is long Route picks the other worker with a fetch plan, the client passes the plan to
Generate, and the worker fetches every full page from the holder before prefilling: the same
tokens, all full pages cached, nothing recomputed."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from kvtier.client import AsyncClient
from kvtier.domain.records import GenerateFinal, LookupRequest, PeerFetch, TokenChunk, TokenPrefix
from kvtier.engine import Engine, SamplingParams, SchedulerConfig
from kvtier.worker.peer_fetch import LocalTransport, PeerExporter, PeerOptions
from kvtier.worker.servicer import serve_worker

from hf_checkpoints import build_checkpoint
from live_controller import controller_at, linked
from polling import eventually

PAGE = 4
PROMPT = [random.Random(11).randrange(256) for _ in range(41)]  # 10 full pages + 1 token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", seed=0)


async def complete(client, namespace, prompt, worker=None, max_tokens=8):
    tokens, final = [], None
    async for event in client.generate(namespace, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                       worker=worker):
        if isinstance(event, TokenChunk):
            tokens.extend(event.token_ids)
        elif isinstance(event, GenerateFinal):
            final = event
    assert final is not None
    return tokens, final.usage


async def test_route_picks_the_holder_when_idle_and_a_peer_with_a_fetch_when_its_queue_is_long(
        checkpoint, flushed_redis_url, tmp_path):
    exporters: dict[str, PeerExporter] = {}
    holder = await serve_worker(
        Engine.from_pretrained(checkpoint, page_size=PAGE, num_pages=256,
                               scheduler_config=SchedulerConfig(max_num_seqs=1)),
        worker_id="holder", peers=PeerOptions(LocalTransport(exporters)))
    peer = await serve_worker(Engine.from_pretrained(checkpoint, page_size=PAGE, num_pages=256), worker_id="peer",
                              peers=PeerOptions(LocalTransport(exporters)))
    exporters["holder"] = holder.exporter
    namespace = holder.engine.namespace
    busy: list[asyncio.Task] = []
    try:
        async with controller_at(flushed_redis_url, tmp_path, route_by_ttft=True) as controller, \
                linked(controller, holder, peer), AsyncClient(controller.address, timeout_s=120) as client:
            expected, _ = await complete(client, namespace, PROMPT, worker=holder.address)

            async def holder_listed():
                result = await controller.router.lookup(LookupRequest(namespace, TokenPrefix(tuple(PROMPT))), None)
                return any(m.worker_id == "holder" and m.matched_tokens.total_tokens == 40 for m in result.matches)

            await eventually(holder_listed, timeout_s=30, what="the holder's pages in the directory")
            idle = await client.route(namespace, PROMPT)
            assert idle.workers[0].worker_id == "holder" and idle.workers[0].fetch is None

            # Six long generations on the holder, one running at a time: its queue grows.
            other = [random.Random(i).randrange(256) for i in range(9)]
            busy = [asyncio.create_task(complete(client, namespace, [*other, i], worker=holder.address,
                                                 max_tokens=400)) for i in range(6)]
            await eventually(lambda: (e := controller.registry.get("holder")) and e.queue_depth >= 3,
                             timeout_s=60, what="the holder's queue on its heartbeat")
            queued = await client.route(namespace, PROMPT)
            best = queued.workers[0]
            assert best.worker_id == "peer" and best.fetch == PeerFetch("holder", 10), queued
            assert best.estimated_ttft_ms < queued.workers[1].estimated_ttft_ms

            tokens, usage = await complete(client, namespace, PROMPT)  # routed: the plan travels along
            assert tokens == expected
            assert usage.cached_tokens == 40 and usage.recomputed_tokens == 0
            assert holder.exporter.num_exported_pages == 10
            result = await peer.loop.check_integrity()
            assert result.is_ok, result.problems
    finally:
        for task in busy:
            task.cancel()
        for task in busy:
            with contextlib.suppress(BaseException):
                await task
        await holder.stop(0)
        await peer.stop(0)
