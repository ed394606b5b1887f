"""Admin.Invalidate, Pin / Unpin and Evict end to end: a real controller (real valkey-server,
gRPC on loopback) and two real workers (tiny model, ``serve_worker`` + ``WorkerLink``) in this
process, driven through the frontend client.

The workers run in-process rather than as Ray actors so the tests can pick what a stack
cannot: a small-HBM worker with a DRAM tier and LRU eviction (pressure evicts in a known
order), and a look at a worker's own epoch table and index after the fact.

    w-big    256 HBM pages, no lower tier      invalidation
    w-small   24 HBM pages + 256 DRAM pages    pins under pressure, evict / demote
"""

from __future__ import annotations

import contextlib
import dataclasses
import random

import grpc
import grpc.aio
import pytest
import pytest_asyncio
import redis

from kvtier.client import AsyncClient
from kvtier.controller.cache_admin import resolve_scope
from kvtier.controller.server import serve_controller
from kvtier.domain import errors
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, page_keys
from kvtier.domain.records import InvalidationScope, TokenChunk
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc._gen import admin_pb2, admin_pb2_grpc, common_pb2
from kvtier.rpc.auth import Principal, Role
from kvtier.runtime.config import ControllerConfig
from kvtier.tiers.manager import TierConfig
from kvtier.worker.link import WorkerLink
from kvtier.worker.servicer import serve_worker

from polling import eventually, wait_for

in_module_loop = pytest.mark.asyncio(loop_scope="module")

PAGE = 4
SMALL_HBM_PAGES = 24
_rng = random.Random(8)


def fresh_tokens(n: int) -> list[int]:
    """Random token ids: two prompts of this module share a first page with odds of 1 in 512**4."""
    return [_rng.randrange(1, 512) for _ in range(n)]




def start_link(controller, server) -> WorkerLink:
    link = WorkerLink(server.loop, controller_address=controller.address, worker_id=server.worker_id,
                      address=server.address, boot_id=server.boot_id, heartbeat_interval_s=0.1,
                      batch_interval_s=0.02, max_backoff_s=0.2)
    link.start()
    return link


@dataclasses.dataclass
class Stack:
    controller: object
    client: AsyncClient
    big: object
    small: object
    links: dict[str, WorkerLink]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(checkpoint, redis_url, tmp_path_factory):
    with contextlib.closing(redis.Redis.from_url(redis_url)) as r:
        r.flushdb()
    big = await serve_worker(Engine.from_pretrained(checkpoint, page_size=PAGE, num_pages=256), worker_id="w-big")
    small = await serve_worker(
        Engine.from_pretrained(checkpoint, page_size=PAGE, num_pages=SMALL_HBM_PAGES, eviction_policy="lru",
                               tier_config=TierConfig(dram_pages=256)),
        worker_id="w-small",
    )
    config = ControllerConfig(port=0, state_dir=tmp_path_factory.mktemp("controller"), lease_ttl_s=1.0,
                              heartbeat_interval_s=0.5)
    controller = await serve_controller(config, redis_url=redis_url)
    links = {s.worker_id: start_link(controller, s) for s in (big, small)}
    client = AsyncClient(controller.address)
    try:
        await wait_for(lambda: controller.links.counters["snapshots.applied"] >= 2, what="both workers")
        yield Stack(controller, client, big, small, links)
    finally:
        await client.close()
        for link in links.values():
            await link.stop()
        await controller.stop(0)
        for server in (big, small):
            await server.stop(0)


def tenant_ns(stack: Stack, tenant: str):
    return dataclasses.replace(stack.big.engine.namespace, tenant=tenant)


async def complete(stack: Stack, ns, prompt, worker, n=4):
    return await stack.client.complete(ns, prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                                       worker=worker.address)


async def held(stack: Stack, ns, prefix) -> dict[str, tuple[int, int, int]]:
    """The directory's view (Admin.Lookup): worker -> (hbm, dram, nvme) tokens of ``prefix``."""
    result = await stack.client.lookup(ns, prefix)
    return {m.worker_id: (t.hbm_tokens, t.dram_tokens, t.nvme_tokens)
            for m in result.matches for t in [m.matched_tokens]}


async def pinned_pages(server) -> int:
    (hbm,) = [t for t in (await server.loop.stats()).tiers if t.tier is Tier.HBM]
    return hbm.pinned_pages


async def assert_intact(*servers) -> None:
    for server in servers:
        result = await server.loop.check_integrity()
        assert result.is_ok, [r.problem for r in result.reports if r.problem]


