"""The session rule of the gateway (pure): ids from the header or the conversation's
opening, pauses on tool calls, returns when every call id has its result."""

from __future__ import annotations

from kvtier.gateway.sessions import is_returning, pause_after, session_id_for

SYSTEM = {"role": "system", "content": "You are an agent."}
USER = {"role": "user", "content": "Find the weather."}


def call(call_id: str, name: str = "weather") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


def test_header_wins():
    assert session_id_for("acme", [SYSTEM, USER], "my-session") == "my-session"


def test_every_turn_of_a_conversation_maps_to_one_session():
    first = session_id_for("acme", [SYSTEM, USER])
    later = session_id_for("acme", [SYSTEM, USER, {"role": "assistant", "tool_calls": [call("c1")]},
                                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert first == later and first.startswith("conv-")


def test_tenant_and_opening_change_the_session():
    base = session_id_for("acme", [SYSTEM, USER])
    assert session_id_for("other", [SYSTEM, USER]) != base
    assert session_id_for("acme", [SYSTEM, {"role": "user", "content": "Something else."}]) != base
    assert session_id_for("acme", [USER]) != base


def test_pause_names_the_first_function_and_honours_expected_ms():
    pause = pause_after([call("c1", "search"), call("c2", "fetch")], expected_ms=1500)
    assert (pause.tool, pause.call_ids, pause.expected_ms) == ("search", ("c1", "c2"), 1500)
    assert pause_after([]) is None


def test_return_closes_only_when_every_parallel_call_is_answered():
    asked = [SYSTEM, USER, {"role": "assistant", "content": None, "tool_calls": [call("c1"), call("c2")]}]
    one = asked + [{"role": "tool", "tool_call_id": "c1", "content": "a"}]
    both = one + [{"role": "tool", "tool_call_id": "c2", "content": "b"}]
    assert not is_returning(asked)
    assert not is_returning(one)
    assert is_returning(both)
    assert not is_returning([SYSTEM, USER])
    assert not is_returning(both + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "ok"}])
