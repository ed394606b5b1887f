"""Per-tenant page quotas per tier and per-namespace TTLs (kvtier/cache/quotas.py, kvtier/cache/ttls.py).

Unit level: a tiny engine (random-weight model, 4-token pages, LRU eviction so the order is
known) with a controllable clock. End to end: a real controller (real valkey-server, gRPC on
loopback) and one in-process worker with quotas and TTLs configured, driven through the
client; the directory's view (Admin.Lookup) must follow what the worker kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random

import pytest
import pytest_asyncio
import redis

from kvtier.cache.quotas import QuotaTable
from kvtier.cache.ttls import TtlTable
from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain.errors import ConfigError
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, page_keys
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.runtime.config import ControllerConfig, WorkerConfig, load_config
from kvtier.tiers.manager import TierConfig
from kvtier.worker.link import WorkerLink
from kvtier.worker.servicer import serve_worker

from polling import eventually

PS = 4
ONE = SamplingParams(max_tokens=1, ignore_eos=True)
_rng = random.Random(9)


def fresh(num_pages: int) -> list[int]:
    """A prompt of ``num_pages`` full pages plus one token (so exactly that many get cached)."""
    return [_rng.randrange(3, 512) for _ in range(num_pages * PS + 1)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("quota-ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_engine(ckpt, tmp_path=None, *, num_pages=64, dram=0, nvme=0, quotas=None, ttls=None) -> Engine:
    tiers = None
    if dram or nvme:
        tiers = TierConfig(dram_pages=dram, nvme_slots=nvme, nvme_dir=tmp_path / "nvme" if nvme else None)
    engine = Engine.from_pretrained(
        ckpt, page_size=PS, num_pages=num_pages, eviction_policy="lru", tier_config=tiers,
        tenant_quotas=QuotaTable.from_setting(quotas) if quotas else None,
        namespace_ttls=TtlTable.from_setting(ttls) if ttls else None,
    )
    engine.index.clock = Clock()
    return engine


def ns(engine: Engine, tenant: str):
    return dataclasses.replace(engine.namespace, tenant=tenant)


def run(engine: Engine, tenant: str, prompt: list[int]):
    return engine.generate([prompt], ONE, namespace=ns(engine, tenant))[0]


def pages(engine: Engine, tenant: str) -> dict[Tier, int]:
    """Pages the index caches for ``tenant``, per tier (counted here, not by the tracker)."""
    digest = engine.digest_for(ns(engine, tenant))
    counts = dict.fromkeys(Tier, 0)
    for node in engine.index.nodes():
        if node.namespace == digest:
            counts[node.tier] += 1
    return counts


def cached(engine: Engine, tenant: str, prompt: list[int]) -> list[Tier]:
    """Tiers of the cached prefix of ``prompt`` (without counting a use)."""
    keys = page_keys(engine.digest_for(ns(engine, tenant)), prompt, PS)
    return [n.tier for n in engine.index.match(keys, count_hit=False).nodes]


# --------------------------------------------------------------------------- configuration


def test_quota_and_ttl_settings_parse_from_toml_env_and_flags(tmp_path) -> None:
    file = tmp_path / "worker.toml"
    file.write_text(
        'tenant_quotas = { acme = { dram = "1MiB", nvme = 0 }, "*" = { hbm = 8, dram = 16 } }\n'
        "[[namespace_ttls]]\nttl_s = 3600\n"
        '[[namespace_ttls]]\ntenant = "acme"\nttl_s = 60\n'
        '[[namespace_ttls]]\ntenant = "acme"\nmodel_id = "m"\nttl_s = 0\n'
    )
    config = load_config(WorkerConfig, file=file, env={})
    table = config.tenant_quotas
    assert table.limit("acme", Tier.HBM).pages(1024) == 8  # not named for acme: the default's
    assert table.limit("acme", Tier.DRAM).pages(1024) == 1024  # a size: whole pages of 1 KiB
    assert table.limit("acme", Tier.NVME).pages(1024) == 0
    assert table.limit("other", Tier.DRAM).pages(1024) == 16 and table.limit("other", Tier.NVME) is None
    assert not WorkerConfig().tenant_quotas and not WorkerConfig().namespace_ttls  # unset: nothing enforced
    ttls = config.namespace_ttls
    identity = NamespaceIdentity(model_id="tiny", tenant="acme")
    assert ttls.ttl_s(identity) == 60  # tenant beats the default
    assert ttls.ttl_s(dataclasses.replace(identity, model_id="m")) == 0  # tenant and model beat tenant
    assert ttls.ttl_s(dataclasses.replace(identity, tenant="zeta")) == 3600

    from_env = load_config(WorkerConfig, env={"KVTIER_TENANT_QUOTAS": '{"a": {"hbm": 2}}',
                                              "KVTIER_NAMESPACE_TTLS": "[{tenant: a, ttl_s: 1.5}]"})
    assert from_env.tenant_quotas.limit("a", Tier.HBM).pages(1) == 2
    assert from_env.namespace_ttls.ttl_s(dataclasses.replace(identity, tenant="a")) == 1.5

    # What the Helm chart renders: JSON text in a TOML string (JSON string escapes are TOML's).
    chart_form = tmp_path / "chart.toml"
    chart_form.write_text("tenant_quotas = " + json.dumps(json.dumps({"acme": {"hbm": 4, "dram": "1GiB"}})) + "\n")
    assert load_config(WorkerConfig, file=chart_form, env={}).tenant_quotas.limit("acme", Tier.HBM).pages(1) == 4


@pytest.mark.parametrize(
    ("env", "field", "words"),
    [
        ({"KVTIER_TENANT_QUOTAS": "{acme: {hbm: -1}}"}, "tenant_quotas.acme.hbm", "page count >= 0"),
        ({"KVTIER_TENANT_QUOTAS": "{acme: {hbm: 12}}"}, None, None),
        ({"KVTIER_TENANT_QUOTAS": "{acme: {dram: '12'}}"}, "tenant_quotas.acme.dram", "size with a unit"),
        ({"KVTIER_TENANT_QUOTAS": "{acme: {dram: 3 parsecs}}"}, "tenant_quotas.acme.dram", "3 parsecs"),
        ({"KVTIER_TENANT_QUOTAS": "{acme: {hmb: 4}}"}, "tenant_quotas.acme", "unknown tier 'hmb'"),
        ({"KVTIER_TENANT_QUOTAS": "{acme: 4}"}, "tenant_quotas.acme", "map tiers"),
        ({"KVTIER_TENANT_QUOTAS": "[1, 2]"}, "tenant_quotas", "map tenants"),
        ({"KVTIER_TENANT_QUOTAS": "{acme: {hbm: 4"}, "tenant_quotas", "YAML or JSON"),
        ({"KVTIER_NAMESPACE_TTLS": "[{tenant: a, ttl_s: -1}]"}, "namespace_ttls[0].ttl_s", ">= 0"),
        ({"KVTIER_NAMESPACE_TTLS": "[{ttl_s: 1}, {tenant: a}]"}, "namespace_ttls[1].ttl_s", "None"),
        ({"KVTIER_NAMESPACE_TTLS": "[{tennant: a, ttl_s: 1}]"}, "namespace_ttls[0]", "'tennant'"),
        ({"KVTIER_NAMESPACE_TTLS": "[{ttl_s: 1}, {ttl_s: 2}]"}, "namespace_ttls[1]", "namespace_ttls[0]"),
        ({"KVTIER_NAMESPACE_TTLS": "[{model_id: 7, ttl_s: 2}]"}, "namespace_ttls[0].model_id", "string"),
        ({"KVTIER_NAMESPACE_TTLS": "{ttl_s: 2}"}, "namespace_ttls", "list of rules"),
    ],
)
def test_bad_quota_or_ttl_settings_name_the_entry_and_the_source(env, field, words) -> None:
    if field is None:
        load_config(WorkerConfig, env=env)  # the good one among them
        return
    with pytest.raises(ConfigError) as excinfo:
        load_config(WorkerConfig, env=env)
    message = str(excinfo.value)
    assert excinfo.value.field == field, message
    assert field in message and words in message and f"(from {next(iter(env))})" in message, message


def test_a_bad_quota_flag_names_the_flag() -> None:
    from kvtier.worker.actor import worker_args

    with pytest.raises(ConfigError) as excinfo:
        worker_args(["--tenant-quotas", "{acme: {hbm: -4}}"], env={})
    assert excinfo.value.field == "tenant_quotas.acme.hbm" and "(from --tenant-quotas)" in str(excinfo.value)


# --------------------------------------------------------------------------- quotas


def test_a_tenant_over_its_hbm_quota_gives_up_only_its_own_pages(ckpt, tmp_path) -> None:
    engine = make_engine(ckpt, tmp_path, dram=64, quotas={"a": {"hbm": 4}})
    b_prompt = fresh(3)
    run(engine, "b", b_prompt)  # B's pages are the oldest: plain LRU would take them first
    baseline = run(engine, "b", b_prompt)
    assert baseline.num_cached_tokens == 3 * PS
    for _ in range(3):
        run(engine, "a", fresh(3))
    engine.check_integrity()
    assert pages(engine, "a") == {Tier.HBM: 4, Tier.DRAM: 5, Tier.NVME: 0}
    assert engine.quotas.num_pages("a", Tier.HBM) == 4 and engine.quotas.counters.pages_demoted == 5
    assert cached(engine, "b", b_prompt) == [Tier.HBM] * 3
    again = run(engine, "b", b_prompt)
    assert again.num_cached_tokens == baseline.num_cached_tokens and again.num_promoted_tokens == 0
    assert pages(engine, "b") == {Tier.HBM: 3, Tier.DRAM: 0, Tier.NVME: 0}
    engine.check_integrity()
    engine.close()


def test_a_forgotten_namespace_leaves_nothing_in_the_quota_and_ttl_tables(ckpt) -> None:
    """An invalidated namespace whose pages are gone is forgotten by the engine
    (``forget_namespace``) and with it by the quota and TTL trackers, while another namespace
    of the same tenant keeps its count and its TTL."""
    engine = make_engine(ckpt, quotas={"a": {"hbm": 8}}, ttls=[{"tenant": "a", "ttl_s": 60}])
    old = dataclasses.replace(ns(engine, "a"), tokenizer_digest="tok-old")
    engine.generate([fresh(2)], ONE, namespace=old)
    run(engine, "a", fresh(2))
    digest = engine.digest_for(old)
    for node in sorted(engine.index.nodes(), key=lambda n: -n.depth):  # its pages reclaimed
        if node.namespace == digest:
            engine.index.remove(node.key)
    engine.forget_namespace(digest)
    quotas, ttls = engine.quotas, engine.ttls
    assert digest not in quotas._tenant_of and digest not in quotas._digests_of.get("a", set())
    assert not [k for k in (*quotas._digest_counts, *quotas._heaps) if k[0] == digest]
    assert digest not in ttls._ttl
    assert quotas.num_pages("a", Tier.HBM) == pages(engine, "a")[Tier.HBM] > 0
    assert ttls.ttl_of(engine.digest_for(ns(engine, "a"))) == 60
    engine.check_integrity()
    engine.close()


def test_a_full_pool_takes_the_over_quota_tenants_own_pages_first(ckpt) -> None:
    engine = make_engine(ckpt, num_pages=16, quotas={"a": {"hbm": 6}})
    b_prompts = [fresh(4), fresh(4)]
    for prompt in b_prompts:
        run(engine, "b", prompt)  # 8 of B's pages, the least recently used of the pool
    run(engine, "a", fresh(6))  # A at its quota; 2 pages free
    a_late = run(engine, "a", fresh(4))  # needs 5 pages: 2 free, 3 evicted, all of them A's own
    engine.check_integrity()
    assert a_late.num_cached_tokens == 0
    assert engine.quotas.counters.num_own_evictions >= 3 and engine.quotas.counters.num_foreign_evictions == 0
    assert pages(engine, "a")[Tier.HBM] <= 6
    for prompt in b_prompts:
        assert cached(engine, "b", prompt) == [Tier.HBM] * 4
        assert run(engine, "b", prompt).num_cached_tokens == 4 * PS
    engine.check_integrity()


def test_pinned_and_in_use_pages_are_never_taken_and_the_overage_is_counted(ckpt) -> None:
    engine = make_engine(ckpt, quotas={"a": {"hbm": 2}})  # no lower tier: over-quota pages are dropped
    prompt = fresh(4)
    keys = page_keys(engine.digest_for(ns(engine, "a")), prompt, PS)
    rid = engine.add_request(prompt, ONE, namespace=ns(engine, "a"))
    while not engine.get(rid).is_finished:
        engine.step()  # caches 4 pages; enforcement runs before the next step, so pin now
    engine.index.pin(keys[-1])  # the deepest page: its ancestors stay by leaves-first
    stuck = engine.quotas.counters.num_stuck
    engine.enforce_limits()
    assert cached(engine, "a", prompt) == [Tier.HBM] * 4  # pinned chain kept
    assert engine.quotas.overage() == {("a", Tier.HBM): 2}
    assert engine.quotas.counters.num_stuck > stuck
    engine.pop_result(rid)
    engine.index.unpin(keys[-1])
    engine.enforce_limits()
    assert cached(engine, "a", prompt) == [Tier.HBM] * 2  # leaves went first: the prefix stays
    assert engine.quotas.overage() == {}
    engine.check_integrity()

    # In use: a running sequence's cached prompt pages stay, and it still gets every page it
    # needs (correctness first): the output equals an engine without quotas.
    long_prompt = fresh(5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    rid = engine.add_request(long_prompt, params, namespace=ns(engine, "a"))
    engine.step()  # prefill: the 5 prompt pages are cached and held
    engine.enforce_limits()
    assert cached(engine, "a", long_prompt) == [Tier.HBM] * 5
    assert engine.quotas.overage()[("a", Tier.HBM)] >= 3
    while not engine.get(rid).is_finished:
        engine.step()
    out = engine.pop_result(rid).token_ids
    engine.enforce_limits()
    assert pages(engine, "a")[Tier.HBM] == 2 and engine.quotas.overage() == {}
    free = make_engine(ckpt)
    assert free.generate([long_prompt], params, namespace=ns(free, "a"))[0].token_ids == out
    engine.check_integrity()


def test_a_quota_in_each_tier_cascades_down_and_then_drops(ckpt, tmp_path) -> None:
    quotas = {"a": {"hbm": 2, "dram": 2, "nvme": 2}}
    engine = make_engine(ckpt, tmp_path, dram=64, nvme=64, quotas=quotas)
    b_prompt = fresh(3)
    run(engine, "b", b_prompt)
    for _ in range(3):
        run(engine, "a", fresh(3))
    engine.check_integrity()
    a = pages(engine, "a")
    assert all(a[tier] <= 2 for tier in Tier) and a[Tier.NVME] > 0, a
    assert engine.quotas.counters.pages_dropped > 0 and engine.quotas.counters.pages_demoted > 0
    assert cached(engine, "b", b_prompt) == [Tier.HBM] * 3

    # Everything goes to DRAM at once (a drain): A is far over its DRAM quota, so its own DRAM
    # leaves go on to NVMe while A has room there, then they are dropped; B's stay in DRAM.
    engine.tiers.demote_all(Tier.DRAM)
    engine.enforce_limits()
    a = pages(engine, "a")
    assert a[Tier.HBM] == 0 and a[Tier.DRAM] <= 2 and a[Tier.NVME] <= 2, a
    assert cached(engine, "b", b_prompt) == [Tier.DRAM] * 3
    assert run(engine, "b", b_prompt).num_promoted_tokens == 3 * PS
    engine.check_integrity()
    engine.close()


# --------------------------------------------------------------------------- TTLs


def test_pages_of_a_namespace_expire_after_its_ttl_of_idle_time_in_every_tier(ckpt, tmp_path) -> None:
    ttls = [{"tenant": "a", "ttl_s": 10}, {"tenant": "b", "ttl_s": 0}]
    engine = make_engine(ckpt, tmp_path, dram=64, ttls=ttls)
    clock = engine.index.clock
    old, recent, b_prompt = fresh(3), fresh(3), fresh(3)
    run(engine, "a", old)
    run(engine, "b", b_prompt)
    engine.tiers.demote_all(Tier.DRAM)  # TTLs count in every tier
    run(engine, "a", recent)
    clock.now += 8
    assert run(engine, "a", recent).num_cached_tokens == 3 * PS  # a hit: idle time restarts
    clock.now += 2.5
    engine.enforce_limits()
    assert cached(engine, "a", old) == [] and cached(engine, "a", recent) == [Tier.HBM] * 3
    assert engine.ttls.num_expired == 3
    engine.check_integrity()
    clock.now += 8
    engine.enforce_limits()
    assert cached(engine, "a", recent) == []
    clock.now += 10_000
    engine.enforce_limits()
    assert cached(engine, "b", b_prompt) == [Tier.DRAM] * 3  # no TTL: kept
    assert engine.limits_wait_s() is None
    engine.check_integrity()

    # A page held by a running sequence is in use, not idle: its idle time starts at release.
    prompt = fresh(3)  # 13 tokens and 2 more fed back: no 4th page, so nothing younger hangs below
    rid = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), namespace=ns(engine, "a"))
    engine.step()
    clock.now += 60
    engine.enforce_limits()
    assert cached(engine, "a", prompt) == [Tier.HBM] * 3
    while not engine.get(rid).is_finished:
        engine.step()
    engine.pop_result(rid)
    clock.now += 9
    engine.enforce_limits()
    assert cached(engine, "a", prompt) == [Tier.HBM] * 3
    assert 0 < engine.limits_wait_s() <= 1
    clock.now += 1.5
    engine.enforce_limits()
    assert cached(engine, "a", prompt) == []
    engine.check_integrity()
    engine.close()


# --------------------------------------------------------------------------- end to end

in_module_loop = pytest.mark.asyncio(loop_scope="module")
TTL_S = 2.0  # long enough to see the prefix routable first on a loaded machine



@dataclasses.dataclass
class Stack:
    controller: object
    client: AsyncClient
    worker: object
    link: WorkerLink

    def ns(self, tenant: str):
        return dataclasses.replace(self.worker.engine.namespace, tenant=tenant)

    async def complete(self, tenant: str, prompt):
        return (await self.client.complete(self.ns(tenant), prompt, ONE, worker=self.worker.address))[1]

    async def held(self, tenant: str, prompt) -> tuple[int, int, int]:
        """The directory's view (Admin.Lookup): (hbm, dram, nvme) tokens of ``prompt`` on the worker."""
        result = await self.client.lookup(self.ns(tenant), prompt)
        return next(((t.hbm_tokens, t.dram_tokens, t.nvme_tokens) for m in result.matches
                     if m.worker_id == "w-quota" for t in [m.matched_tokens]), (0, 0, 0))

    async def assert_intact(self) -> None:
        result = await self.worker.loop.check_integrity()
        assert result.is_ok, [r.problem for r in result.reports if r.problem]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(ckpt, redis_url, tmp_path_factory):
    with contextlib.closing(redis.Redis.from_url(redis_url)) as r:
        r.flushdb()
    engine = Engine.from_pretrained(
        ckpt, page_size=PS, num_pages=64, eviction_policy="lru", tier_config=TierConfig(dram_pages=64),
        tenant_quotas=QuotaTable.from_setting({"qa": {"hbm": 4}}),
        namespace_ttls=TtlTable.from_setting([{"tenant": "ttl", "ttl_s": TTL_S}]),
    )
    worker = await serve_worker(engine, worker_id="w-quota")
    config = ControllerConfig(port=0, state_dir=tmp_path_factory.mktemp("controller"), lease_ttl_s=1.0,
                              heartbeat_interval_s=0.5)
    controller = await serve_controller(config, redis_url=redis_url)
    link = WorkerLink(worker.loop, controller_address=controller.address, worker_id=worker.worker_id,
                      address=worker.address, boot_id=worker.boot_id, heartbeat_interval_s=0.1,
                      batch_interval_s=0.02, max_backoff_s=0.2)
    link.start()
    client = AsyncClient(controller.address)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while controller.links.counters["snapshots.applied"] < 1:
            assert loop.time() < deadline, "the worker never registered"
            await asyncio.sleep(0.01)
        yield Stack(controller, client, worker, link)
    finally:
        await client.close()
        await link.stop()
        await controller.stop(0)
        await worker.stop(0)


