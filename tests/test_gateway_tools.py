"""Tool-call parsers (whole and streamed), streamed JSON arguments and the tools prompt block (pure)."""

from __future__ import annotations

import json

import pytest

from kvtier.domain.errors import ConfigError
from kvtier.gateway.json_prefix import ObjectPrefix
from kvtier.gateway.text import ChatText
from kvtier.gateway.tool_parsers import (
    PARSERS,
    ArgumentsDelta,
    CallStart,
    HermesParser,
    Llama3Parser,
    ParsedOutput,
    get_parser,
    json_object_end,
    parse,
    parser_format,
    select_parser,
)
from kvtier.gateway.tool_prompt import (
    TOOLS_PREAMBLE,
    forced_arguments_opening,
    template_messages,
)
from kvtier.local import real_model

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def test_registry_has_hermes_and_llama3():
    assert {"hermes", "llama3"} <= set(PARSERS)
    with pytest.raises(KeyError, match="hermes"):
        get_parser("nope")


def test_hermes_parses_parallel_calls_with_distinct_ids():
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    out = parse("hermes", text)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("weather", {"city": "Oslo"}), ("time", {})]
    assert len({c.id for c in out.tool_calls}) == 2 and all(c.id.startswith("call_") for c in out.tool_calls)
    assert out.text == "Let me check." and out.num_unparsed == 0
    assert out.tool_calls[0].as_openai()["type"] == "function"


