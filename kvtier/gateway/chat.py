"""A chat completion: the prompt from messages and tools, the generation, and the
OpenAI response or chunk stream built from it, with the session hints it implies.

Tool modes (``tool_choice``):
  ``none``      tools stay in the prompt, so a turn that must answer in text (an agent's
                last) keeps the prefix, and the cached pages, of the turns that called
                tools; the output is text, never parsed for calls.
  ``auto``      tools are in the prompt; text streams live up to the first ``<tool_call>``,
                and from there the output is parsed (``hermes`` parser) when the generation
                ends, so tool calls reach a streaming client after it.
  ``required``  as ``auto``, with the assistant turn opened by ``<tool_call>``.
  a function    the assistant turn is opened with that call's name (and the first required
                parameter's key, when the schema has one); the model writes the arguments, the stream ends as soon as one JSON object closes, and the
                arguments are repaired into a valid object when the model breaks them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvtier.client import AsyncClient
from kvtier.domain.errors import KvtierError
from kvtier.domain.params import SamplingParams
from kvtier.gateway import generation, sessions
from kvtier.gateway.errors import ApiError
from kvtier.gateway.generation import Finished
from kvtier.gateway.metrics import GatewayMetrics
from kvtier.gateway.model import ServedModel
from kvtier.gateway.protocol import DEFAULT_MAX_TOKENS, ChatRequest, Sampling
from kvtier.gateway.tool_parsers import (
    HERMES_CLOSE,
    HERMES_OPEN,
    ToolCall,
    forced_arguments,
    get_parser,
    json_object_end,
    new_call_id,
)
from kvtier.gateway.tool_prompt import forced_arguments_opening, forced_call_opening, template_messages
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.gateway.chat")
EXTENSION_KEY = "kvtier"
# Tokens a forced call may run on after its arguments close (typically `}`, a newline and
# `</tool_call>`) for the worker to end it and report its cache accounting.
FORCED_GRACE_TOKENS = 8


@dataclass(slots=True)
class Call:
    """What one request needs besides its body: its client, session scope and hints.

    ``session_scope`` stands for the tenant in the session digest: the hash of the request's
    key, since keys are bound to tenants in the stack's token table."""

    client: AsyncClient
    session_scope: str
    session_header: str | None
    tool_expected_ms: int | None
    metrics: GatewayMetrics


def sampling_params(model: ServedModel, s: Sampling, num_prompt: int) -> SamplingParams:
    room = model.context_tokens - num_prompt
    if room < 1:
        raise ApiError(400, f"the prompt has {num_prompt} tokens; the model's context is {model.context_tokens}",
                       param="messages", code="context_length_exceeded")
    max_tokens = min(s.max_tokens or DEFAULT_MAX_TOKENS, room)
    return SamplingParams(max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                          stop_token_ids=list(model.text.eos_token_ids))


def forced_opening(req: ChatRequest) -> str:
    """The arguments text the gateway writes for a forced call ("" when nothing is forced)."""
    if not req.is_forced:
        return ""
    tool = next(t for t in req.tools if t["function"]["name"] == req.tool_choice)
    return forced_arguments_opening(tool)


def chat_prompt(model: ServedModel, req: ChatRequest) -> str:
    tools = req.tools  # with "none" too: the conversation's prefix, and so its cached pages, stay the same
    messages = template_messages(req.messages, tools, template_has_tools=model.text.supports_tools)
    prompt = model.text.render(messages, tools if model.text.supports_tools else None)
    if req.is_forced:
        prompt += forced_call_opening(req.tool_choice, forced_opening(req))
    elif req.tool_choice == "required":
        prompt += HERMES_OPEN + "\n"
    return prompt


def usage_body(fin: Finished) -> dict[str, Any]:
    u = fin.usage
    body: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": fin.num_generated,
        "total_tokens": u.prompt_tokens + fin.num_generated,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    body[EXTENSION_KEY] = {
        "cached_tokens_by_tier": {"hbm": u.cached_tokens_by_tier.hbm_tokens,
                                  "dram": u.cached_tokens_by_tier.dram_tokens,
                                  "nvme": u.cached_tokens_by_tier.nvme_tokens},
        "promoted_tokens": u.promoted_tokens,
        "recomputed_tokens": u.recomputed_tokens,
        "worker": fin.worker,
        "is_worker_usage": fin.is_worker_usage,
    }
    return body


@dataclass(slots=True)
class ChatResult:
    content: str | None
    tool_calls: list[ToolCall]
    finished: Finished


