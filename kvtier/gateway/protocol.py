"""OpenAI request bodies checked into typed requests; every refusal names its parameter.

Accepted (issue 41): ``messages`` (system, user, assistant with ``tool_calls``, tool;
content a string or ``text`` parts), ``tools``, ``tool_choice`` (``none``, ``auto``,
``required``, a named function), ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop`` (strings), ``n`` = 1, ``user``, ``stream``,
``stream_options.include_usage``. Any other parameter with a non-default value is a 400
naming it, so a client never silently gets behaviour it did not ask for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.gateway.errors import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4
DEFAULT_MAX_TOKENS = 256
# Parameters OpenAI defines that the gateway ignores when they carry their default value.
_IGNORED_AT_DEFAULT = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False,
                       "parallel_tool_calls": True, "store": False, "metadata": None}


@dataclass(slots=True)
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    sampling: Sampling
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"  # none | auto | required | the forced function's name (forced=True)
    is_forced: bool = False
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


@dataclass(slots=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _type(body: dict[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad(name, f"{name} must be {what}, got a boolean", "invalid_type")
    if not isinstance(value, types):
        raise bad(name, f"{name} must be {what}, got {type(value).__name__}", "invalid_type")
    return value


def _sampling(body: dict[str, Any], *, chat: bool) -> Sampling:
    n = _type(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise bad("n", f"n must be 1 (one choice per request), got {n}")
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = None
    for name in names:
        value = _type(body, name, int, "an integer")
        if value is not None and value < 1:
            raise bad(name, f"{name} must be >= 1, got {value}")
        max_tokens = value if max_tokens is None else max_tokens
    temperature = _type(body, "temperature", (int, float), "a number")
    if temperature is not None and not 0 <= temperature <= 2:
        raise bad("temperature", f"temperature must be in [0, 2], got {temperature}")
    top_p = _type(body, "top_p", (int, float), "a number")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad("top_p", f"top_p must be in (0, 1], got {top_p}")
    seed = _type(body, "seed", int, "an integer")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    return Sampling(max_tokens, 1.0 if temperature is None else float(temperature),
                    1.0 if top_p is None else float(top_p), seed, tuple(stop))


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_type(body, "stream", bool, "a boolean"))
    options = _type(body, "stream_options", dict, "an object") or {}
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad("stream_options.include_usage", "stream_options.include_usage must be a boolean", "invalid_type")
    return stream, include


def _refuse_unknown(body: dict[str, Any], known: set[str]) -> None:
    for name, value in body.items():
        if name in known or (name in _IGNORED_AT_DEFAULT and value == _IGNORED_AT_DEFAULT[name]):
            continue
        raise bad(name, f"parameter {name} is not supported by this server", "unsupported_parameter")


def _content(value: Any, where: str, *, allow_none: bool) -> str | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}[{j}].type", f"content part type {kind!r} is not supported; only text parts")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(where, f"{where} must be a string or a list of text parts", "invalid_type")


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise bad("messages", "messages is required", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise bad("messages", "messages must be a non-empty list", "invalid_type")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        message: dict[str, Any] = {"role": "system" if role == "developer" else role}
        calls = m.get("tool_calls") if role == "assistant" else None
        message["content"] = _content(m.get("content"), f"{where}.content", allow_none=role == "assistant")
        if calls:
            message["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        elif message["content"] is None:
            raise bad(f"{where}.content", f"{where}.content is required without tool_calls")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id is required for a tool message")
            message["tool_call_id"] = call_id
        out.append(message)
    return out


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad(where, f"{where} must be a list", "invalid_type")
    calls = []
    for k, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
            raise bad(f"{where}[{k}]", f"{where}[{k}] must have an id and a function with a name", "invalid_type")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise bad(f"{where}[{k}].function.arguments", "function.arguments must be a JSON string", "invalid_type")
        calls.append({"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return calls


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("tools", "tools must be a list", "invalid_type")
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
    return value


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str, bool]:
    if value is None:
        return ("auto" if tools else "none"), False
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise bad("tool_choice", f"tool_choice {value!r} needs tools")
        return value, False
    name = value.get("function", {}).get("name") if isinstance(value, dict) else None
    if not isinstance(name, str):
        raise bad("tool_choice", "tool_choice must be none, auto, required or {'type': 'function', "
                                 "'function': {'name': ...}}", "invalid_type")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
    return name, True


def parse_chat(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object", "invalid_type")
    _refuse_unknown(body, {"model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
                           "temperature", "top_p", "seed", "stop", "n", "user", "stream", "stream_options"})
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required and must be a string", "missing_required_parameter")
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    choice, forced = _tool_choice(body.get("tool_choice"), tools)
    stream, include = _stream(body)
    return ChatRequest(model, messages, _sampling(body, chat=True), tools, choice, forced, stream, include,
                       _type(body, "user", str, "a string"))


def parse_completion(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object", "invalid_type")
    _refuse_unknown(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
                           "user", "stream", "stream_options", "echo"})
    if body.get("echo"):
        raise bad("echo", "echo is not supported", "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required and must be a string", "missing_required_parameter")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    text_or_ids: str | list[int]
    if isinstance(prompt, str) and prompt:
        text_or_ids = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        text_or_ids = prompt
    else:
        raise bad("prompt", "prompt must be a non-empty string or a list of token ids", "invalid_type")
    stream, include = _stream(body)
    return CompletionRequest(model, text_or_ids, _sampling(body, chat=False), stream, include)
