"""controller/cache_store.py against a real valkey-server: epochs from one fenced counter,
the epoch table's round trip, and pins that expire with their TTL."""

from __future__ import annotations

import asyncio
import time

from kvtier.cache.epochs import EpochTable
from kvtier.controller.cache_store import CacheStore, PinSpec
from kvtier.controller.leader import LEADER_EPOCH_KEY
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity, PageKey, namespace_digest
from kvtier.domain.records import InvalidationScope, PinId
from kvtier.domain.tiers import Tier

NS = NamespaceIdentity(model_id="m", tenant="acme", adapter="lora", page_size=4, policy_epoch=3)
SCOPES = [
    InvalidationScope(tenant="acme"),
    InvalidationScope(model_id="m"),
    InvalidationScope(namespace=NS),
    InvalidationScope(all_namespaces=True),
    InvalidationScope(tenant="acme"),
]


def pin_spec(pin_id: str, expires_at_ms: int | None = None) -> PinSpec:
    return PinSpec(PinId(pin_id), NS, namespace_digest(NS), (PageKey(b"k" * 16), PageKey(b"j" * 16)),
                   Tier.DRAM, expires_at_ms)


async def test_every_new_epoch_is_above_all_earlier_ones_whatever_the_scope(redis_client):
    store = CacheStore(redis_client)
    epochs = [await store.bump_epoch(scope, fence_token=0, floor=0) for scope in SCOPES]
    assert epochs == [1, 2, 3, 4, 5]
    # What a restarted controller reads back is the same table (the tenant at its newest epoch).
    table = EpochTable(await store.load_epochs())
    assert len(table) == 4
    assert [table.epoch_of(s) for s in SCOPES] == [5, 2, 3, 4, 5]
    assert table.effective_epoch(NS) == 5


async def test_the_floor_keeps_epochs_above_what_workers_hold_after_redis_lost_the_counter(redis_client):
    store = CacheStore(redis_client)
    assert await store.bump_epoch(SCOPES[0], fence_token=0, floor=0) == 1
    assert await store.bump_epoch(SCOPES[1], fence_token=0, floor=41) == 41
    assert await store.bump_epoch(SCOPES[2], fence_token=0, floor=0) == 42


async def test_a_deposed_leader_cannot_issue_an_epoch(redis_client):
    store = CacheStore(redis_client)
    await redis_client.set(LEADER_EPOCH_KEY, 7)
    assert await store.bump_epoch(SCOPES[0], fence_token=6, floor=0) is None
    assert await store.load_epochs() == []
    assert await store.bump_epoch(SCOPES[0], fence_token=7, floor=0) == 1


async def test_pins_round_trip_and_expire_with_their_ttl(redis_client):
    store = CacheStore(redis_client)
    forever, brief = pin_spec("p-forever"), pin_spec("p-brief", int(time.time() * 1000) + 150)
    await store.put_pin(forever)
    await store.put_pin(brief)
    assert await store.get_pin(PinId("p-forever")) == forever
    assert sorted(p.pin_id for p in await store.pins()) == ["p-brief", "p-forever"]
    await asyncio.sleep(0.3)
    assert await store.get_pin(PinId("p-brief")) is None
    assert await store.pins() == [forever]
    assert await redis_client.smembers("kvt:{g}:pins") == {b"p-forever"}  # the lapsed id left the set
    assert await store.delete_pins([PinId("p-forever"), PinId("p-brief")]) == 1
    assert await store.delete_pins([PinId("p-forever")]) == 0
    assert await store.pins() == []


def test_a_pin_keeps_its_identity_with_the_epoch_it_was_made_under() -> None:
    spec = pin_spec("p", 123)
    again = PinSpec.from_json(spec.to_json())
    assert again == spec and again.identity.policy_epoch == 3
    assert again.namespace_digest == NamespaceDigest(namespace_digest(NS))