class ChatCompletion:
    """One chat completion request, run once; ``stream()`` for SSE, ``result()`` for JSON."""

    def __init__(self, model: ServedModel, req: ChatRequest, call: Call) -> None:
        self.model, self.req, self.call = model, req, call
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.session_id = sessions.session_id_for(call.session_scope, req.messages, call.session_header)
        self.prompt_ids = model.text.encode(chat_prompt(model, req))
        self.sampling = sampling_params(model, req.sampling, len(self.prompt_ids))
        if req.is_forced:  # the worker ends a forced call at its closing tag, with its usage
            self.sampling.stop_sequences = [model.text.encode(HERMES_CLOSE)]
        self.is_buffered = req.tool_choice != "none" and bool(req.tools)

    async def _events(self) -> AsyncIterator[str | Finished]:
        if sessions.is_returning(self.req.messages):
            await self._hint(self.call.client.returning(self.session_id))
        opening = forced_opening(self.req)
        until = (lambda text: json_object_end((opening + text).lstrip()) is not None) if self.req.is_forced \
            else None
        stops = () if self.is_buffered else self.req.sampling.stop
        async for event in generation.run(self.call.client, self.model, self.prompt_ids, self.sampling,
                                          stops=stops, session_id=self.session_id, until=until,
                                          grace_tokens=FORCED_GRACE_TOKENS if self.req.is_forced else 0):
            yield event

    async def _hint(self, hint: Any) -> None:
        """Session hints steer prefetch; a refused hint never fails the request."""
        try:
            await hint
        except KvtierError as exc:
            self.call.metrics.session_hints_failed.inc()
            log.warning("session hint refused: %s", type(exc).__name__)

    def _finish(self, text: str, fin: Finished) -> ChatResult:
        if self.req.is_forced:
            call = ToolCall(new_call_id(), self.req.tool_choice, forced_arguments(forced_opening(self.req) + text))
            fin.finish_reason = "tool_calls"
            return ChatResult(None, [call], fin)
        if not self.is_buffered:
            return ChatResult(text, [], fin)
        parsed = get_parser("hermes")((HERMES_OPEN + "\n" if self.req.tool_choice == "required" else "") + text)
        if parsed.num_unparsed:
            self.call.metrics.unparsed_tool_calls.inc(parsed.num_unparsed)
        if parsed.tool_calls:
            fin.finish_reason = "tool_calls"
        return ChatResult(parsed.text or None if parsed.tool_calls else parsed.text, parsed.tool_calls, fin)

    async def _after(self, result: ChatResult) -> None:
        pause = sessions.pause_after([c.as_openai() for c in result.tool_calls], self.call.tool_expected_ms)
        if pause is not None:
            await self._hint(self.call.client.pause(self.session_id, pause.tool, pause.expected_ms))

    async def result(self) -> dict[str, Any]:
        parts: list[str] = []
        fin: Finished | None = None
        async for event in self._events():
            if isinstance(event, Finished):
                fin = event
            else:
                parts.append(event)
        assert fin is not None, "generation.run ends with Finished"
        result = self._finish("".join(parts), fin)
        await self._after(result)
        message: dict[str, Any] = {"role": "assistant", "content": result.content}
        if result.tool_calls:
            message["tool_calls"] = [c.as_openai() for c in result.tool_calls]
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model.name,
            "choices": [{"index": 0, "message": message, "finish_reason": fin.finish_reason, "logprobs": None}],
            "usage": usage_body(fin),
        }

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model.name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

    async def stream(self) -> AsyncGenerator[dict[str, Any], None]:
        """Chunks as OpenAI sends them: the role, content deltas (or tool-call deltas), the
        finish reason, then usage when asked for."""
        events = aiter(self._events())
        # Routing and the worker's first answer happen before the first chunk, so a refused
        # request (no worker, unknown key) is an HTTP error status rather than an SSE event.
        first = await anext(events)
        yield self._chunk({"role": "assistant", "content": ""})
        fin: Finished | None = None
        scan = CallScan() if self.is_buffered and not self.req.is_forced and self.req.tool_choice == "auto" \
            else None
        parts: list[str] = []
        async for event in _chain(first, events):
            if isinstance(event, Finished):
                fin = event
            elif scan is not None:
                if text := scan.feed(event):
                    yield self._chunk({"content": text})
            elif self.is_buffered:
                parts.append(event)
            else:
                yield self._chunk({"content": event})
        assert fin is not None, "generation.run ends with Finished"
        result = self._finish(scan.rest() if scan is not None else "".join(parts), fin)
        if self.is_buffered and result.content:
            yield self._chunk({"content": result.content})
        for index, c in enumerate(result.tool_calls):
            yield self._chunk({"tool_calls": [{"index": index, "id": c.id, "type": "function",
                                               "function": {"name": c.name, "arguments": ""}}]})
            for piece in argument_pieces(c.arguments):
                yield self._chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        await self._after(result)
        yield self._chunk({}, fin.finish_reason)
        if self.req.include_usage:
            yield {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                   "model": self.model.name, "choices": [], "usage": usage_body(fin)}


ARGUMENT_PIECE_CHARS = 16


def argument_pieces(arguments: str) -> list[str]:
    """A call's arguments as OpenAI streams them: consecutive fragments that join to the
    whole JSON text (none when it is empty)."""
    return [arguments[i:i + ARGUMENT_PIECE_CHARS] for i in range(0, len(arguments), ARGUMENT_PIECE_CHARS)]


class CallScan:
    """Streams ``auto``-mode text live up to the first ``<tool_call>``, and keeps the rest.

    The last ``len("<tool_call>") - 1`` characters are held back while they could be the start
    of the tag; from the tag on, everything is kept for the parser (``rest()``)."""

    def __init__(self) -> None:
        self.held = ""
        self.tail: str | None = None

    def feed(self, delta: str) -> str:
        if self.tail is not None:
            self.tail += delta
            return ""
        self.held += delta
        i = self.held.find(HERMES_OPEN)
        if i >= 0:
            text, self.tail, self.held = self.held[:i], self.held[i:], ""
            return text
        keep = len(HERMES_OPEN) - 1
        text, self.held = self.held[:-keep], self.held[-keep:]
        return text

    def rest(self) -> str:
        """What was not streamed: the held characters, or the text from the first tag on."""
        return self.tail if self.tail is not None else self.held


async def _chain(first: str | Finished, rest: AsyncIterator[str | Finished]) -> AsyncIterator[str | Finished]:
    yield first
    async for event in rest:
        yield event


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode("utf-8") + b"\n\n"