# --------------------------------------------------------------------------- invalidate


@in_module_loop
async def test_invalidating_a_tenant_makes_its_cached_prefix_miss_and_spares_other_tenants(stack):
    ns_a, ns_b = tenant_ns(stack, "inv-a"), tenant_ns(stack, "inv-b")
    prompt = fresh_tokens(6 * PAGE + 2)
    out1, _ = await complete(stack, ns_a, prompt, stack.big)
    _, again = await complete(stack, ns_a, prompt, stack.big)
    assert again.usage.cached_tokens == 6 * PAGE
    await complete(stack, ns_b, prompt, stack.big)
    old = stack.controller.router.epochs.apply(ns_a)
    old_digest = namespace_digest(old)
    old_keys = page_keys(old_digest, prompt + out1[:-1], PAGE)
    await eventually(lambda: _holds(stack, ns_a, prompt, "w-big", 6 * PAGE), what="the pages in the directory")

    result = await stack.client.invalidate(InvalidationScope(tenant="inv-a"), reason="test")
    assert result.policy_epoch > old.policy_epoch and result.num_workers_notified == 2
    # Route's view moves at once: the new digest has nothing yet.
    lookup = await stack.client.lookup(ns_a, prompt)
    assert lookup.matches == () and lookup.namespace_digest != old_digest
    # The worker dropped the old pages; their DROP events emptied the old namespace's entries.
    directory = stack.controller.directory
    await eventually(lambda: _no_match(directory, old_digest, old_keys), what="old entries to leave the directory")
    await directory.check_integrity(old_digest)
    await assert_intact(stack.big, stack.small)
    assert not set(old_keys) & {n.key for n in stack.big.engine.index.nodes()}

    out2, missed = await complete(stack, ns_a, prompt, stack.big)
    assert missed.usage.cached_tokens == 0 and out2 == out1
    _, other = await complete(stack, ns_b, prompt, stack.big)
    assert other.usage.cached_tokens == 6 * PAGE  # another tenant's cache is untouched
    # Worker and router derive the same new digest: the regenerated pages are routable.
    await eventually(lambda: _holds(stack, ns_a, prompt, "w-big", 6 * PAGE), what="the new pages")

    # An exact namespace: a newer epoch, a miss again, the other tenant still untouched.
    exact = await stack.client.invalidate(InvalidationScope(namespace=ns_a))
    assert exact.policy_epoch > result.policy_epoch
    out3, missed = await complete(stack, ns_a, prompt, stack.big)
    assert missed.usage.cached_tokens == 0 and out3 == out1
    _, other = await complete(stack, ns_b, prompt, stack.big)
    assert other.usage.cached_tokens == 6 * PAGE
    await assert_intact(stack.big)


@in_module_loop
async def test_pages_of_a_running_generation_are_reclaimed_when_it_finishes(stack):
    ns = tenant_ns(stack, "inv-running")
    prompt = fresh_tokens(5 * PAGE)
    old_digest = namespace_digest(stack.controller.router.epochs.apply(ns))
    await complete(stack, ns, prompt, stack.big, n=1)
    output: list[int] = []
    num_after = 0
    async with contextlib.aclosing(stack.client.generate(
            ns, prompt, SamplingParams(max_tokens=300, ignore_eos=True), worker=stack.big.address)) as events:
        async for event in events:
            if isinstance(event, TokenChunk):
                output.extend(event.token_ids)
                if len(output) == 1:  # running: it holds the cached prompt pages
                    await stack.client.invalidate(InvalidationScope(tenant="inv-running"))
                else:
                    num_after += 1
    assert num_after > 0, "the generation ended before the invalidation reached it"
    old_keys = page_keys(old_digest, prompt + output[:-1], PAGE)
    assert len(old_keys) > 5
    # What the sequence held, and what it cached on finishing, goes in the background.
    await eventually(lambda: _no_match(stack.controller.directory, old_digest, old_keys),
                     what="the finished sequence's pages to be reclaimed")
    await wait_for(lambda: not set(old_keys) & {n.key for n in stack.big.engine.index.nodes()},
                   what="the worker to drop them")
    await assert_intact(stack.big)


