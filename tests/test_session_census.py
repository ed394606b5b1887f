"""The controller's census of live sessions by (tenant, id): the per-tenant cap, which tenants
have a live id, and forgetting what expired."""

from __future__ import annotations

import pytest

from kvtier.controller.session_census import SessionCensus
from kvtier.controller.session_tenancy import SessionKey
from kvtier.domain.errors import ResourceExhausted
from kvtier.domain.records import SessionId, SessionState


def key(tenant: str, session: str) -> SessionKey:
    return SessionKey(tenant, SessionId(session))


def test_a_tenant_at_its_cap_starts_no_session_but_its_live_ones_go_on():
    now = [0.0]
    census = SessionCensus(ttl_s=60, clock_ms=lambda: now[0], max_per_tenant=2)
    census.admit(key("a", "s1"))
    census.admit(key("a", "s2"))
    census.admit(key("a", "s1"))  # live: always may
    with pytest.raises(ResourceExhausted, match="max_sessions_per_tenant") as info:
        census.admit(key("a", "s3"))
    assert info.value.field == "session_id"
    census.admit(key("b", "s3"))  # another tenant's cap is its own
    census.note(key("a", "s2"), SessionState.ENDED)
    census.admit(key("a", "s3"))
    assert census.num_live("a") == 2 and census.live_tenants(SessionId("s3")) == {"a", "b"}


def test_expired_sessions_are_forgotten_and_free_their_place():
    now = [0.0]
    census = SessionCensus(ttl_s=60, clock_ms=lambda: now[0], max_per_tenant=1)
    census.note(key("a", "s1"), SessionState.PAUSED)
    now[0] += 61_000
    census.admit(key("a", "s2"))  # s1 expired in Redis: forgotten here, its place free
    assert census.live_tenants(SessionId("s1")) == frozenset() and len(census) == 1
    assert census.counts()[SessionState.ACTIVE] == 1