@in_module_loop
async def test_over_quota_tenant_is_demoted_and_another_tenants_prefix_still_hits(stack) -> None:
    b_prompt = fresh(3)
    first = await stack.complete("qb", b_prompt)
    baseline = await stack.complete("qb", b_prompt)
    assert first.usage.cached_tokens == 0 and baseline.usage.cached_tokens == 3 * PS
    a_prompts = [fresh(3) for _ in range(3)]
    for prompt in a_prompts:
        await stack.complete("qa", prompt)

    async def a_settled():
        tiers = [await stack.held("qa", p) for p in a_prompts]
        return sum(h for h, _, _ in tiers) == 4 * PS and sum(d for _, d, _ in tiers) == 5 * PS

    await eventually(a_settled, what="A's pages over its quota to show in DRAM in the directory")
    assert await stack.held("qb", b_prompt) == (3 * PS, 0, 0)
    again = await stack.complete("qb", b_prompt)
    assert again.usage.cached_tokens == baseline.usage.cached_tokens
    assert again.usage.cached_tokens_by_tier.hbm_tokens == 3 * PS
    assert stack.worker.engine.quotas.overage() == {}
    for tenant in ("qa", "qb"):
        await stack.controller.directory.check_integrity(
            namespace_digest(stack.controller.router.epochs.apply(stack.ns(tenant))))
    await stack.assert_intact()


