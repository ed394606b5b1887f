"""Which tenant a session belongs to, which callers may act on it, and how a call names it.

Sessions are keyed by (tenant, session id) everywhere: the controller's records and locks,
Redis, route affinity and the worker's session map. The same id under two tenants is two
sessions; neither can see, change or squat on the other.

A session's tenant is set when the session starts: a Route gives the tenant of the namespace it
names; a Pause the tenant its call names. Sessions RPCs carry no namespace, so a call names
``(tenant, id)`` through its caller
(``key_for_call``): a frontend's only tenant; among a token's several tenants, the one with a
live session of that id; for an admin (or authentication off), the one tenant this controller
knows a live session of that id under, else the tenant-less session. A session without a tenant
belongs to the credential that started it (``owner``): another frontend's call does not reach it.
A caller that may not act for a session is answered as if the session did not exist
(``NotFound``), so another tenant's session ids leak nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvtier.domain.errors import FailedPrecondition, NotFound
from kvtier.domain.records import SessionId
from kvtier.rpc.auth import Principal, Role


class SessionKey(NamedTuple):
    """What a session is keyed by: its tenant ("" for none) and its id."""

    tenant: str
    session_id: SessionId


def owner_of(caller: Principal | None) -> str:
    """The credential a session started by ``caller`` belongs to ("" with authentication off)."""
    return caller.name if caller is not None else ""


def is_visible_to(tenant: str, caller: Principal | None, owner: str = "") -> bool:
    """Whether ``caller`` may see and change a session of ``tenant`` started by ``owner`` (no
    caller: the controller itself, or authentication off). A session without a tenant is its
    owner's (and an admin's)."""
    if caller is None or caller.role is Role.ADMIN:
        return True
    if tenant:
        return caller.may_act_for(tenant)
    return caller.role is Role.FRONTEND and caller.name == owner


def key_for_call(
    caller: Principal | None, session: SessionId, live_tenants: Callable[[SessionId], frozenset[str]]
) -> SessionKey:
    """The session a Sessions call (Pause, Returning, End) names: see the module doc.
    ``live_tenants``: the tenants this controller knows a live session of that id under."""
    if caller is not None and caller.role is not Role.ADMIN:
        if len(caller.tenants) <= 1:
            return SessionKey(next(iter(caller.tenants), ""), session)
        candidates = sorted(live_tenants(session) & caller.tenants)
    else:
        candidates = sorted(live_tenants(session))
    if not candidates:
        if caller is not None and caller.role is not Role.ADMIN:
            # Several tenants, none with that session: a Pause cannot say which to start it under.
            raise NotFound(f"no session {session!r}; a token bound to several tenants starts a session with a "
                           "Route naming its session_id", field="session_id")
        return SessionKey("", session)
    if len(candidates) > 1:
        raise FailedPrecondition(
            f"session id {session!r} names sessions of {len(candidates)} tenants; act on it with a token bound "
            "to its tenant only", field="session_id")
    return SessionKey(candidates[0], session)


def session_not_found(session: SessionId) -> NotFound:
    return NotFound(f"no session {session!r}; a Route or Pause naming it starts one", field="session_id")
