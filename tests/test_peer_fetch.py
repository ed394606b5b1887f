"""Peer fetch between two workers in one process (kvtier/worker/peer_fetch.py, peer_pages.py):
a prefix computed on the holder, fetched by the receiver, gives the transformers oracle's
tokens with every full page a hit; a flipped byte in transit, a holder that is gone or hangs,
and a fetch for another namespace's pages all end in recompute (or a refusal) with nothing
partial in the receiver's index. The multi-node Ray version is tests/e2e/test_peer_cluster.py."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import grpc.aio
import pytest
import pytest_asyncio
import torch

from kvtier.domain.errors import PermissionDenied, Unauthenticated
from kvtier.domain.hashing import page_keys, root_key
from kvtier.domain.records import (
    CommandId,
    FetchCommand,
    GenerateFinal,
    GenerateRequest,
    PeerFetch,
    TokenChunk,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.rpc._gen import worker_pb2_grpc
from kvtier.rpc.auth import TokenTable, hash_token, make_entry
from kvtier.rpc.convert.worker import from_proto_generate_event, to_proto_generate_request
from kvtier.tiers.manager import TierConfig
from kvtier.worker import peer_fetch
from kvtier.worker.costs import PeerRates
from kvtier.worker.page_events import PageEvents
from kvtier.worker.peer_fetch import (
    ExportRequest,
    LocalTransport,
    PeerExporter,
    PeerFetcher,
    PeerOptions,
    fetch_command_ack,
    fetch_for_generate,
)
from kvtier.worker.peer_pages import RankRequest, export_pages, install_pages, rank_chains, verify_group
from kvtier.worker.servicer import serve_worker

from hf_checkpoints import build_checkpoint, load_hf
from polling import eventually

ASYNC = pytest.mark.asyncio(loop_scope="module")

PAGE = 4
PROMPT = [random.Random(7).randrange(256) for _ in range(41)]  # 10 full pages + 1 token
STEPS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", seed=0)


@pytest.fixture(scope="module")
def oracle(checkpoint):
    model = load_hf(checkpoint)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, len(PROMPT):].tolist()


@pytest_asyncio.fixture(loop_scope="module")
async def pair(checkpoint):
    exporters: dict[str, PeerExporter] = {}  # the receiver's Generate fetches from the holder's exporter
    servers = [await serve_worker(Engine.from_pretrained(checkpoint, page_size=PAGE, num_pages=64), worker_id=w,
                                  peers=PeerOptions(LocalTransport(exporters)))
               for w in ("holder", "receiver")]
    exporters["holder"] = servers[0].exporter
    yield servers
    for server in servers:
        await server.stop(0)


async def generate(server, prompt=PROMPT, tenant=""):
    namespace = dataclasses.replace(server.engine.namespace, tenant=tenant)
    request = GenerateRequest(namespace=namespace, prompt_token_ids=tuple(prompt),
                              sampling=SamplingParams(max_tokens=STEPS, ignore_eos=True))
    tokens: list[int] = []
    final = None
    async for event in server.loop.submit(request):
        if isinstance(event, TokenChunk):
            tokens.extend(event.token_ids)
        else:
            final = event
    assert isinstance(final, GenerateFinal)
    return tokens, final.usage


async def assert_clean(server):
    result = await server.loop.check_integrity()
    assert result.is_ok, result.problems


def fetcher(receiver, holder, transport=None):
    return PeerFetcher(receiver.loop, transport or LocalTransport({"holder": PeerExporter(holder.loop)}))


@ASYNC
async def test_fetched_prefix_is_a_hit_and_matches_the_oracle(pair, oracle):
    holder, receiver = pair
    assert (await generate(holder))[0] == oracle
    outcome = await fetcher(receiver, holder).fetch(receiver.engine.namespace, PROMPT, "holder", timeout_s=30)
    assert outcome.problem is None and outcome.num_installed == 10 and outcome.num_bytes > 0
    receiver.loop.drain_page_events()
    tokens, usage = await generate(receiver)
    assert tokens == oracle
    assert usage.cached_tokens >= 40 and usage.recomputed_tokens == 0
    await assert_clean(holder)
    await assert_clean(receiver)
    # A second fetch finds everything cached here already: nothing is asked of the peer.
    again = await fetcher(receiver, holder).fetch(receiver.engine.namespace, PROMPT, "holder", timeout_s=30)
    assert again.num_requested == 0
    # A plan naming the receiver itself asks nothing of anyone.
    itself = await receiver.servicer.peers.fetch(receiver.engine.namespace, PROMPT, "receiver", timeout_s=30)
    assert itself.num_requested == 0 and itself.problem == "the peer is this worker"


@ASYNC
async def test_install_publishes_page_events_for_the_directory(pair):
    holder, receiver = pair
    await generate(holder)
    receiver.loop.drain_page_events()
    await fetcher(receiver, holder).fetch(receiver.engine.namespace, PROMPT, "holder", timeout_s=30)
    events = receiver.loop.drain_page_events()
    digest = receiver.engine.digest_for(receiver.engine.namespace)
    keys = page_keys(digest, PROMPT, PAGE)[:10]
    assert [e.page_key for e in events] == keys
    assert {e.namespace_digest for e in events} == {digest}
    assert events[0].parent_key == root_key(digest)


@ASYNC
async def test_generate_with_a_fetch_plan_fetches_before_prefilling(pair, oracle):
    holder, receiver = pair
    await generate(holder)
    request = GenerateRequest(namespace=receiver.engine.namespace, prompt_token_ids=tuple(PROMPT),
                              sampling=SamplingParams(max_tokens=STEPS, ignore_eos=True),
                              peer_fetch=PeerFetch(WorkerId("holder")))
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(receiver.address) as channel:
        async for message in worker_pb2_grpc.WorkerStub(channel).Generate(to_proto_generate_request(request),
                                                                         timeout=60):
            event = from_proto_generate_event(message)
            if isinstance(event, TokenChunk):
                tokens.extend(event.token_ids)
            else:
                usage = event.usage
    assert tokens == oracle
    assert usage.cached_tokens == 40 and usage.recomputed_tokens == 0
    assert holder.exporter.num_exported_pages == 10
    assert receiver.loop.costs.fetch.bytes_per_s > 0, "the fetch was measured for the cost model"
    await assert_clean(receiver)


class FlipByte:
    """The network between the two: flips one byte of page ``page`` of every group it carries."""

    def __init__(self, inner, page):
        self.inner, self.page = inner, page

    async def pull(self, peer, request):
        group = await self.inner.pull(peer, request)
        data = group.data.copy()
        data[self.page, 123] ^= 0x40
        return dataclasses.replace(group, data=data)


@ASYNC
async def test_flipped_byte_is_caught_and_the_rest_recomputed(pair, oracle):
    holder, receiver = pair
    await generate(holder)
    transport = FlipByte(LocalTransport({"holder": PeerExporter(holder.loop)}), page=3)
    outcome = await fetcher(receiver, holder, transport).fetch(
        receiver.engine.namespace, PROMPT, "holder", timeout_s=30)
    assert outcome.num_installed == 3 and "checksum" in (outcome.problem or "")
    tokens, usage = await generate(receiver)
    assert tokens == oracle and usage.cached_tokens == 12  # the three good pages
    await assert_clean(receiver)


class Hangs:
    async def pull(self, peer, request):
        await asyncio.sleep(3600)


class Dies:
    """The holder goes away after the fetch started: its engine loop is closed under the call."""

    def __init__(self, holder):
        self.holder = holder

    async def pull(self, peer, request):
        await self.holder.stop(0)
        return await PeerExporter(self.holder.loop).export(request)


@ASYNC
async def test_holder_that_hangs_or_dies_means_recompute_within_the_deadline(pair, oracle):
    holder, receiver = pair
    await generate(holder)
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcome = await fetcher(receiver, holder, Hangs()).fetch(receiver.engine.namespace, PROMPT, "x", timeout_s=0.5)
    assert outcome.problem == "timed out" and outcome.num_installed == 0
    assert loop.time() - started < 5
    outcome = await fetcher(receiver, holder, Dies(holder)).fetch(receiver.engine.namespace, PROMPT, "x",
                                                                   timeout_s=30)
    assert outcome.num_installed == 0 and "Unavailable" in (outcome.problem or "")
    assert len(receiver.engine.index) == 0, "no page of a failed fetch is indexed"
    tokens, usage = await generate(receiver)
    assert tokens == oracle and usage.cached_tokens == 0
    await assert_clean(receiver)


@ASYNC
async def test_another_namespaces_pages_are_refused(pair):
    holder, receiver = pair
    await generate(holder, tenant="acme")
    acme = dataclasses.replace(holder.engine.namespace, tenant="acme")
    other = dataclasses.replace(holder.engine.namespace, tenant="globex")
    acme_keys = tuple(page_keys(holder.engine.digest_for(acme), PROMPT, PAGE))
    exporter = PeerExporter(holder.loop)
    with pytest.raises(PermissionDenied, match="namespace"):
        await exporter.export(ExportRequest(holder.engine.digest_for(other), acme_keys))
    # Through a fetcher the refusal is a recompute for the asking tenant.
    outcome = await fetcher(receiver, holder).fetch(other, PROMPT, "holder", timeout_s=30)
    assert outcome.num_installed == 0
    assert (await exporter.export(ExportRequest(holder.engine.digest_for(acme), acme_keys))).num_pages == 10


@ASYNC
async def test_only_a_worker_token_may_export(pair):
    holder, _ = pair
    await generate(holder)
    table = TokenTable([make_entry("w", "worker", [], hash_token("worker-secret"), worker_id="w1"),
                        make_entry("f", "frontend", ["acme"], hash_token("frontend-secret"))])
    exporter = PeerExporter(holder.loop, tokens=table)
    digest = holder.engine.digest_for(holder.engine.namespace)
    keys = tuple(page_keys(digest, PROMPT, PAGE))
    with pytest.raises(Unauthenticated):
        await exporter.export(ExportRequest(digest, keys))
    with pytest.raises(Unauthenticated):
        await exporter.export(ExportRequest(digest, keys, credential="wrong"))
    with pytest.raises(PermissionDenied, match="role frontend"):
        await exporter.export(ExportRequest(digest, keys, credential="frontend-secret"))
    assert (await exporter.export(ExportRequest(digest, keys, credential="worker-secret"))).num_pages == 10


def test_pages_install_into_dram_when_hbm_is_full_and_export_from_dram(checkpoint, tmp_path):
    """Engine-thread functions, called directly: HBM full → DRAM, then the DRAM copy exports with
    the checksum taken when it was installed, and a fresh receiver verifies it."""
    holder = Engine.from_pretrained(checkpoint, page_size=PAGE, num_pages=64)
    holder_events = PageEvents(holder.index)
    digest = holder.digest_for(None)
    holder_events.admitted(digest, holder.namespace)
    holder.generate([PROMPT], SamplingParams(max_tokens=1))
    keys = tuple(page_keys(digest, PROMPT, PAGE))
    group = export_pages(holder, holder_events, ExportRequest(digest, keys))
    assert group.num_pages == 10

    receiver = Engine.from_pretrained(checkpoint, page_size=PAGE, num_pages=16,
                                      tier_config=TierConfig(dram_pages=32))
    events = PageEvents(receiver.index)
    while receiver.pool.num_free > 4:  # leave room for four pages in HBM
        receiver.pool.allocate()
    verified = verify_group(group, keys, root_key(digest))
    assert verified.num_pages == 10 and verified.problem is None
    installed = install_pages(receiver, events, receiver.namespace, group, 10, root_key(digest))
    assert installed.num_pages == 10 and installed.tier is Tier.DRAM
    assert receiver.index.count_by_tier()[Tier.HBM] == 4 and receiver.index.count_by_tier()[Tier.DRAM] == 6
    again = export_pages(receiver, events, ExportRequest(digest, keys))
    assert verify_group(again, keys, root_key(digest)).num_pages == 10
    assert [int(c) for c in again.checksums[4:]] == [receiver.index.get(k).checksum for k in keys[4:]]


def test_rates_fit_setup_and_bandwidth():
    rates = PeerRates()
    rates.record(1_000_000, 0.011)  # 1 MB in 11 ms, 2 MB in 21 ms: 10 ms/MB after a 1 ms set-up
    assert rates.setup_ms == 0.0 and rates.bytes_per_s == pytest.approx(1_000_000 / 0.011)
    rates.record(2_000_000, 0.021)
    assert rates.bytes_per_s == pytest.approx(1e8) and rates.setup_ms == pytest.approx(1.0)


@ASYNC
async def test_an_emulated_peer_link_hands_the_group_over_no_sooner_than_bytes_over_rate(pair):
    holder, _ = pair
    await generate(holder)
    digest = holder.engine.digest_for(holder.engine.namespace)
    keys = tuple(page_keys(digest, PROMPT, PAGE))
    exporter = PeerExporter(holder.loop, link_bytes_per_s=holder.engine.geometry.page_bytes * 20)  # 20 pages/s
    started = asyncio.get_running_loop().time()
    group = await exporter.export(ExportRequest(digest, keys))
    assert group.num_pages == 10 and asyncio.get_running_loop().time() - started >= 0.45


def test_pages_on_nvme_export_with_their_checksum(checkpoint, tmp_path):
    holder = Engine.from_pretrained(checkpoint, page_size=PAGE, num_pages=64,
                                    tier_config=TierConfig(dram_pages=0, nvme_slots=32, nvme_dir=tmp_path / "nvme"))
    events = PageEvents(holder.index)
    digest = holder.digest_for(None)
    events.admitted(digest, holder.namespace)
    holder.generate([PROMPT], SamplingParams(max_tokens=1))
    assert holder.tiers is not None
    holder.tiers.demote_all(Tier.NVME)
    keys = tuple(page_keys(digest, PROMPT, PAGE))
    assert all(holder.index.get(k).tier is Tier.NVME for k in keys)
    group = export_pages(holder, events, ExportRequest(digest, keys))
    assert group.num_pages == 10
    assert verify_group(group, keys, root_key(digest)).problem is None
    holder.close()


@ASYNC
async def test_a_fetch_command_pulls_a_chain_of_a_namespace_the_receiver_never_served(pair, oracle):
    """No prompt and no identity at hand: the group carries the holder's identity fields, which
    derive the same digest on the receiver."""
    holder, receiver = pair
    assert (await generate(holder, tenant="acme"))[0] == oracle
    namespace = dataclasses.replace(holder.engine.namespace, tenant="acme")
    digest = holder.engine.digest_for(namespace)
    keys = tuple(page_keys(digest, PROMPT, PAGE)[:10])
    ack = await fetch_command_ack(fetcher(receiver, holder), CommandId(1), FetchCommand(WorkerId("holder"), digest, keys))
    assert ack.ok and ack.num_pages == 10, ack
    tokens, usage = await generate(receiver, tenant="acme")
    assert tokens == oracle
    assert usage.cached_tokens >= 40 and usage.recomputed_tokens == 0
    await assert_clean(receiver)

    gone = await fetch_command_ack(fetcher(receiver, holder), CommandId(2), FetchCommand(WorkerId("nobody"), digest, keys))
    assert gone.ok and gone.num_pages == 0  # everything is cached here already: nothing asked of anyone
    missing = tuple(page_keys(digest, [*PROMPT[:8], 999, 998, 997, 996], PAGE))
    failed = await fetch_command_ack(fetcher(receiver, holder), CommandId(3),
                                     FetchCommand(WorkerId("nobody"), digest, missing))
    assert failed.error_code == "UNAVAILABLE" and failed.num_pages == 0 and "nobody" in failed.error_message


@ASYNC
async def test_ranked_chains_hold_the_most_valuable_pages_with_their_ancestors(pair):
    holder, _ = pair
    hot, cold = PROMPT, [random.Random(8).randrange(256) for _ in range(41)]
    await generate(holder, cold)
    for _ in range(3):
        await generate(holder, hot)
    digest = holder.engine.digest_for(holder.engine.namespace)
    chains = await holder.loop.call(
        lambda: rank_chains(holder.engine, holder.loop.page_events, RankRequest(digest, max_pages=14)))
    chosen = {key for chain in chains for key in chain}
    assert len(chosen) <= 14
    assert set(page_keys(digest, hot, PAGE)[:10]) <= chosen
    assert not set(page_keys(digest, cold, PAGE)[:10]) <= chosen
    for chain in chains:  # root first, each page under the one before it
        assert holder.engine.index.get(chain[0]).parent is None
        for parent, child in zip(chain, chain[1:], strict=False):
            assert holder.engine.index.get(child).parent.key == parent


class Gated:
    """The network between the two: every group asked for after the first ``num_free`` waits
    for ``gate``; ``asked`` is the size of each group asked for."""

    def __init__(self, inner, num_free=0):
        self.inner, self.num_free, self.gate, self.asked = inner, num_free, asyncio.Event(), []

    async def pull(self, peer, request):
        self.asked.append(len(request.keys))
        if len(self.asked) > self.num_free:
            await self.gate.wait()
        return await self.inner.pull(peer, request)


@ASYNC
async def test_a_request_waits_outside_the_engine_while_its_pages_arrive_group_by_group(pair, oracle, monkeypatch):
    holder, receiver = pair
    await generate(holder)
    monkeypatch.setattr(peer_fetch, "FETCH_GROUP_PAGES", 4)  # the 10 pages in groups of 4, 4 and 2
    transport = Gated(LocalTransport({"holder": holder.exporter}), num_free=1)
    request = GenerateRequest(namespace=receiver.engine.namespace, prompt_token_ids=tuple(PROMPT),
                              sampling=SamplingParams(max_tokens=STEPS, ignore_eos=True),
                              peer_fetch=PeerFetch(WorkerId("holder")))

    async def run():
        fetch = fetch_for_generate(PeerFetcher(receiver.loop, transport), request, None)
        return [e async for e in receiver.loop.submit(request, fetch=fetch)]

    task = asyncio.create_task(run())
    keys = page_keys(receiver.engine.digest_for(receiver.engine.namespace), PROMPT, PAGE)[:10]
    num_cached = lambda: receiver.loop.call(lambda: len(receiver.engine.cached_chain(keys)))  # noqa: E731

    async def first_group_in():
        return await num_cached() == 4

    await eventually(first_group_in, timeout_s=30, what="the first group installed while the second is held back")
    assert await receiver.loop.call(lambda: len(receiver.loop.admission.runs())) == 1, "it waits outside"
    # Meanwhile the engine serves other requests to their end.
    other = [random.Random(9).randrange(256) for _ in range(23)]
    assert (await generate(receiver, other))[1].generated_tokens == STEPS
    assert not task.done() and await num_cached() == 4
    transport.gate.set()
    events = await task
    tokens = [t for e in events if isinstance(e, TokenChunk) for t in e.token_ids]
    assert tokens == oracle
    assert events[-1].usage.cached_tokens == 40 and events[-1].usage.recomputed_tokens == 0
    assert transport.asked == [4, 4, 2]
    await assert_clean(receiver)


@ASYNC
async def test_concurrent_fetches_of_one_prefix_ask_the_peer_once(pair, oracle):
    holder, receiver = pair
    await generate(holder)
    transport = Gated(LocalTransport({"holder": holder.exporter}))
    fetcher_ = PeerFetcher(receiver.loop, transport)
    fetches = [asyncio.create_task(fetcher_.fetch(receiver.engine.namespace, PROMPT, "holder", timeout_s=30))
               for _ in range(3)]

    await eventually(lambda: transport.asked, timeout_s=30, what="the first fetch asks the holder")
    transport.gate.set()
    outcomes = await asyncio.gather(*fetches)
    assert sorted(o.num_installed for o in outcomes) == [0, 0, 10]
    assert all(o.problem is None for o in outcomes)
    assert transport.asked == [10] and holder.exporter.num_exported_pages == 10
    tokens, usage = await generate(receiver)
    assert tokens == oracle and usage.cached_tokens == 40
    await assert_clean(receiver)
