"""Pages move between workers on the controller's command: a drained worker's pinned prefix
moves to a peer (still a hit there, still pinned), so do its most valuable other pages within
the drain's byte budget, and a pin with ``replicas=2`` gets a new
copy from a survivor when one of its two holders is lost. A real controller and Valkey,
in-process workers on loopback gRPC, linked to it; pages travel through each worker's exporter
(``LocalTransport``), the path a Ray deployment takes through the object store."""

from __future__ import annotations

import random

import pytest

from kvtier.client import AsyncClient
from kvtier.domain.records import GenerateFinal, TokenChunk, TokenPrefix
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.worker.peer_fetch import LocalTransport, PeerExporter, PeerOptions
from kvtier.worker.servicer import serve_worker

from hf_checkpoints import build_checkpoint
from live_controller import controller_at, linked
from polling import eventually

PAGE = 4
PROMPT = [random.Random(7).randrange(256) for _ in range(41)]  # 10 full pages + 1 token
PREFIX = TokenPrefix(tuple(PROMPT[:40]))
FAST = {"replica_check_interval_s": 0.2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", seed=0)


async def start_workers(checkpoint, *names):
    exporters: dict[str, PeerExporter] = {}
    servers = []
    for name in names:
        server = await serve_worker(Engine.from_pretrained(checkpoint, page_size=PAGE, num_pages=128),
                                    worker_id=name, peers=PeerOptions(LocalTransport(exporters)))
        exporters[name] = server.exporter
        servers.append(server)
    return servers


async def complete(client, namespace, worker, prompt=PROMPT):
    tokens, final = [], None
    async for event in client.generate(namespace, prompt, SamplingParams(max_tokens=6, ignore_eos=True),
                                       worker=worker.address):
        if isinstance(event, TokenChunk):
            tokens.extend(event.token_ids)
        elif isinstance(event, GenerateFinal):
            final = event
    assert final is not None
    return tokens, final.usage


async def holders(client, namespace):
    """Workers the directory lists with all 40 prefix tokens."""
    result = await client.lookup(namespace, PREFIX)
    return {m.worker_id for m in result.matches if m.matched_tokens.total_tokens == 40}


def pinned_pages(controller, worker):
    entry = controller.registry.get(worker)
    return sum(occ.pinned_pages for occ in entry.tiers) if entry is not None else 0


async def test_a_drained_workers_pinned_prefix_moves_to_a_peer_and_stays_a_pinned_hit(
        checkpoint, flushed_redis_url, tmp_path):
    holder, peer = await start_workers(checkpoint, "holder", "peer")
    namespace = holder.engine.namespace
    try:
        async with controller_at(flushed_redis_url, tmp_path, **FAST) as controller, \
                linked(controller, holder, peer), AsyncClient(controller.address, timeout_s=120) as client:
            expected, _ = await complete(client, namespace, holder)
            await eventually(lambda: holders(client, namespace), timeout_s=30, what="the holder listed")
            pin = await client.pin(namespace, PREFIX, Tier.HBM)
            assert pin.num_pinned_pages == 10

            await client.drain("holder")
            # The peer pulled the pages, pinned them, and the holder dropped its own.
            await eventually(lambda: _only(client, namespace, "peer"), timeout_s=60, what="the prefix only on the peer")
            await eventually(lambda: pinned_pages(controller, "peer") >= 10 and pinned_pages(controller, "holder") == 0,
                             timeout_s=30, what="the pin moved with the pages")
            assert holder.exporter.num_exported_pages >= 10  # the pin's, then the rest by value

            tokens, usage = await complete(client, namespace, peer)
            assert tokens == expected
            assert usage.cached_tokens == 40 and usage.recomputed_tokens == 0
            for server in (holder, peer):
                result = await server.loop.check_integrity()
                assert result.is_ok, result.problems
    finally:
        await holder.stop(0)
        await peer.stop(0)


async def _only(client, namespace, worker):
    return await holders(client, namespace) == {worker}


async def test_a_pin_with_two_replicas_is_copied_again_when_a_holder_is_lost(checkpoint, flushed_redis_url, tmp_path):
    first, second, third = servers = await start_workers(checkpoint, "w-a", "w-b", "w-c")
    namespace = first.engine.namespace
    try:
        async with controller_at(flushed_redis_url, tmp_path, **FAST) as controller, \
                linked(controller, *servers) as links, AsyncClient(controller.address, timeout_s=120) as client:
            expected, _ = await complete(client, namespace, first)
            await eventually(lambda: holders(client, namespace), timeout_s=30, what="the first holder listed")
            await client.pin(namespace, PREFIX, Tier.HBM, replicas=2)
            two = await eventually(lambda: _count(client, namespace, 2), timeout_s=60, what="a second copy")
            assert "w-a" in two

            # Lose the copy that is not w-a: its link and its server stop; its lease expires.
            lost = next(w for w in two if w != "w-a")
            index = ["w-a", "w-b", "w-c"].index(lost)
            await links[index].stop()
            await servers[index].stop(0)
            survivor = next(s for s in servers if s.worker_id not in two)
            now = await eventually(lambda: _count(client, namespace, 2, without=lost), timeout_s=60,
                                   what="a new copy from the survivor")
            assert now == {"w-a", survivor.worker_id}
            await eventually(lambda: pinned_pages(controller, survivor.worker_id) >= 10, timeout_s=30,
                             what="the new copy pinned")

            tokens, usage = await complete(client, namespace, survivor)
            assert tokens == expected
            assert usage.cached_tokens == 40 and usage.recomputed_tokens == 0
            result = await survivor.loop.check_integrity()
            assert result.is_ok, result.problems
    finally:
        for server in servers:
            await server.stop(0)


async def _count(client, namespace, n, without=None):
    found = await holders(client, namespace)
    return found if len(found) == n and without not in found else None


async def test_a_drain_moves_the_most_valuable_pages_within_its_budget(checkpoint, flushed_redis_url, tmp_path):
    holder, peer = await start_workers(checkpoint, "holder", "peer")
    namespace = holder.engine.namespace
    hot = [random.Random(1).randrange(256) for _ in range(41)]
    cold = [random.Random(2).randrange(256) for _ in range(41)]
    budget = 12 * holder.engine.geometry.page_bytes  # the hot prompt's pages, not both prompts'
    try:
        async with controller_at(flushed_redis_url, tmp_path, drain_migrate_bytes=budget, **FAST) as controller, \
                linked(controller, holder, peer), AsyncClient(controller.address, timeout_s=120) as client:
            await complete(client, namespace, holder, cold)
            for _ in range(3):  # hits make its pages worth more
                expected, _ = await complete(client, namespace, holder, hot)

            async def held(prompt, worker):
                result = await client.lookup(namespace, TokenPrefix(tuple(prompt[:40])))
                return max((m.matched_tokens.total_tokens for m in result.matches if m.worker_id == worker), default=0)

            await eventually(lambda: _both(held, hot, cold), timeout_s=30, what="both prompts on the holder")
            await client.drain("holder")
            await eventually(lambda: _held_is(held, hot, "peer", 40), timeout_s=60, what="the hot prompt on the peer")
            await eventually(lambda: _held_is(held, hot, "holder", 0), timeout_s=60, what="the holder emptied")
            assert await held(cold, "peer") < 40

            tokens, usage = await complete(client, namespace, peer, hot)
            assert tokens == expected
            assert usage.cached_tokens == 40 and usage.recomputed_tokens == 0
            result = await peer.loop.check_integrity()
            assert result.is_ok, result.problems
    finally:
        await holder.stop(0)
        await peer.stop(0)


async def _both(held, hot, cold):
    return await held(hot, "holder") == 40 and await held(cold, "holder") == 40


async def _held_is(held, prompt, worker, num_tokens):
    return await held(prompt, worker) == num_tokens
