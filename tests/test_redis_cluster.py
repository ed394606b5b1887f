"""The controller's Redis stores on a real Redis Cluster (three masters, one replica each, on
loopback; ``loadtests/redis_cluster.py``), with the cluster client a ``redis+cluster://`` URL
gives (``controller/redis_connect.py``).

On a cluster, a script or transaction whose keys hash to different slots fails with CROSSSLOT,
so running every script and transaction here proves each stays in one slot. Namespaces are
picked so that their keys live on different primaries. The whole suites of the stores run on
a cluster with ``make test-redis-cluster``; the master kill under load is
``tests/e2e/test_redis_cluster_failover.py``. Skipped without ``redis-server``.
"""

from __future__ import annotations

import asyncio

import pytest
from redis.crc import key_slot

from kvtier.controller.cache_store import CacheStore, PinSpec
from kvtier.controller.directory import Directory
from kvtier.controller.directory_records import Outcome
from kvtier.controller.directory_scripts import meta_key
from kvtier.controller.leader import GLOBAL_PREFIX, LeaderLease
from kvtier.controller.policy_store import PolicyStore, seed_policy
from kvtier.controller.predictor import ToolReturnPredictor
from kvtier.controller.redis_connect import (
    REDIS_ERRORS,
    cluster_seeds,
    connect,
    is_cluster_url,
    server_identity,
)
from kvtier.controller.sessions import SessionRecord, SessionStore
from kvtier.domain.errors import ConfigError
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, page_keys
from kvtier.domain.records import InvalidationScope, PageEvent, PinId, SessionId, SessionState, WorkerId
from kvtier.domain.tiers import Tier
from kvtier.policy.prediction import PredictorParams
from loadtests.redis_cluster import LocalRedisCluster, find_binaries, missing_reason

from valkey_fixture import sync_client

pytestmark = pytest.mark.skipif(find_binaries() is None, reason=missing_reason())

W1, W2 = WorkerId("w1"), WorkerId("w2")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as running:
        yield running


@pytest.fixture
async def client(cluster):
    flusher = sync_client(cluster.url)
    try:
        flusher.flushdb()
        flusher.script_flush()  # NOSCRIPT paths get exercised on every primary
    finally:
        flusher.close()
    redis = connect(cluster.url)
    yield redis
    await redis.aclose()


def namespaces_on_distinct_primaries(cluster: LocalRedisCluster) -> list[bytes]:
    """One namespace digest per primary: their keys live on different nodes."""
    found: dict[int, bytes] = {}
    for i in range(200):
        digest = namespace_digest(NamespaceIdentity(model_id="m", tenant=f"t{i}"))
        primary = cluster.primary_of(meta_key(digest)).port
        found.setdefault(primary, digest)
        if len(found) == cluster.num_masters:
            return list(found.values())
    raise AssertionError(f"200 namespaces fell on {len(found)} primaries only")


def test_a_cluster_url_names_every_seed_and_keeps_credentials_and_tls():
    first, seeds = cluster_seeds("rediss+cluster://u:p@10.0.0.1:7000,10.0.0.2:7001?ssl_cert_reqs=none")
    assert first == "rediss://u:p@10.0.0.1:7000?ssl_cert_reqs=none"
    assert seeds == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert is_cluster_url("redis+cluster://h:1") and not is_cluster_url("redis://h:1")
    with pytest.raises(ConfigError, match="host:port") as bad:
        cluster_seeds("redis+cluster://10.0.0.1")
    assert bad.value.field == "redis_url"
    with pytest.raises(ConfigError, match="database 0"):
        cluster_seeds("redis+cluster://10.0.0.1:7000/3")


