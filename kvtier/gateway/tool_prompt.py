"""How tools reach the prompt, and how past tool calls are rendered back into it.

A chat template that renders ``tools`` itself gets them as they are. Otherwise the gateway
adds this system block (the Hermes convention the SmolLM and Qwen2.5 families were trained
on), after the caller's own system message when there is one::

    You may call one or more functions to assist with the user query.
    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {...}}
    </tools>
    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

An assistant message's ``tool_calls`` become ``<tool_call>`` blocks in its content, and a
``tool`` message keeps the ``tool`` role, for templates that only render ``content``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvtier.gateway.tool_parsers import HERMES_CLOSE, HERMES_OPEN

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_system_block(tools: Sequence[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_PREAMBLE + listed + TOOLS_POSTAMBLE


def hermes_call_text(name: str, arguments: str) -> str:
    return f'{HERMES_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{HERMES_CLOSE}'


def forced_arguments_opening(tool: dict[str, Any]) -> str:
    """The start of a forced call's arguments object: ``{"<first required parameter>": `` when
    the schema requires one (with the opening quote when that parameter is a string), else
    empty. Writing the key for the model keeps a small model on the parameters instead of
    echoing the schema."""
    parameters = tool.get("function", {}).get("parameters") or {}
    required = parameters.get("required") or []
    if not required or not isinstance(required[0], str):
        return ""
    schema = (parameters.get("properties") or {}).get(required[0]) or {}
    quote = '"' if isinstance(schema, dict) and schema.get("type") == "string" else ""
    return "{" + json.dumps(required[0]) + ": " + quote


def forced_call_opening(name: str, arguments_opening: str = "") -> str:
    """The text the gateway places at the start of the assistant's turn to force a call to
    ``name``; the model continues the arguments object from ``arguments_opening``."""
    return f'{HERMES_OPEN}\n{{"name": {json.dumps(name)}, "arguments": ' + arguments_opening


def template_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, *, template_has_tools: bool
) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: content as one string, tool calls as text,
    and the tools block in the system message when the template does not render tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls") and not template_has_tools:
            calls = [hermes_call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = "\n".join([content, *calls]) if content else "\n".join(calls)
            out.append({"role": m["role"], "content": content})
        elif m.get("tool_calls"):
            out.append({"role": m["role"], "content": content, "tool_calls": m["tool_calls"]})
        else:
            out.append({"role": m["role"], "content": content})
    if tools and not template_has_tools:
        block = tools_system_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