@in_module_loop
async def test_a_namespace_ttl_drops_idle_pages_and_the_directory_forgets_them(stack) -> None:
    prompt = fresh(3)
    await stack.complete("ttl", prompt)
    await stack.complete("keep", prompt)
    expiring = page_keys(namespace_digest(stack.controller.router.epochs.apply(stack.ns("ttl"))), prompt, PS)

    async def routable():
        return sum(await stack.held("ttl", prompt)) == 3 * PS

    async def gone():
        return await stack.held("ttl", prompt) == (0, 0, 0)

    await eventually(routable, timeout_s=TTL_S, what="the prefix to reach the directory before it expires")

    # Expiry is ~TTL_S after the last use; the bounded wait only guards against a hang.
    await eventually(gone, timeout_s=10 * TTL_S + 5, what="the expired prefix to leave the directory")
    assert not set(expiring) & {n.key for n in stack.worker.engine.index.nodes()}
    assert sum(await stack.held("keep", prompt)) == 3 * PS  # no TTL: still routable
    digest = namespace_digest(stack.controller.router.epochs.apply(stack.ns("ttl")))
    await stack.controller.directory.check_integrity(digest)
    missed = await stack.complete("ttl", prompt)
    kept = await stack.complete("keep", prompt)
    assert missed.usage.cached_tokens == 0 and kept.usage.cached_tokens == 3 * PS
    assert stack.worker.engine.ttls.num_expired >= 3
    await stack.assert_intact()


