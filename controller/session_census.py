"""The live sessions this controller knows, by (tenant, id), and the per-tenant cap on them.

Kept in memory from the controller's own writes (and from Redis at start-up,
``Orchestrator.recover``): the state and time of each session's last write. A session
untouched for the store's TTL has expired in Redis and is forgotten here (``forget_idle``).
It answers counts per state without a Redis scan, which tenants have a live session of an id
(how a Sessions call names its session: ``kvtier.controller.session_tenancy.key_for_call``),
and whether a tenant may start another session (``admit``): each tenant may have at most
``max_per_tenant`` live sessions, so one frontend cannot make the controller and Redis keep
an unbounded number of records.

One event loop owns it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.controller.session_tenancy import SessionKey
from kvtier.domain.errors import ResourceExhausted
from kvtier.domain.records import SessionId, SessionState
from kvtier.runtime.config import DEFAULT_MAX_SESSIONS_PER_TENANT


class SessionCensus:
    """Live sessions by (tenant, id): state and last write (clock ms), counts per tenant."""

    def __init__(self, ttl_s: float, clock_ms: Callable[[], float], *,
                 max_per_tenant: int = DEFAULT_MAX_SESSIONS_PER_TENANT) -> None:
        self.ttl_s = ttl_s
        self.max_per_tenant = max_per_tenant
        self._clock_ms = clock_ms
        self._states: dict[SessionKey, tuple[SessionState, float]] = {}
        self._tenants: dict[SessionId, set[str]] = {}
        self._num_per_tenant: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: SessionKey) -> bool:
        return key in self._states

    def num_live(self, tenant: str) -> int:
        return self._num_per_tenant.get(tenant, 0)

    def live_tenants(self, session: SessionId) -> frozenset[str]:
        """The tenants with a live session of id ``session``."""
        return frozenset(self._tenants.get(session, ()))

    def admit(self, key: SessionKey) -> None:
        """Let ``key`` start (or go on: a session already live always may), and count it at once
        so that concurrent starts see it; ``ResourceExhausted`` when its tenant is at the cap."""
        if key in self._states:
            return
        if self.num_live(key.tenant) >= self.max_per_tenant:
            self.forget_idle()
            if self.num_live(key.tenant) >= self.max_per_tenant:
                raise ResourceExhausted(
                    f"tenant {key.tenant!r} has {self.max_per_tenant} live sessions, the cap "
                    "(max_sessions_per_tenant); end sessions that are done (Sessions.End) or raise the cap",
                    field="session_id")
        self.note(key, SessionState.ACTIVE)

    def note(self, key: SessionKey, state: SessionState) -> None:
        """``key`` was written in ``state`` now (ENDED: it is no longer live)."""
        if state is SessionState.ENDED:
            self.forget(key)
            return
        if key not in self._states:
            self._tenants.setdefault(key.session_id, set()).add(key.tenant)
            self._num_per_tenant[key.tenant] = self._num_per_tenant.get(key.tenant, 0) + 1
        self._states[key] = (state, self._clock_ms())

    def forget(self, key: SessionKey) -> None:
        if self._states.pop(key, None) is None:
            return
        tenants = self._tenants[key.session_id]
        tenants.discard(key.tenant)
        if not tenants:
            del self._tenants[key.session_id]
        left = self._num_per_tenant[key.tenant] - 1
        if left:
            self._num_per_tenant[key.tenant] = left
        else:
            del self._num_per_tenant[key.tenant]

    def forget_idle(self) -> list[SessionKey]:
        """Forget the sessions untouched for the store's TTL (expired in Redis); those forgotten."""
        horizon_ms = self._clock_ms() - self.ttl_s * 1000.0
        idle = [k for k, (_, at) in self._states.items() if at < horizon_ms]
        for key in idle:
            self.forget(key)
        return idle

    def counts(self) -> dict[SessionState, int]:
        """Live sessions per state (ENDED: 0)."""
        self.forget_idle()
        counts = dict.fromkeys(SessionState, 0)
        for state, _ in self._states.values():
            counts[state] += 1
        return counts
