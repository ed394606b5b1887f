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

Its last lines are the selected format's ``instruction`` (above: ``hermes``; see
``kvtier.gateway.tool_parsers``). An assistant message's ``tool_calls`` become that format's
call text in its content (``<tool_call>`` blocks for hermes), and a ``tool`` message keeps the
``tool`` role, for templates that only render ``content``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvtier.gateway.tool_parsers import HermesParser, ToolParser

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)


def tools_system_block(tools: Sequence[dict[str, Any]], fmt: type[ToolParser] = HermesParser) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_PREAMBLE + listed + "\n</tools>\n" + fmt.instruction


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


def template_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, *, template_has_tools: bool,
    fmt: type[ToolParser] = HermesParser,
) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: content as one string, tool calls as text,
    and the tools block in the system message when the template does not render tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls") and not template_has_tools:
            calls = [fmt.call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = "\n".join([content, *calls]) if content else "\n".join(calls)
            out.append({"role": m["role"], "content": content})
        elif m.get("tool_calls"):
            out.append({"role": m["role"], "content": content, "tool_calls": m["tool_calls"]})
        else:
            out.append({"role": m["role"], "content": content})
    if tools and not template_has_tools:
        block = tools_system_block(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
