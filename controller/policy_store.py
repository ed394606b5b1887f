"""Versioned tiering policies in Redis, and the version this controller acts on (DESIGN §6).

Storage, in the controller-wide ``{g}`` slot (``controller/leader.py``), so the script
touches one Cluster slot::

    kvt:{g}:policy:current    the newest version number (1, 2, ...)
    kvt:{g}:policy:versions   hash  version -> JSON {policy, set_by, set_at_ms, reason}

Versions are never rewritten: a change (SetPolicy) or a rollback appends ``current + 1``.
One Lua script does every write and the read of the current version, so the steps it
takes are atomic: on an empty store it first installs version 1 (the *seed* policy: whoever
reads first installs it, exactly once), then, for a write, checks ``expected_version``
against the current version and appends.

``PolicyInForce`` is what the policy drives on this controller::

    tier_weights         Router: value of a matched token per tier (``RouterParams.tier_weights``;
                         a missing tier weighs 0)
    budget_bytes_per_s   Orchestrator: the anti-thrash token bucket of each (worker, dram|nvme) link,
                         shared by demotions into that tier and prefetches out of it (a missing tier
                         is unlimited; 0 stops demotions into it; hbm has no bucket, prefetches into
                         HBM are never paced)
    watermarks           Orchestrator: a paused session is parked in a lower tier only while that
                         tier stays at or below its ``high`` watermark (workers demote by their own
                         configured watermarks)
    eviction_policy      recorded only: workers choose their eviction policy at start-up

The leader applies a new version as soon as it is stored; every controller (standbys
too) re-reads the current version every ``REFRESH_INTERVAL_S`` and applies it when it
changed, so a standby that takes over acts on the stored current version, and one that
starts loads it before serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvtier.controller.leader import GLOBAL_PREFIX
from kvtier.controller.redis_connect import RedisClient
from kvtier.controller.resync import REDIS_ERRORS, describe
from kvtier.domain.errors import FailedPrecondition, NotFound, Unavailable
from kvtier.domain.records import Policy, RollbackPolicyRequest, SetPolicyRequest, VersionedPolicy, Watermarks
from kvtier.domain.tiers import Tier
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.policy")

CURRENT_KEY = GLOBAL_PREFIX + "policy:current"
VERSIONS_KEY = GLOBAL_PREFIX + "policy:versions"
SEED_SET_BY = "kvtier"
REFRESH_INTERVAL_S = 1.0

# KEYS: current, versions. ARGV: seed record, expected version ('' = any), new record ('' = read).
# Returns {current version, outcome, current record}; outcome 1 appended, 0 read, -1 stale.
_WRITE = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur == 0 then
  redis.call('HSET', KEYS[2], '1', ARGV[1])
  redis.call('SET', KEYS[1], '1')
  cur = 1
end
local outcome = 0
if ARGV[3] ~= '' then
  if ARGV[2] ~= '' and tonumber(ARGV[2]) ~= cur then
    outcome = -1
  else
    cur = cur + 1
    redis.call('HSET', KEYS[2], tostring(cur), ARGV[3])
    redis.call('SET', KEYS[1], tostring(cur))
    outcome = 1
  end
end
return {cur, outcome, redis.call('HGET', KEYS[2], tostring(cur))}
"""


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


def seed_policy(tier_weights: Mapping[Tier, float], budget_bytes_per_s: Mapping[Tier, float]) -> Policy:
    """``Policy.default()`` with the controller's configured tier weights and budgets, so version 1
    describes what the controller did before anyone set a policy (configuration seeds version 1
    only; once a version is stored, the store wins)."""
    return dataclasses.replace(
        Policy.default(),
        tier_weights=dict(tier_weights),
        budget_bytes_per_s={tier: int(rate) for tier, rate in budget_bytes_per_s.items()},
    )


# ---- Redis form ---------------------------------------------------------------------------------


def _encode(policy: Policy, *, set_by: str, set_at_ms: int, reason: str) -> str:
    return json.dumps({
        "policy": {
            "watermarks": {t.label: {"high": w.high, "low": w.low} for t, w in policy.watermarks.items()},
            "tier_weights": {t.label: w for t, w in policy.tier_weights.items()},
            "budget_bytes_per_s": {t.label: b for t, b in policy.budget_bytes_per_s.items()},
            "eviction_policy": policy.eviction_policy,
        },
        "set_by": set_by,
        "set_at_ms": set_at_ms,
        "reason": reason,
    }, sort_keys=True)


def _decode(version: int, raw: bytes | str) -> VersionedPolicy:
    record: dict[str, Any] = json.loads(raw)
    p = record["policy"]
    policy = Policy(
        watermarks={Tier.parse(t): Watermarks(high=w["high"], low=w["low"]) for t, w in p["watermarks"].items()},
        tier_weights={Tier.parse(t): float(w) for t, w in p["tier_weights"].items()},
        budget_bytes_per_s={Tier.parse(t): int(b) for t, b in p["budget_bytes_per_s"].items()},
        eviction_policy=p["eviction_policy"],
    )
    return VersionedPolicy(policy=policy, version=version, set_by=record["set_by"],
                           set_at_ms=int(record["set_at_ms"]), reason=record["reason"])


