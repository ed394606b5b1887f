"""Tool calls parsed out of model text, through a registry of formats.

Each parser turns a finished completion into ``ParsedOutput``: the plain text and the
OpenAI ``tool_calls``. A call that opens but does not parse stays in the text and counts
in ``num_unparsed`` (the gateway exports it as a metric), so a small model's broken call
reaches the client as what it is, text.

Formats:
  ``hermes``   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, SmolLM)
  ``llama3``   a bare JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1), one per
               line or ``;``-separated, optionally after ``<|python_tag|>``
Register more with ``@register("name")``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One OpenAI tool call; ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ParsedOutput:
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    num_unparsed: int = 0


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def call_from_object(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """A ``ToolCall`` from a decoded ``{"name", arguments_key}`` object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


ToolParser = Callable[[str], ParsedOutput]
PARSERS: dict[str, ToolParser] = {}


def register(name: str) -> Callable[[ToolParser], ToolParser]:
    def add(parser: ToolParser) -> ToolParser:
        PARSERS[name] = parser
        return parser

    return add


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise KeyError(f"no tool-call parser {name!r}; one of {', '.join(sorted(PARSERS))}") from None


HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
_HERMES_RE = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)


@register("hermes")
def parse_hermes(text: str) -> ParsedOutput:
    out = ParsedOutput(text="")
    kept: list[str] = []
    pos = 0
    for m in _HERMES_RE.finditer(text):
        kept.append(text[pos:m.start()])
        pos = m.end()
        try:
            call = call_from_object(json.loads(m.group(1).strip()))
        except ValueError:
            call = None
        if call is None:
            kept.append(m.group(0))
            out.num_unparsed += 1
        else:
            out.tool_calls.append(call)
    kept.append(text[pos:])
    out.text = "".join(kept).strip() if out.tool_calls else "".join(kept)
    return out


@register("llama3")
def parse_llama3(text: str) -> ParsedOutput:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedOutput(text=text)
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return ParsedOutput(text=text, num_unparsed=1)
        call = call_from_object(obj, "parameters")
        if call is None:
            return ParsedOutput(text=text, num_unparsed=1)
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ParsedOutput(text="", tool_calls=calls)


def json_object_end(text: str) -> int | None:
    """Index just past the first complete top-level JSON object starting at ``text[0]``, or None.

    A scanner over braces outside strings (escapes honoured); it finds where a forced call's
    arguments close while they stream, before the model says anything after them.
    """
    depth = 0
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and not ch.isspace():
            return None
    return None


def forced_arguments(text: str) -> str:
    """Valid JSON object text for a forced call's arguments, from what the model produced.

    The first complete object when it parses as one; otherwise the longest prefix that ends
    at a top-level member boundary, closed (a call cut off by ``max_tokens`` keeps its whole
    members); otherwise ``{}``.
    """
    body = text.lstrip()
    end = json_object_end(body)
    if end is not None:
        try:
            obj = json.loads(body[:end])
            if isinstance(obj, dict):
                return json.dumps(obj, ensure_ascii=False)
        except ValueError:
            pass
    for cut in range(len(body) - 1, 0, -1):
        if body[cut] != ",":
            continue
        try:
            obj = json.loads(body[:cut] + "}")
        except ValueError:
            continue
        if isinstance(obj, dict):
            return json.dumps(obj, ensure_ascii=False)
    return "{}"