def test_reserved_pages_stay_for_an_over_quota_tenant_and_go_for_one_within_its_quota(ckpt) -> None:
    """Reservations (decision 0009): A's pages within its quota are passed over by victim searches
    for a tenant over its own quota, or for nobody (background demotion), never for A itself; a
    tenant within its quota, or without one, takes them in the usual order (nobody starves)."""
    engine = make_engine(ckpt, num_pages=16, quotas={"qa": {"hbm": 8}, "qb": {"hbm": 2}})
    run(engine, "qa", fresh(6))
    quotas = engine.quotas
    node = next(n for n in engine.index.nodes() if n.namespace == engine.digest_for(ns(engine, "qa")))
    digest = {t: engine.digest_for(ns(engine, t)) for t in ("qa", "qb", "qc")}
    assert quotas.is_reserved(node)  # nobody's behalf
    with quotas.acting_for(digest["qb"], num_pending=12):  # B would pass its 2 pages
        assert quotas.is_reserved(node)
    with quotas.acting_for(digest["qb"], num_pending=1):  # B within its quota
        assert not quotas.is_reserved(node)
    with quotas.acting_for(digest["qa"], num_pending=100):  # A's own pages
        assert not quotas.is_reserved(node)
    with quotas.acting_for(digest["qc"], num_pending=100):  # no quota: never over
        assert not quotas.is_reserved(node)
    run(engine, "qc", fresh(14))  # needs A's pages: a tenant without a quota gets them
    assert pages(engine, "qa")[Tier.HBM] < 6
    engine.check_integrity()
    engine.close()