async def test_every_directory_script_runs_with_namespaces_on_different_primaries(cluster, client):
    namespaces = namespaces_on_distinct_primaries(cluster)
    assert len({key_slot(meta_key(ns).encode()) for ns in namespaces}) == 3
    lease = LeaderLease(client, "ctl@test")
    term = await lease.try_acquire()
    assert term is not None
    d = Directory(client, fence_token=term.token)
    assert (await d.raise_fences()) is Outcome.OK
    for worker in (W1, W2):
        assert (await d.register_worker(worker)).outcome is Outcome.OK
    chains = {ns: page_keys(ns, list(range(16)), 2) for ns in namespaces}
    # One batch spans every namespace: one pipelined round trip to all three primaries.
    events = [PageEvent.insert(ns, k, keys[i - 1] if i else None, i + 1, Tier.HBM)
              for ns, keys in chains.items() for i, k in enumerate(keys)]
    result = await d.apply_events(W1, 1, events)
    assert (result.outcome, result.num_applied, result.rejected) == (Outcome.OK, 3 * 8, ())
    ns_a = namespaces[0]
    assert (await d.apply_events(W2, 1, [PageEvent.insert(ns_a, chains[ns_a][0], None, 1, Tier.DRAM)])).num_applied == 1
    for ns, keys in chains.items():
        found = await d.lookup(ns, keys)
        assert found.matched_depth == 8 and found.matches[0].worker == W1
        assert (await d.stats(ns)).num_entries == (9 if ns == ns_a else 8)
        await d.check_integrity(ns)
    assert (await d.heartbeat(W1)) is Outcome.OK
    assert await d.refresh_workers(revive=True) == 2

    assert (await d.invalidate(ns_a)).epoch == 2
    while (await d.reclaim_step(max_items=5)).num_pending_namespaces:
        pass
    assert (await d.lookup(ns_a, chains[ns_a])).matched_depth == 0
    drop = await d.drop_worker(W1, batch_size=3)
    assert (drop.outcome, drop.is_done) == (Outcome.OK, True)
    assert [(await d.lookup(ns, keys)).matched_depth for ns, keys in chains.items()] == [0, 0, 0]
    assert (await d.sweep()).outcome is Outcome.OK
    for ns in namespaces:
        await d.check_integrity(ns)
    assert await lease.renew() and await lease.release()


async def test_the_other_stores_keep_each_transaction_in_one_slot(client):
    store = CacheStore(client)
    assert await store.bump_epoch(InvalidationScope(tenant="t"), fence_token=0, floor=0) == 1
    assert len(await store.load_epochs()) == 1
    identity = NamespaceIdentity(model_id="m", tenant="t")
    digest = namespace_digest(identity)
    pins = [PinSpec(PinId(f"p{i}"), identity, digest, tuple(page_keys(digest, [1, 2], 2)), Tier.DRAM)
            for i in range(3)]
    for pin in pins:
        await store.put_pin(pin)
    assert sorted(p.pin_id for p in await store.pins()) == ["p0", "p1", "p2"]
    assert await store.delete_pins([PinId("p0"), PinId("p1")]) == 2

    sessions = SessionStore(client)
    for i in range(5):  # session keys hash all over the cluster
        await sessions.put(SessionRecord(SessionId(f"s{i}"), SessionState.ACTIVE, tenant="t"))
    assert sorted([r.session_id async for r in sessions.scan()]) == [f"s{i}" for i in range(5)]

    predictor = ToolReturnPredictor(client, PredictorParams(max_tools_per_tenant=2))
    for tool in ("a", "b", "c", "d"):  # each new tool past two forgets the oldest (a DEL across slots)
        await predictor.observe("t", tool, 100.0)
    fresh = ToolReturnPredictor(client, PredictorParams(max_tools_per_tenant=2))
    assert await fresh.load() == 2 and fresh.history("t", "d") is not None

    policies = PolicyStore(client, seed=seed_policy({Tier.HBM: 1.0, Tier.DRAM: 0.5, Tier.NVME: 0.25}, {Tier.DRAM: 2e9}))
    assert (await policies.current()).version == 1


async def test_the_identity_names_every_primary_and_changes_when_a_replica_takes_over(tmp_path):
    with LocalRedisCluster(tmp_path, node_timeout_ms=1000) as small:
        client = connect(small.url)
        try:
            before = await server_identity(client)
            assert len(before.split(",")) == 3
            small.kill(small.primary_of(GLOBAL_PREFIX + "workers"))
            small.wait_for_failover()
            for _ in range(100):  # the client finds the new topology on a later call
                try:
                    after = await server_identity(client)
                    break
                except REDIS_ERRORS:
                    await asyncio.sleep(0.1)
            assert len(after.split(",")) == 3 and after != before
            assert len(set(after.split(",")) & set(before.split(","))) == 2
        finally:
            await client.aclose()