@in_module_loop
async def test_a_worker_that_connects_later_derives_current_digests(stack, checkpoint):
    ns = tenant_ns(stack, "inv-late")
    result = await stack.client.invalidate(InvalidationScope(tenant="inv-late"))
    late = await serve_worker(Engine.from_pretrained(checkpoint, page_size=PAGE, num_pages=64), worker_id="w-late")
    link = start_link(stack.controller, late)
    try:
        await wait_for(lambda: late.loop.epochs.effective_epoch(ns) == result.policy_epoch,
                       what="the epoch table to reach the new worker")
        assert late.loop.epochs.max_epoch == stack.controller.router.epochs.max_epoch
        prompt = fresh_tokens(3 * PAGE + 1)
        await complete(stack, ns, prompt, late, n=1)
        await eventually(lambda: _holds(stack, ns, prompt, "w-late", 3 * PAGE), what="its pages to be routable")
    finally:
        await link.stop()
        await late.stop(0)


# --------------------------------------------------------------------------- pin


async def pressure(stack: Stack, ns, num_prompts=4) -> None:
    """Push more distinct pages through w-small's HBM than it holds."""
    for _ in range(num_prompts):
        await complete(stack, ns, fresh_tokens(10 * PAGE), stack.small, n=2)


@in_module_loop
async def test_a_pin_keeps_a_prefix_in_hbm_under_pressure_until_unpinned(stack):
    ns = tenant_ns(stack, "pin")
    prefix = fresh_tokens(4 * PAGE)
    prompt = prefix + fresh_tokens(2)
    await complete(stack, ns, prompt, stack.small, n=1)
    await eventually(lambda: _holds(stack, ns, prefix, "w-small", 4 * PAGE), what="the prefix")
    baseline = await pinned_pages(stack.small)

    pin = await stack.client.pin(ns, prefix, Tier.HBM)
    assert pin.num_pinned_pages == 4 and pin.expires_at_ms is None  # w-big holds none of it
    assert await pinned_pages(stack.small) == baseline + 4
    await pressure(stack, ns)
    await eventually(lambda: _tiers(stack, ns, prefix, "w-small", (4 * PAGE, 0, 0)), what="the prefix in HBM")
    _, hit = await complete(stack, ns, prompt, stack.small, n=1)
    assert hit.usage.cached_tokens_by_tier.hbm_tokens == 4 * PAGE

    # The link drops and comes back: the pin is sent again and changes nothing (pinned once).
    link = stack.links["w-small"]
    await link.stop()
    await wait_for(lambda: "w-small" not in stack.controller.links.sessions, what="the disconnect")
    stack.links["w-small"] = link = start_link(stack.controller, stack.small)
    await wait_for(lambda: link.is_connected, what="the reconnect")
    await eventually(lambda: _holds(stack, ns, prefix, "w-small", 4 * PAGE), what="the reconnect snapshot")
    assert await pinned_pages(stack.small) == baseline + 4

    released = await stack.client.unpin(pin.pin_id)
    assert released.num_unpinned_pages == 4
    assert await pinned_pages(stack.small) == baseline
    await pressure(stack, ns)
    await eventually(lambda: _left_hbm(stack, ns, prefix, "w-small"), what="the prefix to leave HBM")
    _, hit = await complete(stack, ns, prompt, stack.small, n=1)
    assert hit.usage.cached_tokens == 4 * PAGE and hit.usage.cached_tokens_by_tier.dram_tokens > 0
    await assert_intact(stack.small)

    with pytest.raises(errors.NotFound) as excinfo:
        await stack.client.unpin(pin.pin_id)
    assert excinfo.value.field == "pin_id" and pin.pin_id in str(excinfo.value)


@in_module_loop
async def test_a_pin_with_a_ttl_lapses_on_its_own(stack):
    ns = tenant_ns(stack, "pin-ttl")
    prefix = fresh_tokens(3 * PAGE)
    await complete(stack, ns, prefix + fresh_tokens(1), stack.small, n=1)
    baseline = await pinned_pages(stack.small)
    pin = await stack.client.pin(ns, prefix, Tier.DRAM, ttl_s=1)
    assert pin.num_pinned_pages == 3 and pin.expires_at_ms is not None
    assert await pinned_pages(stack.small) == baseline + 3
    await eventually(lambda: _pinned_is(stack.small, baseline), what="the pin to lapse")
    with pytest.raises(errors.NotFound):  # gone from the controller too
        await stack.client.unpin(pin.pin_id)
    await assert_intact(stack.small)


