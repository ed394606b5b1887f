"""Versioned policies in a real valkey-server (controller/policy_store.py): the seed is version 1
exactly once however many controllers read an empty store at the same moment; versions grow by
one; optimistic concurrency lets exactly one of several writers with the same expected version
win; history is newest first and limited; a rollback appends an equal copy; bad input and
unknown versions name the field; the policy in force follows the store on every controller."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest
import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvtier.controller.policy_store import (
    CURRENT_KEY,
    SEED_SET_BY,
    VERSIONS_KEY,
    PolicyInForce,
    PolicyStore,
    seed_policy,
)
from kvtier.controller.redis_connect import connect
from kvtier.domain.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kvtier.domain.records import Policy, RollbackPolicyRequest, SetPolicyRequest, Watermarks
from kvtier.domain.tiers import Tier


def weights(hbm: float, dram: float = 0.5, nvme: float = 0.25) -> Policy:
    return dataclasses.replace(Policy.default(), tier_weights={Tier.HBM: hbm, Tier.DRAM: dram, Tier.NVME: nvme})


async def test_an_empty_store_gets_the_seed_as_version_1_exactly_once(flushed_redis_url):
    seeds = [weights(1.0, dram=d / 10) for d in range(8)]  # each "controller" seeds differently
    clients = [connect(flushed_redis_url) for _ in seeds]
    try:
        stores = [PolicyStore(c, seed=s, clock_ms=lambda: 1234) for c, s in zip(clients, seeds, strict=True)]
        firsts = await asyncio.gather(*(s.current() for s in stores))
        assert {f.version for f in firsts} == {1}
        assert len({f.policy.tier_weights[Tier.DRAM] for f in firsts}) == 1  # one seed won, all see it
        assert firsts[0].policy in seeds and firsts[0].set_by == SEED_SET_BY and firsts[0].set_at_ms == 1234
        assert await clients[0].hlen(VERSIONS_KEY) == 1 and await clients[0].get(CURRENT_KEY) == b"1"
    finally:
        for c in clients:
            await c.aclose()


async def test_versions_grow_by_one_and_record_who_when_and_why(redis_client):
    now = iter(range(1000, 2000, 10))
    store = PolicyStore(redis_client, clock_ms=lambda: next(now))
    installed = [await store.set(SetPolicyRequest(weights(w), reason=f"r{w}"), set_by="ops") for w in (2, 3, 4)]
    assert [v.version for v in installed] == [2, 3, 4]
    assert [v.policy.tier_weights[Tier.HBM] for v in installed] == [2, 3, 4]
    assert [v.reason for v in installed] == ["r2", "r3", "r4"] and {v.set_by for v in installed} == {"ops"}
    assert installed[0].set_at_ms < installed[1].set_at_ms < installed[2].set_at_ms
    assert await store.get() == installed[-1] == await store.current()
    assert await store.get(3) == installed[1]
    assert (await store.get(1)).policy == Policy.default()
    with pytest.raises(NotFound) as err:
        await store.get(9)
    assert err.value.field == "version"


async def test_concurrent_writers_with_the_same_expected_version_exactly_one_wins(flushed_redis_url):
    clients = [connect(flushed_redis_url) for _ in range(6)]
    try:
        stores = [PolicyStore(c) for c in clients]
        assert (await stores[0].current()).version == 1
        results = await asyncio.gather(
            *(s.set(SetPolicyRequest(weights(float(i)), expected_version=1), set_by=f"op{i}")
              for i, s in enumerate(stores)),
            return_exceptions=True,
        )
        winners = [r for r in results if not isinstance(r, Exception)]
        losers = [r for r in results if isinstance(r, Exception)]
        assert len(winners) == 1 and winners[0].version == 2
        assert all(isinstance(e, FailedPrecondition) and e.field == "expected_version" for e in losers)
        assert len(losers) == 5
        assert await stores[3].current() == winners[0]
        # A stale expectation fails; the right one and none at all succeed.
        with pytest.raises(FailedPrecondition):
            await stores[0].set(SetPolicyRequest(weights(9.0), expected_version=1), set_by="late")
        assert (await stores[0].set(SetPolicyRequest(weights(9.0), expected_version=2), set_by="op")).version == 3
        assert (await stores[1].set(SetPolicyRequest(weights(8.0)), set_by="op")).version == 4
    finally:
        for c in clients:
            await c.aclose()


async def test_history_is_newest_first_and_limited(redis_client):
    store = PolicyStore(redis_client)
    for w in (2.0, 3.0, 4.0, 5.0):
        await store.set(SetPolicyRequest(weights(w)), set_by="op")
    assert [v.version for v in await store.history(3)] == [5, 4, 3]
    everything = await store.history(1000)
    assert [v.version for v in everything] == [5, 4, 3, 2, 1]
    assert [v.policy.tier_weights[Tier.HBM] for v in everything[:4]] == [5.0, 4.0, 3.0, 2.0]
    assert [v.version for v in await store.history(1)] == [5]


async def test_rollback_appends_an_equal_copy(redis_client):
    store = PolicyStore(redis_client)
    v2 = await store.set(SetPolicyRequest(weights(2.0), reason="try"), set_by="alice")
    await store.set(SetPolicyRequest(weights(3.0)), set_by="alice")
    back = await store.rollback(RollbackPolicyRequest(to_version=2), set_by="bob")
    assert back.version == 4 and back.policy == v2.policy and back.set_by == "bob"
    assert back.reason == "rollback to version 2"
    assert await store.get(2) == v2  # the old version is untouched
    with pytest.raises(NotFound) as err:
        await store.rollback(RollbackPolicyRequest(to_version=7), set_by="bob")
    assert err.value.field == "to_version"
    assert (await store.current()).version == 4


@pytest.mark.parametrize(("policy", "field"), [
    (Policy(watermarks={Tier.HBM: Watermarks(high=0.5, low=0.7)}), "policy.watermarks.hbm.low"),
    (Policy(watermarks={Tier.DRAM: Watermarks(high=1.5, low=0.7)}), "policy.watermarks.dram.high"),
    (Policy(budget_bytes_per_s={Tier.NVME: -1}), "policy.budget_bytes_per_s.nvme"),
    (Policy(budget_bytes_per_s={Tier.NVME: 2**64 - 1}), "policy.budget_bytes_per_s.nvme"),
    (Policy(tier_weights={Tier.DRAM: float("nan")}), "policy.tier_weights.dram"),
    (Policy(tier_weights={Tier.DRAM: -0.5}), "policy.tier_weights.dram"),
    (Policy(tier_weights={"ssd": 1.0}), "policy.tier_weights.ssd"),  # type: ignore[dict-item]
    (Policy(eviction_policy="LRU!"), "policy.eviction_policy"),
])
async def test_bad_policies_are_refused_naming_the_field_and_nothing_is_stored(redis_client, policy, field):
    store = PolicyStore(redis_client)
    with pytest.raises(InvalidArgument) as err:
        await store.set(SetPolicyRequest(policy), set_by="op")
    assert err.value.field == field and field in err.value.message
    assert (await store.current()).version == 1


async def test_the_policy_in_force_follows_the_store_on_every_controller(flushed_redis_url):
    leader_client, standby_client = connect(flushed_redis_url), connect(flushed_redis_url)
    seed = seed_policy({Tier.HBM: 1.0, Tier.DRAM: 0.8, Tier.NVME: 0.5}, {Tier.DRAM: 2e9, Tier.NVME: 2e9})
    try:
        applied: dict[str, list[Policy]] = {"leader": [], "standby": []}
        leader = PolicyInForce(PolicyStore(leader_client, seed=seed), [applied["leader"].append])
        standby = PolicyInForce(PolicyStore(standby_client, seed=seed), [applied["standby"].append])
        assert leader.version == 0
        await asyncio.gather(leader.refresh(), standby.refresh())
        assert leader.version == standby.version == 1 and applied["leader"] == applied["standby"] == [seed]
        assert seed.budget_bytes_per_s == {Tier.DRAM: 2_000_000_000, Tier.NVME: 2_000_000_000}

        await leader.set(SetPolicyRequest(weights(0.5)), set_by="op")  # applied at once on the leader
        assert leader.version == 2 and applied["leader"][-1] == weights(0.5)
        assert standby.version == 1
        await standby.refresh()  # what the refresh loop does every second
        assert standby.version == 2 and applied["standby"] == [seed, weights(0.5)]
        await standby.refresh()  # unchanged: not applied again
        assert len(applied["standby"]) == 2

        await leader.rollback(RollbackPolicyRequest(to_version=1), set_by="op")
        await standby.refresh()
        assert leader.version == standby.version == 3 and applied["standby"][-1] == seed
    finally:
        await leader_client.aclose()
        await standby_client.aclose()


async def test_an_unreachable_store_is_unavailable():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = aredis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    failures: list[BaseException] = []
    try:
        store = PolicyStore(client, on_error=failures.append)
        with pytest.raises(Unavailable) as err:
            await store.current()
        assert "unreachable" in err.value.message and len(failures) == 1
        in_force = PolicyInForce(store, [])
        with pytest.raises(Unavailable):
            await in_force.set(SetPolicyRequest(Policy.default()), set_by="op")
        assert in_force.version == 0
    finally:
        await client.aclose()
