"""What cache administration must remember across controller restarts, in Redis.

Controller-wide keys, under the leader lease's ``{g}`` hash tag (one Cluster slot)::

    kvt:{g}:epochs      hash    scope key (kvtier.cache.epochs.scope_key) -> "<epoch>:<scope as JSON>"
    kvt:{g}:epoch_seq   string  the last policy epoch issued
    kvt:{g}:pins        set     pin ids
    kvt:{g}:pin:<id>    string  the pin as JSON; Redis expires it with the pin (PXAT)

Epochs come from one counter, so every invalidation's epoch is above every epoch issued
before it, for any scope (``kvtier.cache.epochs``). The bump is one script that checks the
leader's fencing token, so a deposed leader cannot issue an epoch. The caller passes a
floor (the highest epoch it knows): should Redis lose the counter (a restart without
persistence), new epochs still land above the ones workers already hold.

A pin past its expiry vanishes from Redis by itself; its id leaves the set lazily, the
next time the set is read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from kvtier.cache.epochs import EpochEntry, scope_key
from kvtier.controller.leader import GLOBAL_PREFIX, LEADER_EPOCH_KEY
from kvtier.controller.redis_connect import RedisClient
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity, PageKey
from kvtier.domain.records import InvalidationScope, PinId
from kvtier.domain.tiers import Tier

EPOCHS_KEY = GLOBAL_PREFIX + "epochs"
EPOCH_SEQ_KEY = GLOBAL_PREFIX + "epoch_seq"
PINS_KEY = GLOBAL_PREFIX + "pins"
PIN_PREFIX = GLOBAL_PREFIX + "pin:"

# KEYS: epochs, epoch_seq, leader_epoch. ARGV: fencing token, scope key, scope JSON, floor.
# -> {'fenced'} | {'ok', epoch}
_BUMP = """
if tonumber(ARGV[1]) < (tonumber(redis.call('GET', KEYS[3])) or 0) then
  return {'fenced'}
end
local epoch = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[4])
if epoch < floor then
  epoch = floor
  redis.call('SET', KEYS[2], epoch)
end
redis.call('HSET', KEYS[1], ARGV[2], epoch .. ':' .. ARGV[3])
return {'ok', epoch}
"""


def identity_to_json(identity: NamespaceIdentity) -> dict[str, Any]:
    return dataclasses.asdict(identity)


def identity_from_json(data: Mapping[str, Any]) -> NamespaceIdentity:
    return NamespaceIdentity(**data)


def scope_to_json(scope: InvalidationScope) -> dict[str, Any]:
    if scope.all_namespaces:
        return {"all_namespaces": True}
    if scope.tenant is not None:
        return {"tenant": scope.tenant}
    if scope.model_id is not None:
        return {"model_id": scope.model_id}
    assert scope.namespace is not None, "a validated scope sets exactly one member"
    return {"namespace": identity_to_json(scope.namespace)}


def scope_from_json(data: Mapping[str, Any]) -> InvalidationScope:
    if "namespace" in data:
        return InvalidationScope(namespace=identity_from_json(data["namespace"]))
    return InvalidationScope(
        tenant=data.get("tenant"), model_id=data.get("model_id"), all_namespaces=bool(data.get("all_namespaces"))
    )


@dataclass(frozen=True, slots=True)
class PinSpec:
    """One admin pin as the controller keeps it. ``identity`` carries the epoch the pin was
    made under, so an invalidation that makes it stale also removes the pin."""

    pin_id: PinId
    identity: NamespaceIdentity
    namespace_digest: NamespaceDigest
    page_keys: tuple[PageKey, ...]
    tier: Tier
    expires_at_ms: int | None = None
    replicas: int = 0  # workers that keep a copy (``controller/replicas.py``); 0: no copies made

    def to_json(self) -> str:
        return json.dumps({
            "pin_id": self.pin_id,
            "identity": identity_to_json(self.identity),
            "namespace_digest": self.namespace_digest.hex(),
            "page_keys": [k.hex() for k in self.page_keys],
            "tier": int(self.tier),
            "expires_at_ms": self.expires_at_ms,
            "replicas": self.replicas,
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> PinSpec:
        data = json.loads(text)
        return cls(
            pin_id=PinId(data["pin_id"]),
            identity=identity_from_json(data["identity"]),
            namespace_digest=NamespaceDigest(bytes.fromhex(data["namespace_digest"])),
            page_keys=tuple(PageKey(bytes.fromhex(k)) for k in data["page_keys"]),
            tier=Tier(data["tier"]),
            expires_at_ms=data["expires_at_ms"],
            replicas=int(data.get("replicas", 0)),
        )


class CacheStore:
    """Async access to the epoch table and the pins; Redis errors propagate to the caller."""

    def __init__(self, client: RedisClient) -> None:
        self._redis = client
        self._bump = client.register_script(_BUMP)

    # -- epochs ---------------------------------------------------------------------------

    async def load_epochs(self) -> list[EpochEntry]:
        # The client leaves decode_responses off, so redis replies are bytes.
        raw = cast("dict[bytes, bytes]", await self._redis.hgetall(EPOCHS_KEY))
        entries = []
        for value in raw.values():
            epoch, _, scope = value.decode().partition(":")
            entries.append(EpochEntry(scope_from_json(json.loads(scope)), int(epoch)))
        return entries

    async def bump_epoch(self, scope: InvalidationScope, *, fence_token: int, floor: int) -> int | None:
        """Issue a new epoch for ``scope`` (above ``floor`` and every earlier one); None when fenced."""
        reply = await self._bump(
            keys=[EPOCHS_KEY, EPOCH_SEQ_KEY, LEADER_EPOCH_KEY],
            args=[fence_token, scope_key(scope), json.dumps(scope_to_json(scope)), floor],
        )
        if reply[0] == b"fenced":
            return None
        return int(reply[1])

    # -- pins -----------------------------------------------------------------------------

    async def put_pin(self, pin: PinSpec) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            if pin.expires_at_ms is None:
                pipe.set(PIN_PREFIX + pin.pin_id, pin.to_json())
            else:
                pipe.set(PIN_PREFIX + pin.pin_id, pin.to_json(), pxat=pin.expires_at_ms)
            pipe.sadd(PINS_KEY, pin.pin_id)
            await pipe.execute()

    async def get_pin(self, pin_id: PinId) -> PinSpec | None:
        raw = await self._redis.get(PIN_PREFIX + pin_id)
        return PinSpec.from_json(raw) if raw is not None else None

    async def delete_pins(self, pin_ids: list[PinId]) -> int:
        """Forget pins; how many still existed."""
        if not pin_ids:
            return 0
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(*(PIN_PREFIX + p for p in pin_ids))
            pipe.srem(PINS_KEY, *pin_ids)
            deleted, _ = await pipe.execute()
        return int(deleted)

    async def pins(self) -> list[PinSpec]:
        """Every pin that has not expired (expired ids are dropped from the set on the way)."""
        members = cast("set[bytes]", await self._redis.smembers(PINS_KEY))  # bytes: decode_responses off
        ids = sorted(p.decode() for p in members)
        if not ids:
            return []
        values = await self._redis.mget([PIN_PREFIX + p for p in ids])
        lapsed = [p for p, v in zip(ids, values, strict=True) if v is None]
        if lapsed:
            await self._redis.srem(PINS_KEY, *lapsed)
        return [PinSpec.from_json(v) for v in values if v is not None]