@in_module_loop
async def test_invalidation_releases_the_pins_of_stale_namespaces(stack):
    ns = tenant_ns(stack, "pin-inv")
    prefix = fresh_tokens(2 * PAGE)
    await complete(stack, ns, prefix + fresh_tokens(1), stack.small, n=1)
    baseline = await pinned_pages(stack.small)
    old_keys = page_keys(namespace_digest(stack.controller.router.epochs.apply(ns)), prefix, PAGE)
    pin = await stack.client.pin(ns, prefix, Tier.HBM)
    assert pin.num_pinned_pages == 2
    assert await pinned_pages(stack.small) == baseline + 2
    await stack.client.invalidate(InvalidationScope(tenant="pin-inv"))
    # The worker released the pin before acknowledging (a stale page is worth nothing) and
    # dropped the pages; the controller forgot the pin.
    assert await pinned_pages(stack.small) == baseline
    assert not set(old_keys) & {n.key for n in stack.small.engine.index.nodes()}
    with pytest.raises(errors.NotFound):
        await stack.client.unpin(pin.pin_id)
    await assert_intact(stack.small)


# --------------------------------------------------------------------------- evict


@in_module_loop
async def test_evict_drops_or_demotes_a_prefix_and_keeps_pinned_pages(stack):
    ns = tenant_ns(stack, "evict")
    prefix = fresh_tokens(4 * PAGE)
    prompt = prefix + fresh_tokens(2)
    await complete(stack, ns, prompt, stack.small, n=1)
    await eventually(lambda: _tiers(stack, ns, prefix, "w-small", (4 * PAGE, 0, 0)), what="the prefix")

    dropped = await stack.client.evict(ns, prefix)
    assert dropped.num_pages == 4 and dropped.num_workers == 2
    await eventually(lambda: _nothing_held(stack, ns, prefix), what="the drop to reach the directory")
    _, missed = await complete(stack, ns, prompt, stack.small, n=1)
    assert missed.usage.cached_tokens == 0

    await eventually(lambda: _tiers(stack, ns, prefix, "w-small", (4 * PAGE, 0, 0)), what="the prefix again")
    demoted = await stack.client.evict(ns, prefix, worker_id="w-small", demote_to=Tier.DRAM)
    assert demoted.num_pages == 4 and demoted.num_workers == 1
    await eventually(lambda: _tiers(stack, ns, prefix, "w-small", (0, 4 * PAGE, 0)), what="the prefix in DRAM")
    _, promoted = await complete(stack, ns, prompt, stack.small, n=1)
    assert promoted.usage.cached_tokens_by_tier.dram_tokens == 4 * PAGE  # a hit, copied back up

    # Pinned pages stay, whatever the eviction asks.
    pin = await stack.client.pin(ns, prefix, Tier.HBM)
    assert pin.num_pinned_pages == 4
    kept = await stack.client.evict(ns, prefix)
    assert kept.num_pages == 0
    await eventually(lambda: _tiers(stack, ns, prefix, "w-small", (4 * PAGE, 0, 0)), what="the pinned prefix")
    assert len(stack.small.engine.index.match(page_keys(namespace_digest(
        stack.controller.router.epochs.apply(ns)), prefix, PAGE), count_hit=False).nodes) == 4
    await stack.client.unpin(pin.pin_id)

    # The whole namespace, with no prefix: everything the worker holds of it goes.
    other = fresh_tokens(3 * PAGE)
    await complete(stack, ns, other, stack.small, n=1)
    await eventually(lambda: _holds(stack, ns, other, "w-small", 3 * PAGE), what="a second prefix")
    everything = await stack.client.evict(ns)
    assert everything.num_pages >= 7
    await eventually(lambda: _nothing_held(stack, ns, prefix), what="the namespace to empty")
    assert not await held(stack, ns, other)
    digest = namespace_digest(stack.controller.router.epochs.apply(ns))
    assert not any(stack.small.loop.page_events.digests.get(n.key) == digest for n in stack.small.engine.index.nodes())
    await assert_intact(stack.small)


# --------------------------------------------------------------------------- bad input


def _ns_msg(stack: Stack, **fields) -> common_pb2.NamespaceIdentity:
    ns = stack.big.engine.namespace
    values = {"model_id": ns.model_id, "weights_digest": ns.weights_digest, "kv_dtype": ns.kv_dtype,
              "page_size": ns.page_size, **fields}
    return common_pb2.NamespaceIdentity(**values)


