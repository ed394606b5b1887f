"""Session tenancy: the (tenant, id) a Sessions call names, and who may see a session."""

from __future__ import annotations

import pytest

from kvtier.controller.session_tenancy import SessionKey, is_visible_to, key_for_call, session_not_found
from kvtier.domain.errors import FailedPrecondition, NotFound
from kvtier.domain.records import SessionId
from kvtier.rpc.auth import Principal, Role

ADMIN = Principal("admin", Role.ADMIN)
FE_A = Principal("fe-a", Role.FRONTEND, frozenset({"a"}))
FE_AB = Principal("fe-ab", Role.FRONTEND, frozenset({"a", "b"}))
WORKER = Principal("w", Role.WORKER)


def live(*tenants: str):
    return lambda session: frozenset(tenants)


@pytest.mark.parametrize(("caller", "tenant"), [(None, ""), (ADMIN, ""), (FE_A, "a"), (WORKER, "")])
def test_a_call_names_the_callers_only_tenant_or_none(caller: Principal | None, tenant: str) -> None:
    assert key_for_call(caller, SessionId("s1"), live()) == SessionKey(tenant, SessionId("s1"))


def test_a_frontend_names_its_own_tenant_whoever_else_has_the_id() -> None:
    assert key_for_call(FE_A, SessionId("s1"), live("b")) == SessionKey("a", SessionId("s1"))


def test_an_admin_names_the_one_tenant_with_that_live_id() -> None:
    assert key_for_call(ADMIN, SessionId("s1"), live("b")) == SessionKey("b", SessionId("s1"))
    assert key_for_call(None, SessionId("s1"), live("b")) == SessionKey("b", SessionId("s1"))
    with pytest.raises(FailedPrecondition, match="2 tenants") as info:
        key_for_call(ADMIN, SessionId("s1"), live("a", "b"))
    assert info.value.field == "session_id"


def test_a_token_of_several_tenants_names_the_one_with_that_live_id() -> None:
    assert key_for_call(FE_AB, SessionId("s1"), live("b", "c")) == SessionKey("b", SessionId("s1"))
    with pytest.raises(FailedPrecondition):
        key_for_call(FE_AB, SessionId("s1"), live("a", "b"))


def test_a_token_of_several_tenants_cannot_start_a_session_with_a_pause() -> None:
    with pytest.raises(NotFound, match="several tenants") as info:
        key_for_call(FE_AB, SessionId("s1"), live("c"))
    assert info.value.field == "session_id"


@pytest.mark.parametrize(
    ("tenant", "owner", "caller", "visible"),
    [
        ("a", "", None, True),
        ("a", "", ADMIN, True),
        ("a", "", FE_A, True),
        ("b", "", FE_A, False),
        ("", "", FE_A, False),  # a session without a tenant is its owner's
        ("", "fe-ab", FE_A, False),
        ("", "fe-a", FE_A, True),
        ("", "fe-a", ADMIN, True),
        ("b", "", FE_AB, True),
        ("a", "", WORKER, False),
    ],
)
def test_a_session_is_visible_to_callers_that_may_act_for_its_tenant_or_own_it(
    tenant: str, owner: str, caller: Principal | None, visible: bool
) -> None:
    assert is_visible_to(tenant, caller, owner) is visible


def test_not_found_names_the_session_and_how_to_start_it() -> None:
    err = session_not_found(SessionId("s9"))
    assert "'s9'" in str(err) and "Route or Pause" in str(err) and err.field == "session_id"