@pytest.mark.parametrize("broken", ['<tool_call>{"name": "weather", "argu', "<tool_call>[1, 2]</tool_call>",
                                    '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_unparseable_call_stays_text_and_counts(broken):
    out = parse("hermes", "before " + broken)
    assert out.tool_calls == [] and out.num_unparsed == 1
    assert out.text == "before " + broken


def test_hermes_plain_text_is_untouched():
    out = parse("hermes", "just words {not a call}")
    assert out.text == "just words {not a call}" and not out.tool_calls and out.num_unparsed == 0


def test_llama3_json_calls():
    out = parse("llama3", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("a", {"x": 1}), ("b", {})]
    assert parse("llama3", "hello").tool_calls == []
    bad = parse("llama3", '{"name": "a", "parameters": ')
    assert bad.num_unparsed == 1 and bad.text == '{"name": "a", "parameters": '


@pytest.mark.parametrize(
    ("text", "end"),
    [('{"a": "}"} tail', 10), ('{"a": {"b": [1, 2]}}', 20), ('{"a": "\\"}"', None), ("x{}", None)],
)
def test_json_object_end(text, end):
    assert json_object_end(text) == end


@pytest.mark.parametrize(
    ("written", "arguments"),
    [
        ('{"city": "Oslo"}}\n</tool_call>', '{"city": "Oslo"}'),
        ('{"city": "Oslo", "days": 3, "unit": "cel', '{"city": "Oslo", "days": 3, "unit": "cel"}'),
        ('{"a": {"b": 1, "c"', '{"a": {"b": 1}}'),
        ('{"n": 12', '{"n": 12}'),
        ('{"n": 1.', '{}'),
        ('{"a": [1, tru', '{"a": [1]}'),
        ('{"a": "x\\u00', '{"a": "x"}'),
        ('{"a": "x", }', '{"a": "x"}'),
        ('{"a": "q\\"", "b": null} tail', '{"a": "q\\"", "b": null}'),
    ],
)
def test_streamed_arguments_stay_a_prefix_and_close_into_one_object(written, arguments):
    obj = ObjectPrefix()
    sent = []
    for ch in written:  # one character at a time, as the worst tokenizer would
        text, used = obj.feed(ch)
        sent.append(text)
        if used == 0:
            break
    joined = "".join(sent) + obj.closing()
    assert joined == arguments and isinstance(json.loads(joined), dict)
    assert arguments.startswith("".join(sent))


def _streamed(name, deltas):
    parser = get_parser(name)
    events = [e for d in deltas for e in parser.feed(d)] + parser.finish()
    out = ParsedOutput()
    out.add(events)
    out.num_unparsed = parser.num_unparsed
    return events, out


@pytest.mark.parametrize(("name", "text"), [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "d": [1, 2.5]}}\n'
               '</tool_call>\n<tool_call>{"arguments": {}, "name": "time"}</tool_call>'),
    ("hermes", 'x < y <tool_call>{"name": "w", "arguments": {"q": "a\\"b'),
    ("hermes", "before <tool_call>[1, 2]</tool_call> after"),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {"x": "y z"}};\n{"name": "b", "parameters": {}}'),
    ("llama3", "plain {text}"),
])
def test_streamed_parse_equals_the_whole_parse_however_the_text_is_split(name, text):
    whole = parse(name, text)
    for size in (1, 2, 3, 7):
        _, out = _streamed(name, [text[i:i + size] for i in range(0, len(text), size)])
        assert out.text == whole.text and out.num_unparsed == whole.num_unparsed
        assert [(c.name, c.arguments) for c in out.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    for c in whole.tool_calls:
        assert isinstance(json.loads(c.arguments), dict)


def test_a_call_streams_its_name_then_its_arguments_as_they_are_written():
    parser = get_parser("hermes")
    assert parser.feed("Sure. <tool_") == ["Sure."]
    assert parser.feed('call>\n{"name": "wea') == []  # not yet known to be a call
    start, opened = parser.feed('ther", "arguments": {"ci')
    assert isinstance(start, CallStart) and start.name == "weather" and start.index == 0
    assert opened == ArgumentsDelta(0, "{")  # the key is held until its value begins
    assert parser.feed('ty": "Os') == [ArgumentsDelta(0, '"city": "Os')]
    assert parser.feed('lo"}}\n</tool_call>') == [ArgumentsDelta(0, 'lo"}')]
    assert parser.finish() == [] and parser.num_calls == 1


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
    assert HermesParser.call_opening("weather") == '<tool_call>\n{"name": "weather", "arguments": '
    assert forced_arguments_opening({"function": {"parameters": {"required": ["city"]}}}) == '{"city": '
    assert forced_arguments_opening(WEATHER) == ""
    city = {"function": {"parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    assert forced_arguments_opening(city) == '{"city": "'


# Chat template excerpts as the checkpoints ship them (Jinja source).
QWEN25_TEMPLATE = (
    '{%- if tools %}{{- "\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}{%- endif %}')
LLAMA31_TEMPLATE = (
    "{%- if tools_in_user_message and not tools is none %}{{- 'Respond in the format {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}.' }}{%- endif %}"
    "{%- if builtin_tools is defined %}{{- '<|python_tag|>' + tool_call.name }}{%- endif %}")


@pytest.mark.parametrize(("template", "expected"), [
    (QWEN25_TEMPLATE, "hermes"),
    (LLAMA31_TEMPLATE, "llama3"),
    ("{{ '<|python_tag|>' }}", "llama3"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "hermes"),  # no tools: the gateway's own block
    (None, "hermes"),
    ({"default": LLAMA31_TEMPLATE, "rag": "{{ x }}"}, "llama3"),  # a tokenizer's named templates
])
def test_the_chat_template_selects_the_tool_parser(template, expected):
    assert select_parser(template) == expected


def test_an_explicit_tool_parser_wins_and_an_unknown_one_lists_the_registered():
    assert select_parser(QWEN25_TEMPLATE, "llama3") == "llama3"
    for bad in ("mistral", ""):
        with pytest.raises(ConfigError, match="registered: hermes, llama3") as err:
            select_parser(LLAMA31_TEMPLATE, bad)
        assert err.value.field == "tool_parser"
    assert parser_format("llama3") is Llama3Parser


def test_the_bundled_smollm2_template_selects_hermes():
    checkpoint = real_model.default_cache_dir()
    if not (checkpoint / "tokenizer.json").exists():
        pytest.skip("the bundled SmolLM2 checkpoint is not converted (make setup converts it)")
    assert select_parser(ChatText.load(checkpoint).tokenizer.chat_template) == "hermes"


def test_llama3_format_forces_renders_and_parses_its_own_calls():
    opening = Llama3Parser.call_opening("weather", '{"city": "')
    assert opening == '{"name": "weather", "parameters": {"city": "'
    out = parse("llama3", opening + 'Oslo"}}')
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("weather", {"city": "Oslo"})]
    assert parse("llama3", Llama3Parser.required_opening + '"time", "parameters": {}}').tool_calls[0].name == "time"
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]}]
    out_messages = template_messages(messages, [WEATHER], template_has_tools=False, fmt=Llama3Parser)
    assert out_messages[2]["content"] == '{"name": "weather", "parameters": {"city": "Oslo"}}'
    assert out_messages[0]["content"].endswith(Llama3Parser.instruction) and "<tool_call>" not in out_messages[0]["content"]
    assert parse("hermes", HermesParser.call_text("w", "{}")).tool_calls[0].name == "w"
