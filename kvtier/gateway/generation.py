"""One generation through ``kvtier.client``, as text: route, stream, detokenize, stop.

``run`` yields ``str`` text deltas (stop strings already cut out, EOS ids dropped) and ends
with one ``Finished``. The caller closes the iterator to cancel: the worker's stream is
cancelled and the worker frees the request's pages, which is how a client that hangs up
mid-stream stops its generation.

Usage: the worker's own accounting (cached tokens by tier, promoted, recomputed) when the
worker ended the stream, which it does for a forced call that closes within its grace tokens
(the call's closing tag is a stop sequence); when the gateway ended it first (a stop string, a
forced call running on past its grace) the worker's final event never comes, and usage holds
the prompt and generated counts the gateway saw, with no cache fields (``is_worker_usage`` false).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from kvtier.client import AsyncClient
from kvtier.domain.errors import Unavailable
from kvtier.domain.params import FinishReason, SamplingParams
from kvtier.domain.records import GenerateFinal, TokenChunk, Usage
from kvtier.gateway.model import ServedModel
from kvtier.gateway.text import StopMatcher


@dataclass(slots=True)
class Finished:
    """How a generation ended. ``finish_reason`` is OpenAI's: stop, length or tool_calls."""

    finish_reason: str
    usage: Usage
    worker: str | None
    num_generated: int
    is_worker_usage: bool


_FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.TOOL_CALL: "stop",
           FinishReason.ABORTED: "stop"}


async def run(
    client: AsyncClient,
    model: ServedModel,
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    *,
    stops: Sequence[str] = (),
    session_id: str | None = None,
    until: Callable[[str], bool] | None = None,
    grace_tokens: int = 0,
) -> AsyncGenerator[str | Finished, None]:
    """Stream one generation. ``until(text_so_far)`` true ends its text with ``tool_calls``;
    up to ``grace_tokens`` more tokens are then read (not yielded) for the worker's own end
    (a stop sequence, EOS), whose final event carries the cache accounting; past them the
    stream is cancelled.

    The namespace goes out with no tenant: the stack binds the tenant of the client's token."""
    namespace = model.namespace
    decision = await client.route(namespace, prompt_ids, session_id)
    candidates = [(w.address, w.ticket) for w in decision.workers]
    if not candidates:
        raise Unavailable(f"no live worker serves model {model.name!r}; retry later", field="model")
    eos = set(model.text.eos_token_ids)
    detok = model.text.detokenizer()
    matcher = StopMatcher(tuple(stops))
    text_so_far: list[str] = []
    num_generated = 0
    ended_at: int | None = None  # num_generated when ``until`` ended the text
    for i, (address, ticket) in enumerate(candidates):
        events = client.generate(namespace, prompt_ids, sampling, session_id=session_id, worker=address,
                                 ticket=ticket)
        async with contextlib.aclosing(events) as stream:
            try:
                async for event in stream:
                    if isinstance(event, GenerateFinal):
                        if ended_at is not None:
                            yield Finished("tool_calls", event.usage, address, ended_at, True)
                            return
                        tail = matcher.feed(detok.flush()).text + matcher.flush()
                        if tail:
                            yield tail
                        yield Finished(_FINISH[event.finish_reason], event.usage, address,
                                       event.usage.generated_tokens, True)
                        return
                    assert isinstance(event, TokenChunk)
                    num_generated += len(event.token_ids)
                    if ended_at is not None:
                        if num_generated - ended_at > grace_tokens:
                            usage = Usage(prompt_tokens=len(prompt_ids), generated_tokens=ended_at)
                            yield Finished("tool_calls", usage, address, ended_at, False)
                            return
                        continue
                    match = matcher.feed(detok.add([t for t in event.token_ids if t not in eos]))
                    if match.text:
                        text_so_far.append(match.text)
                        yield match.text
                    reason = "stop" if match.is_stopped else None
                    if reason is None and until is not None and until("".join(text_so_far)):
                        if grace_tokens > 0:
                            ended_at = num_generated
                            continue
                        reason = "tool_calls"
                    if reason is not None:
                        usage = Usage(prompt_tokens=len(prompt_ids), generated_tokens=num_generated)
                        yield Finished(reason, usage, address, num_generated, False)
                        return
            except Unavailable:
                if num_generated or i + 1 == len(candidates):
                    raise
                continue
    raise Unavailable("the worker closed the stream without a final event; retry the request")
