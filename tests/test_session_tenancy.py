"""Session tenancy: the tenant a Pause starts a session with, and who may see a session."""

from __future__ import annotations

import pytest

from kvtier.controller.session_tenancy import is_visible_to, session_not_found, tenant_of_paused_start
from kvtier.domain.errors import NotFound
from kvtier.domain.records import SessionId
from kvtier.rpc.auth import Principal, Role

ADMIN = Principal("admin", Role.ADMIN)
FE_A = Principal("fe-a", Role.FRONTEND, frozenset({"a"}))
FE_AB = Principal("fe-ab", Role.FRONTEND, frozenset({"a", "b"}))
WORKER = Principal("w", Role.WORKER)


@pytest.mark.parametrize(("caller", "tenant"), [(None, ""), (ADMIN, ""), (FE_A, "a"), (WORKER, "")])
def test_a_pause_starts_a_session_of_the_callers_only_tenant(caller: Principal | None, tenant: str) -> None:
    assert tenant_of_paused_start(caller, SessionId("s1")) == tenant


def test_a_token_of_several_tenants_cannot_start_a_session_with_a_pause() -> None:
    with pytest.raises(NotFound, match="several tenants") as info:
        tenant_of_paused_start(FE_AB, SessionId("s1"))
    assert info.value.field == "session_id"


@pytest.mark.parametrize(
    ("tenant", "caller", "visible"),
    [
        ("a", None, True),
        ("a", ADMIN, True),
        ("a", FE_A, True),
        ("b", FE_A, False),
        ("", FE_A, True),
        ("b", FE_AB, True),
        ("a", WORKER, False),
    ],
)
def test_a_session_is_visible_to_callers_that_may_act_for_its_tenant(
    tenant: str, caller: Principal | None, visible: bool
) -> None:
    assert is_visible_to(tenant, caller) is visible


def test_not_found_names_the_session_and_how_to_start_it() -> None:
    err = session_not_found(SessionId("s9"))
    assert "'s9'" in str(err) and "Route or Pause" in str(err) and err.field == "session_id"