class PolicyStore:
    """Policy versions in Redis. Redis trouble raises ``Unavailable`` (and is reported to
    ``on_error``, the controller's reachability tracker)."""

    def __init__(
        self,
        client: RedisClient,
        *,
        seed: Policy | None = None,
        clock_ms: Callable[[], int] = wall_clock_ms,
        on_error: Callable[[BaseException], None] = lambda exc: None,
    ) -> None:
        self._client = client
        self._seed = seed or Policy.default()
        self._seed.validate("seed")
        self._clock_ms = clock_ms
        self._on_error = on_error
        self._write = client.register_script(_WRITE)

    async def current(self) -> VersionedPolicy:
        """The newest version (installing the seed as version 1 when the store is empty)."""
        version, _, raw = await self._run(self._write_args(None, None))
        return _decode(version, raw)

    async def get(self, version: int | None = None) -> VersionedPolicy:
        """Version ``version`` (None: the current one); ``NotFound`` naming ``version``."""
        current = await self.current()
        if version is None or version == current.version:
            return current
        raw = await self._call(self._client.hget(VERSIONS_KEY, str(version)))
        if raw is None:
            raise NotFound(f"no policy version {version}; versions are 1..{current.version}", field="version")
        return _decode(version, raw)

    async def history(self, limit: int) -> list[VersionedPolicy]:
        """Up to ``limit`` versions, newest first."""
        current = await self.current()
        versions = list(range(current.version - 1, max(0, current.version - limit), -1))
        raws = await self._call(self._client.hmget(VERSIONS_KEY, [str(v) for v in versions])) if versions else []
        return [current, *(_decode(v, raw) for v, raw in zip(versions, raws, strict=True) if raw is not None)]

    async def set(self, request: SetPolicyRequest, *, set_by: str) -> VersionedPolicy:
        """Validate and append ``request.policy`` as the newest version.

        ``FailedPrecondition`` naming ``expected_version`` when it is set and not the
        current version (checked and appended in one atomic step)."""
        request.policy.validate("policy")
        new = _encode(request.policy, set_by=set_by, set_at_ms=self._clock_ms(), reason=request.reason)
        version, outcome, raw = await self._run(self._write_args(request.expected_version, new))
        if outcome < 0:
            raise FailedPrecondition(
                f"expected_version is {request.expected_version} but the current policy version is {version}; "
                "read it again (GetPolicy) and retry",
                field="expected_version",
            )
        return _decode(version, raw)

    async def rollback(self, request: RollbackPolicyRequest, *, set_by: str) -> VersionedPolicy:
        """Append a copy of version ``to_version``'s policy; ``NotFound`` naming ``to_version``."""
        try:
            old = await self.get(request.to_version)
        except NotFound as err:
            raise NotFound(err.message, field="to_version") from None
        reason = request.reason or f"rollback to version {old.version}"
        return await self.set(SetPolicyRequest(old.policy, reason=reason), set_by=set_by)

    def _write_args(self, expected: int | None, new: str | None) -> list[str]:
        seed = _encode(self._seed, set_by=SEED_SET_BY, set_at_ms=self._clock_ms(), reason="seed policy")
        return [seed, "" if expected is None else str(expected), new or ""]

    async def _run(self, args: list[str]) -> tuple[int, int, bytes]:
        version, outcome, raw = await self._call(self._write(keys=[CURRENT_KEY, VERSIONS_KEY], args=args))
        return int(version), int(outcome), raw

    async def _call(self, call: Any) -> Any:
        try:
            return await call
        except REDIS_ERRORS as exc:
            self._on_error(exc)
            raise Unavailable(
                f"the policy store (Redis) is unreachable: {describe(exc)}; retry when `kvtier status` "
                "shows it reachable"
            ) from None


class PolicyInForce:
    """The policy version this controller acts on (module docstring); ``apply`` callbacks
    receive every version that comes into force, in order. One event loop owns it."""

    def __init__(self, store: PolicyStore, apply: Sequence[Callable[[Policy], None]]) -> None:
        self.store = store
        self._apply = tuple(apply)
        self._lock = asyncio.Lock()  # a refresh that read an older version never applies it late
        self.versioned: VersionedPolicy | None = None  # None until the first read succeeds

    @property
    def version(self) -> int:
        """The version in force; 0 before one was read."""
        return self.versioned.version if self.versioned is not None else 0

    async def refresh(self) -> VersionedPolicy:
        async with self._lock:
            self._enforce(await self.store.current())
            assert self.versioned is not None
            return self.versioned

    async def set(self, request: SetPolicyRequest, *, set_by: str) -> VersionedPolicy:
        async with self._lock:
            return self._enforce(await self.store.set(request, set_by=set_by))

    async def rollback(self, request: RollbackPolicyRequest, *, set_by: str) -> VersionedPolicy:
        async with self._lock:
            return self._enforce(await self.store.rollback(request, set_by=set_by))

    async def run(self, interval_s: float = REFRESH_INTERVAL_S) -> None:
        """Re-read the current version forever (the store reports Redis trouble itself)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except Unavailable:
                pass
            except Exception as exc:  # a bug: keep refreshing rather than lose the loop silently
                log.error("policy refresh failed", exc_info=exc)

    def _enforce(self, versioned: VersionedPolicy) -> VersionedPolicy:
        # Compared whole, not by number: a Redis that lost its data restarts at version 1.
        if versioned != self.versioned:
            for apply in self._apply:
                apply(versioned.policy)
            self.versioned = versioned
            log.info("policy in force", extra={"policy_version": versioned.version, "set_by": versioned.set_by})
        return versioned
