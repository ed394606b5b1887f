"""Tool-call parsers, forced-call argument repair and the tools prompt block (pure)."""

from __future__ import annotations

import json

import pytest

from kvtier.gateway.tool_parsers import PARSERS, forced_arguments, get_parser, json_object_end
from kvtier.gateway.tool_prompt import (
    TOOLS_PREAMBLE,
    forced_arguments_opening,
    forced_call_opening,
    template_messages,
)

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def test_registry_has_hermes_and_llama3():
    assert {"hermes", "llama3"} <= set(PARSERS)
    with pytest.raises(KeyError, match="hermes"):
        get_parser("nope")


def test_hermes_parses_parallel_calls_with_distinct_ids():
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    out = get_parser("hermes")(text)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("weather", {"city": "Oslo"}), ("time", {})]
    assert len({c.id for c in out.tool_calls}) == 2 and all(c.id.startswith("call_") for c in out.tool_calls)
    assert out.text == "Let me check." and out.num_unparsed == 0
    assert out.tool_calls[0].as_openai()["type"] == "function"


@pytest.mark.parametrize("broken", ['<tool_call>{"name": "weather", "argu', "<tool_call>[1, 2]</tool_call>",
                                    '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_unparseable_call_stays_text_and_counts(broken):
    out = get_parser("hermes")("before " + broken)
    assert out.tool_calls == [] and out.num_unparsed == 1
    assert out.text == "before " + broken


def test_hermes_plain_text_is_untouched():
    out = get_parser("hermes")("just words {not a call}")
    assert out.text == "just words {not a call}" and not out.tool_calls and out.num_unparsed == 0


def test_llama3_json_calls():
    out = get_parser("llama3")('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("a", {"x": 1}), ("b", {})]
    assert get_parser("llama3")("hello").tool_calls == []
    bad = get_parser("llama3")('{"name": "a", "parameters": ')
    assert bad.num_unparsed == 1 and bad.text == '{"name": "a", "parameters": '


@pytest.mark.parametrize(
    ("text", "end"),
    [('{"a": "}"} tail', 10), ('{"a": {"b": [1, 2]}}', 20), ('{"a": "\\"}"', None), ("x{}", None)],
)
def test_json_object_end(text, end):
    assert json_object_end(text) == end


@pytest.mark.parametrize(
    ("generated", "arguments"),
    [
        (' {"city": "Oslo"}}\n</tool_call>', {"city": "Oslo"}),
        ('{"city": "Oslo", "days": 3, "unit": "cel', {"city": "Oslo", "days": 3}),
        ("not json at all", {}),
        ('{"a": {"b": 1, "c"', {}),
    ],
)
def test_forced_arguments_are_always_a_json_object(generated, arguments):
    assert json.loads(forced_arguments(generated)) == arguments


def test_tools_block_and_calls_rendered_for_a_template_without_tools():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = template_messages(messages, [WEATHER], template_has_tools=False)
    assert out[0]["content"].startswith("Be brief.\n\n" + TOOLS_PREAMBLE)
    assert json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3] == {"role": "tool", "content": "sunny"}
    assert forced_call_opening("weather").endswith('{"name": "weather", "arguments": ')
    assert forced_arguments_opening({"function": {"parameters": {"required": ["city"]}}}) == '{"city": '
    assert forced_arguments_opening(WEATHER) == ""
    city = {"function": {"parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    assert forced_arguments_opening(city) == '{"city": "'


def test_auto_mode_streams_text_up_to_the_first_call_tag():
    from kvtier.gateway.chat import CallScan

    scan = CallScan()
    deltas = ["Let me ", "look <to", "ol_call>\n{", '"name": "w"}', "</tool_call>"]
    streamed = "".join(scan.feed(d) for d in deltas)
    assert streamed == "Let me look "
    assert scan.rest() == '<tool_call>\n{"name": "w"}</tool_call>'
    plain = CallScan()
    assert "".join(plain.feed(d) for d in ["a < b", " and c"]) + plain.rest() == "a < b and c"


@pytest.mark.parametrize("arguments", ["", "{}", '{"city": "Oslo"}', '{"q": "' + "x" * 40 + '"}'])
def test_streamed_argument_fragments_join_to_the_arguments(arguments):
    from kvtier.gateway.chat import ARGUMENT_PIECE_CHARS, argument_pieces

    pieces = argument_pieces(arguments)
    assert "".join(pieces) == arguments
    assert all(0 < len(p) <= ARGUMENT_PIECE_CHARS for p in pieces)