@in_module_loop
async def test_bad_requests_are_refused_naming_the_field(stack):
    tokens = common_pb2.TokenIds(ids=fresh_tokens(2 * PAGE))
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        ("Invalidate", admin_pb2.InvalidateRequest(), invalid, "scope"),
        ("Invalidate", admin_pb2.InvalidateRequest(scope=common_pb2.InvalidationScope(all_namespaces=False)),
         invalid, "scope"),
        ("Invalidate", admin_pb2.InvalidateRequest(scope=common_pb2.InvalidationScope(tenant="")), invalid,
         "scope.tenant"),
        ("Pin", admin_pb2.PinRequest(token_ids=tokens, tier=common_pb2.TIER_HBM), invalid, "namespace"),
        ("Pin", admin_pb2.PinRequest(namespace=_ns_msg(stack), token_ids=tokens), invalid, "tier"),
        ("Pin", admin_pb2.PinRequest(namespace=_ns_msg(stack), token_ids=tokens, tier=7), invalid, "tier"),
        ("Pin", admin_pb2.PinRequest(namespace=_ns_msg(stack), token_ids=tokens, tier=common_pb2.TIER_HBM,
                                     ttl_s=0), invalid, "ttl_s"),
        ("Pin", admin_pb2.PinRequest(namespace=_ns_msg(stack), tier=common_pb2.TIER_HBM,
                                     token_ids=common_pb2.TokenIds(ids=[1, 2])), invalid, "token_ids"),
        ("Pin", admin_pb2.PinRequest(namespace=_ns_msg(stack), tier=common_pb2.TIER_HBM), invalid, "prefix"),
        ("Unpin", admin_pb2.UnpinRequest(), invalid, "pin_id"),
        ("Unpin", admin_pb2.UnpinRequest(pin_id="pin-nope"), grpc.StatusCode.NOT_FOUND, "pin_id"),
        ("Evict", admin_pb2.EvictRequest(namespace=_ns_msg(stack), demote_to_tier=common_pb2.TIER_HBM), invalid,
         "demote_to_tier"),
        ("Evict", admin_pb2.EvictRequest(namespace=_ns_msg(stack), worker_id="w-nobody"),
         grpc.StatusCode.NOT_FOUND, "worker_id"),
        ("Evict", admin_pb2.EvictRequest(namespace=_ns_msg(stack, kv_dtype="int3")), invalid,
         "namespace.kv_dtype"),
    ]
    async with grpc.aio.insecure_channel(stack.controller.address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        for rpc, request, code, field in cases:
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await getattr(stub, rpc)(request, timeout=10)
            assert excinfo.value.code() is code, (rpc, field, excinfo.value.details())
            assert field in excinfo.value.details(), (rpc, field, excinfo.value.details())
    # Nothing above changed an epoch or left a pin behind.
    assert await stack.controller.cache_admin.store.pins() == []


def test_a_tenant_bound_caller_may_invalidate_its_own_tenant_only() -> None:
    acme = Principal("fe-acme", Role.FRONTEND, frozenset({"acme"}))
    ns = NamespaceIdentity(model_id="m", page_size=PAGE)
    assert resolve_scope(InvalidationScope(tenant="acme"), acme) == InvalidationScope(tenant="acme")
    bound = resolve_scope(InvalidationScope(namespace=ns), acme)  # no tenant named: the caller's
    assert bound.namespace == dataclasses.replace(ns, tenant="acme")
    refusals = [
        (InvalidationScope(tenant="globex"), "scope.tenant"),
        (InvalidationScope(namespace=dataclasses.replace(ns, tenant="globex")), "scope.namespace.tenant"),
        (InvalidationScope(model_id="m"), "scope"),
        (InvalidationScope(all_namespaces=True), "scope"),
    ]
    for scope, field in refusals:
        with pytest.raises(errors.PermissionDenied) as excinfo:
            resolve_scope(scope, acme)
        assert excinfo.value.field == field and field in str(excinfo.value)
    admin = Principal("ops", Role.ADMIN)
    for scope, _ in refusals:
        assert resolve_scope(scope, admin) == scope


# --------------------------------------------------------------------------- helpers


async def _holds(stack: Stack, ns, prefix, worker: str, num_tokens: int) -> bool:
    return sum((await held(stack, ns, prefix)).get(worker, (0, 0, 0))) == num_tokens


async def _tiers(stack: Stack, ns, prefix, worker: str, tiers: tuple[int, int, int]) -> bool:
    return (await held(stack, ns, prefix)).get(worker) == tiers


async def _left_hbm(stack: Stack, ns, prefix, worker: str) -> bool:
    hbm, dram, _ = (await held(stack, ns, prefix)).get(worker, (0, 0, 0))
    return hbm < len(prefix) and dram > 0


async def _nothing_held(stack: Stack, ns, prefix) -> bool:
    return not await held(stack, ns, prefix)


async def _no_match(directory, digest, keys) -> bool:
    return not (await directory.lookup(digest, keys)).matches


async def _pinned_is(server, num: int) -> bool:
    return await pinned_pages(server) == num
