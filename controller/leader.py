"""Leader lease: which controller may write the directory, and its fencing token.

One key holds the lease (``SET NX PX`` semantics, renewed by compare-and-renew); a counter
next to it is bumped on every acquisition, and that number is the leader's *fencing token*.
Every directory write carries the token and is refused once a newer leader exists
(``controller/directory.py``), so a deposed controller that wakes up from a pause cannot
write even before it notices it lost the lease.

Both keys share the ``{g}`` hash tag with the directory's controller-wide keys, so the
registry scripts compare a token with the epoch in the same Cluster slot.

Lease contract: a holder is leader until ``expires_at_ms`` on *its own* monotonic clock,
computed from the time it *sent* the acquire/renew request, so it steps down no later than
Redis expires the key (client clocks may drift; keep ``ttl_ms`` well above the renew period).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from redis.exceptions import NoScriptError
from redis.typing import EncodableT

from kvtier.controller.redis_connect import REDIS_ERRORS, RedisClient

GLOBAL_PREFIX = "kvt:{g}:"
"""Prefix of every controller-wide key; the ``{g}`` hash tag keeps them in one Cluster slot."""
LEADER_KEY = GLOBAL_PREFIX + "leader"
LEADER_EPOCH_KEY = GLOBAL_PREFIX + "leader_epoch"

log = logging.getLogger(__name__)

# KEYS: lease, epoch. ARGV: owner, ttl_ms, min_token. -> {1, token} | {0, current value}
# The token is above min_token, the highest the caller has seen: a Redis Cluster failover may
# lose the latest INCR while the namespaces' fences (other slots) keep the token it gave out.
_ACQUIRE = """
local held = redis.call('GET', KEYS[1])
if held then
  return {0, held}
end
local token = redis.call('INCR', KEYS[2])
local min_token = tonumber(ARGV[3])
if token <= min_token then
  token = min_token + 1
  redis.call('SET', KEYS[2], token)
end
redis.call('SET', KEYS[1], token .. ':' .. ARGV[1], 'PX', ARGV[2])
return {1, token}
"""
# KEYS: lease. ARGV: expected value, ttl_ms. -> 1 renewed | 0 lost
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
# KEYS: lease. ARGV: expected value. -> 1 released | 0 not ours
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


def _monotonic_ms() -> float:
    return time.monotonic() * 1000.0


@dataclass(frozen=True, slots=True)
class Leadership:
    """One term of one controller: ``token`` is the fencing token for every directory write."""

    owner: str
    token: int


class LeaderLease:
    """Acquire, renew and release the controller leader lease.

    Not safe for concurrent use by several tasks of one process; ``run`` is the usual driver.
    """

    def __init__(
        self,
        client: RedisClient,
        owner: str,
        *,
        ttl_ms: int = 3000,
        clock_ms: Callable[[], float] = _monotonic_ms,
    ) -> None:
        if ttl_ms < 10:
            raise ValueError(f"ttl_ms must be >= 10, got {ttl_ms}")
        self._client = client
        self.owner = owner
        self.ttl_ms = ttl_ms
        self._clock_ms = clock_ms
        self._term: Leadership | None = None
        self._expires_at_ms = 0.0
        self.highest_token = 0  # the highest fencing token seen (own terms and other holders')
        self._scripts = {name: client.register_script(src) for name, src in
                         (("acquire", _ACQUIRE), ("renew", _RENEW), ("release", _RELEASE))}

    @property
    def term(self) -> Leadership | None:
        """The current term while the local lease deadline has not passed, else ``None``."""
        if self._term is not None and self._clock_ms() < self._expires_at_ms:
            return self._term
        return None

    @property
    def is_leader(self) -> bool:
        return self.term is not None

    async def _call(self, name: str, keys: list[str], args: list[EncodableT]) -> Any:
        """The script's reply, shaped by the script."""
        script = self._scripts[name]
        try:
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self._client.script_load(script.script)
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)

    def _value(self, term: Leadership) -> str:
        return f"{term.token}:{term.owner}"

    async def try_acquire(self) -> Leadership | None:
        """Become leader if nobody holds the lease; ``None`` when another controller does."""
        sent_ms = self._clock_ms()
        won, value = await self._call("acquire", [LEADER_KEY, LEADER_EPOCH_KEY],
                                      [self.owner, self.ttl_ms, self.highest_token])
        if not won:
            self._see(cast(bytes, value))
            return None
        self._term = Leadership(self.owner, int(value))
        self.highest_token = max(self.highest_token, self._term.token)
        self._expires_at_ms = sent_ms + self.ttl_ms
        log.info("leader lease acquired by %s, fencing token %d", self.owner, self._term.token)
        return self._term

    async def renew(self) -> bool:
        """Extend this term; ``False`` (and the term is over) when the lease was lost or taken."""
        term = self._term
        if term is None:
            return False
        sent_ms = self._clock_ms()
        if sent_ms >= self._expires_at_ms:
            self._term = None
            log.warning("leader lease of %s expired locally before renewal (token %d)", self.owner, term.token)
            return False
        renewed = await self._call("renew", [LEADER_KEY], [self._value(term), self.ttl_ms])
        if not renewed:
            self._term = None
            log.warning("leader lease of %s lost (token %d)", self.owner, term.token)
            return False
        self._expires_at_ms = sent_ms + self.ttl_ms
        return True

    async def release(self) -> bool:
        """Give the lease up now (on shutdown) so a standby need not wait for it to expire."""
        term, self._term = self._term, None
        if term is None:
            return False
        return bool(await self._call("release", [LEADER_KEY], [self._value(term)]))

    async def current(self) -> Leadership | None:
        """Whoever holds the lease in Redis right now (any controller), or ``None``."""
        value = await self._client.get(LEADER_KEY)
        if value is None:
            return None
        return self._see(cast(bytes, value))  # bytes: the client leaves decode_responses off

    def _see(self, value: bytes) -> Leadership:
        """The lease value ``token:owner`` as a term; remembers its token."""
        token, _, owner = value.decode().partition(":")
        self.highest_token = max(self.highest_token, int(token))
        return Leadership(owner, int(token))

    async def run(
        self,
        stop: asyncio.Event,
        *,
        on_elected: Callable[[Leadership], Awaitable[None]] | None = None,
        on_deposed: Callable[[Leadership], Awaitable[None]] | None = None,
        period_ms: float | None = None,
    ) -> None:
        """Campaign and renew every ``period_ms`` (default ttl/3) until ``stop`` is set.

        ``on_deposed`` runs when a term ends for any reason, including a Redis outage that
        outlasts the local deadline; on stop the lease is released.
        """
        period_s = (period_ms if period_ms is not None else self.ttl_ms / 3) / 1000.0
        held: Leadership | None = None
        try:
            while not stop.is_set():
                try:
                    if held is None:
                        held = await self.try_acquire()
                        if held is not None and on_elected is not None:
                            await on_elected(held)
                    elif not await self.renew():
                        lost, held = held, None
                        if on_deposed is not None:
                            await on_deposed(lost)
                except REDIS_ERRORS as exc:
                    log.warning("leader lease: Redis error (%s); retrying", exc)
                    if held is not None and self.term is None:
                        lost, held = held, None
                        if on_deposed is not None:
                            await on_deposed(lost)
                try:
                    await asyncio.wait_for(stop.wait(), timeout=period_s)
                except TimeoutError:
                    pass
        finally:
            if held is not None:
                try:
                    await self.release()
                except REDIS_ERRORS as exc:
                    log.warning("leader lease: release failed (%s); it expires in %d ms", exc, self.ttl_ms)
                if on_deposed is not None:
                    await on_deposed(held)
