"""A chat completion: the prompt from messages and tools, the generation, and the
OpenAI response or chunk stream built from it, with the session hints it implies.

Tool modes (``tool_choice``):
  ``none``      tools stay in the prompt, so a turn that must answer in text (an agent's
                last) keeps the prefix, and the cached pages, of the turns that called
                tools; the output is text, never parsed for calls.
  ``auto``      tools are in the prompt; the output goes through the model's tool-call parser
                (``ServedModel.tool_parser``, e.g. ``hermes``) as it streams: text up to a
                call streams as content, a call as ``delta.tool_calls`` (its name, then its
                arguments as the model writes them).
  ``required``  as ``auto``, with the assistant turn opened by the format's call opening
                (``<tool_call>`` for hermes).
  a function    the assistant turn is opened, in the parser's format, with that call's name
                and the arguments' ``{`` (and the first required parameter's key, when the
                schema has one); the model writes the arguments, the stream ends as soon as
                the object closes, and arguments the model breaks are closed into a valid
                object at the break.

Sessions: a response ending in tool calls pauses its session; one ending without them ends
it (its pages stay cached), so a finished conversation holds no session; its next turn, if
any, starts the session again. A turn that ends before its generation does (the client left
mid-stream, or the stack failed) ends the session too, as a turn with no tool calls: no pause
is left for the controller to prefetch for, and the pages already computed stay cached. The
request's own task is being cancelled then, so that End goes out on a task of its own
(``Detached``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from kvtier.client import AsyncClient
from kvtier.domain.errors import KvtierError, NotFound, ResourceExhausted
from kvtier.domain.params import SamplingParams
from kvtier.gateway import generation, sessions
from kvtier.gateway.errors import ApiError
from kvtier.gateway.generation import Finished
from kvtier.gateway.metrics import GatewayMetrics
from kvtier.gateway.model import ServedModel
from kvtier.gateway.protocol import DEFAULT_MAX_TOKENS, ChatRequest, Sampling
from kvtier.gateway.tool_parsers import (
    ArgumentsDelta,
    CallStart,
    ParsedOutput,
    ParserEvent,
    ToolCall,
    ToolParser,
    get_parser,
    json_object_end,
    parser_format,
)
from kvtier.gateway.tool_prompt import forced_arguments_opening, template_messages
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.gateway.chat")
EXTENSION_KEY = "kvtier"
# Tokens a forced call may run on after its arguments close (typically `}`, a newline and
# `</tool_call>`) for the worker to end it and report its cache accounting.
FORCED_GRACE_TOKENS = 8
DETACHED_IN_FLIGHT = 8
# An abandoned turn's End refused for load (the controller's per-key limits) is tried again,
# after the controller's Retry-After or a doubling backoff, this many times in all.
END_ATTEMPTS = 8
END_BACKOFF_S = 0.2


class Detached:
    """Calls that outlive their request, each on a task of its own: a request whose task is
    cancelled (its client left) cannot await them itself. At most ``max_in_flight`` run at
    once, so a burst of hang-ups stays under the controller's per-key limit of Sessions calls
    in flight. ``wait`` at shutdown."""

    def __init__(self, max_in_flight: int = DETACHED_IN_FLIGHT) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._gate = asyncio.Semaphore(max_in_flight)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        async def gated() -> None:
            async with self._gate:
                try:
                    await coro
                except Exception:  # nobody awaits the task: its failure is logged here
                    log.exception("a detached call failed")

        task = asyncio.get_running_loop().create_task(gated())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


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
    detached: Detached


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
    return forced_arguments_opening(tool) or "{"


def chat_prompt(model: ServedModel, req: ChatRequest) -> str:
    tools = req.tools  # with "none" too: the conversation's prefix, and so its cached pages, stay the same
    fmt = parser_format(model.tool_parser)
    messages = template_messages(req.messages, tools, template_has_tools=model.text.supports_tools, fmt=fmt)
    return model.text.render(messages, tools if model.text.supports_tools else None) + assistant_opening(model, req)


def assistant_opening(model: ServedModel, req: ChatRequest) -> str:
    """What the gateway writes of the assistant's turn: a forced call's opening, the format's
    call opening when a call is required, else nothing."""
    fmt = parser_format(model.tool_parser)
    if req.is_forced:
        return fmt.call_opening(req.tool_choice, forced_opening(req))
    if req.tool_choice == "required":
        return fmt.required_opening
    return ""


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
        close = parser_format(model.tool_parser).call_close.strip()
        if req.is_forced and close:  # the worker ends a forced call at its closing tag, with its usage
            self.sampling.stop_sequences = [model.text.encode(close)]
        self.is_buffered = req.tool_choice != "none" and bool(req.tools)

    async def _events(self) -> AsyncGenerator[str | Finished, None]:
        if sessions.is_returning(self.req.messages):
            await self._hint(self.call.client.returning(self.session_id))
        opening = forced_opening(self.req)
        until = (lambda text: json_object_end((opening + text).lstrip()) is not None) if self.req.is_forced \
            else None
        stops = () if self.is_buffered else self.req.sampling.stop
        events = generation.run(self.call.client, self.model, self.prompt_ids, self.sampling, stops=stops,
                                session_id=self.session_id, until=until,
                                grace_tokens=FORCED_GRACE_TOKENS if self.req.is_forced else 0)
        async with contextlib.aclosing(events) as stream:  # closing it cancels the worker's stream
            async for event in stream:
                yield event

    async def _hint(self, hint: Any) -> None:
        """Session hints steer prefetch; a refused hint never fails the request."""
        try:
            await hint
        except KvtierError as exc:
            self.call.metrics.session_hints_failed.inc()
            log.warning("session hint refused: %s", type(exc).__name__)

    def _parser(self) -> tuple[ToolParser | None, str]:
        """The output's parser (None when the output is plain text) and the text the prompt
        already wrote of the assistant's turn, which the parser reads first."""
        if not self.is_buffered:
            return None, ""
        return get_parser(self.model.tool_parser), assistant_opening(self.model, self.req)

    def _finish(self, out: ParsedOutput, parser: ToolParser | None, fin: Finished) -> ChatResult:
        if parser is not None and parser.num_unparsed:
            self.call.metrics.unparsed_tool_calls.inc(parser.num_unparsed)
        if out.tool_calls:
            fin.finish_reason = "tool_calls"
            return ChatResult(out.text or None, out.tool_calls, fin)
        return ChatResult(out.text, [], fin)

    async def _after(self, result: ChatResult) -> None:
        pause = sessions.pause_after([c.as_openai() for c in result.tool_calls], self.call.tool_expected_ms)
        if pause is not None:
            await self._hint(self.call.client.pause(self.session_id, pause.tool, pause.expected_ms))
        else:
            await self._hint(self.call.client.end(self.session_id))

    def _abandoned(self) -> None:
        """The turn ended before its generation did: end the session (see the module's doc)."""
        async def end() -> None:
            backoff_s = END_BACKOFF_S
            for attempt in range(END_ATTEMPTS):
                try:
                    await self.call.client.end(self.session_id)
                    return
                except NotFound:  # its Route never started it
                    return
                except ResourceExhausted as exc:
                    if attempt + 1 < END_ATTEMPTS:
                        await asyncio.sleep(exc.retry_after_s or backoff_s)
                        backoff_s = min(backoff_s * 2, 2.0)
                        continue
                    error: KvtierError = exc
                except KvtierError as exc:
                    error = exc
                self.call.metrics.session_hints_failed.inc()
                log.warning("session end after an abandoned turn refused: %s", type(error).__name__)
                return

        self.call.detached.spawn(end())

    async def result(self) -> dict[str, Any]:
        is_done = False
        try:
            body = await self._result()
            is_done = True
            return body
        finally:
            if not is_done:
                self._abandoned()

    async def _result(self) -> dict[str, Any]:
        parser, prefill = self._parser()
        out = ParsedOutput()
        if parser is not None:
            out.add(parser.feed(prefill))
        fin: Finished | None = None
        async for event in self._events():
            if isinstance(event, Finished):
                fin = event
            elif parser is not None:
                out.add(parser.feed(event))
            else:
                out.text += event
        assert fin is not None, "generation.run ends with Finished"
        if parser is not None:
            out.add(parser.finish())
        result = self._finish(out, parser, fin)
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

    def _delta(self, event: ParserEvent) -> dict[str, Any]:
        if isinstance(event, str):
            return self._chunk({"content": event})
        if isinstance(event, CallStart):
            return self._chunk({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                                "function": {"name": event.name, "arguments": ""}}]})
        assert isinstance(event, ArgumentsDelta)
        return self._chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})

    async def stream(self) -> AsyncGenerator[dict[str, Any], None]:
        """Chunks as OpenAI sends them: the role, content deltas and tool-call deltas as the
        tokens arrive, the finish reason, then usage when asked for. Closed (or cancelled)
        before its generation ended, it ends the session (``_abandoned``)."""
        is_started = is_done = False
        try:
            async with contextlib.aclosing(self._stream()) as chunks:
                async for chunk in chunks:
                    if isinstance(chunk, _Done):
                        is_done = True
                    else:
                        is_started = True
                        yield chunk
        finally:
            if not is_done:
                if is_started:  # else refused before its first chunk: an HTTP error, not a stream
                    self.call.metrics.streams_abandoned.inc()
                self._abandoned()

    async def _stream(self) -> AsyncGenerator[dict[str, Any] | _Done, None]:
        async with contextlib.aclosing(self._events()) as events:
            async for chunk in self._chunks(events):
                yield chunk

    async def _chunks(self, events: AsyncGenerator[str | Finished, None]) -> AsyncIterator[dict[str, Any] | _Done]:
        # Routing and the worker's first answer happen before the first chunk, so a refused
        # request (no worker, unknown key) is an HTTP error status rather than an SSE event.
        first = await anext(events)
        yield self._chunk({"role": "assistant", "content": ""})
        parser, prefill = self._parser()
        out = ParsedOutput()
        parsed: list[ParserEvent] = parser.feed(prefill) if parser is not None else []
        fin: Finished | None = None
        async for event in _chain(first, events):
            if isinstance(event, Finished):
                fin = event
            elif parser is None:
                out.text += event
                yield self._chunk({"content": event})
            else:
                parsed += parser.feed(event)
            out.add(parsed)
            for e in parsed:
                yield self._delta(e)
            parsed = []
        assert fin is not None, "generation.run ends with Finished"
        if parser is not None:
            parsed = parser.finish()
            out.add(parsed)
            for e in parsed:
                yield self._delta(e)
        result = self._finish(out, parser, fin)
        await self._after(result)
        yield _Done()
        yield self._chunk({}, fin.finish_reason)
        if self.req.include_usage:
            yield {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                   "model": self.model.name, "choices": [], "usage": usage_body(fin)}


class _Done:
    """Marks, in ``_stream``'s chunks, that the generation ended and its session hint went out."""


async def _chain(first: str | Finished, rest: AsyncIterator[str | Finished]) -> AsyncIterator[str | Finished]:
    yield first
    async for event in rest:
        yield event


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode("utf-8") + b"\n\n"
