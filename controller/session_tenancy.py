"""Which tenant a session belongs to, and which callers may act on it.

A session's tenant is set when the session starts: a Route gives the tenant of the namespace it
names; a Pause gives the caller's only tenant ("" for an admin or with authentication off). A
caller that may not act for a session's tenant is answered as if the session did not exist
(``NotFound``), so the ids of other tenants' sessions leak nothing.
"""

from __future__ import annotations

from kvtier.domain.errors import NotFound
from kvtier.domain.records import SessionId
from kvtier.rpc.auth import Principal


def tenant_of_paused_start(caller: Principal | None, session: SessionId) -> str:
    """The tenant of a session started by a Pause: the caller's only tenant. A token bound to
    several tenants cannot say which, so its sessions start with a Route."""
    if caller is None or not caller.tenants:
        return ""
    if len(caller.tenants) > 1:
        raise NotFound(f"no session {session!r}; a token bound to several tenants starts a session with a "
                       "Route naming its session_id", field="session_id")
    return next(iter(caller.tenants))


def is_visible_to(tenant: str, caller: Principal | None) -> bool:
    """Whether ``caller`` may see and change a session of ``tenant`` (no caller: the controller
    itself; a session without a tenant: everyone)."""
    return caller is None or not tenant or caller.may_act_for(tenant)


def session_not_found(session: SessionId) -> NotFound:
    return NotFound(f"no session {session!r}; a Route or Pause naming it starts one", field="session_id")
