"""Sessions inferred from the conversation, with no client change (issue 41 §4).

Session id, in order:
  1. the ``X-Session-Id`` header;
  2. else ``conv-`` + BLAKE2b-128 of the tenant and the conversation's opening messages:
     every leading ``system`` message and the first ``user`` message (role and content).

An agent loop resends its whole conversation each turn, so every turn of one conversation
carries the same opening and maps to the same session. Two conversations with the same
tenant and the same opening (the same system prompt and first user message) share a
session id: their pauses and returns interleave, which costs at most a mistimed prefetch,
never a wrong answer, because the KV cache is keyed by the tokens themselves, not by
session. A client that runs such conversations side by side sends ``X-Session-Id``.

Pauses: a response that ends in tool calls starts a pause named after the (first) called
function. The next request whose ``tool`` messages answer every one of those call ids
closes it; results for only some of them (parallel calls) leave it open. A response that ends
without tool calls ends the session (``Sessions.End``, its pages kept as cache): a finished
conversation holds no session, and its next turn, if one comes, starts it again. The rule is a pure
function of the messages, so any gateway replica applies it the same way and a restart
loses nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_SESSION_ID_CHARS = 128


def session_id_for(tenant: str, messages: Sequence[dict[str, Any]], header: str | None = None) -> str:
    if header:
        return header[:MAX_SESSION_ID_CHARS]
    opening: list[tuple[str, Any]] = []
    for m in messages:
        opening.append((m.get("role", ""), m.get("content")))
        if m.get("role") != "system":
            break
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps([tenant, opening], sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return "conv-" + digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Pause:
    """Start a pause: the session waits on ``tool`` (the first called function's name)."""

    tool: str
    call_ids: tuple[str, ...]
    expected_ms: int | None = None


def pause_after(tool_calls: Sequence[dict[str, Any]], expected_ms: int | None = None) -> Pause | None:
    """The pause a response ending in ``tool_calls`` (OpenAI objects) starts; None without calls."""
    if not tool_calls:
        return None
    return Pause(
        tool=tool_calls[0]["function"]["name"],
        call_ids=tuple(c["id"] for c in tool_calls),
        expected_ms=expected_ms,
    )


def is_returning(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether this request closes a pause: its last assistant message has tool calls and every
    one of their ids is answered by a ``tool`` message after it."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") == "assistant":
            ids = {c.get("id") for c in m.get("tool_calls") or ()}
            if not ids:
                return False
            answered = {t.get("tool_call_id") for t in messages[i + 1:] if t.get("role") == "tool"}
            return ids <= answered
    return False
