"""Python client for serving frontends: route, generate, session hints (DESIGN §3, §6).

    async with AsyncClient(controller="127.0.0.1:50051") as client:
        async for event in client.generate(namespace, prompt, SamplingParams(max_tokens=64)):
            ...                                   # TokenChunk..., then one GenerateFinal
        tokens, final = await client.complete(namespace, prompt)
        await client.pause(session_id, tool="search", expected_ms=2000)

``Client`` is the same API, synchronous, on a private event-loop thread.

Deadlines: every call has one (``timeout_s``, per call or the client's default); a
generation's ``deadline_s`` covers routing and the whole stream. Errors arrive as
``kvtier.domain.errors`` types (``error_from_rpc_error``), so callers never see grpc.

Retries: only idempotent unary calls are retried, on ``UNAVAILABLE``, with exponential
backoff inside the call's deadline: ``route`` (a read) and the session hints ``pause``,
``returning`` and ``end`` (each sets the session's state by session id, so a repeat
finds the state it would set; the controller treats them as idempotent, see
sessions.proto). Admin calls: reads (``status``, ``list_workers``, ``list_sessions``,
``lookup``, ``get_policy``, ``policy_history``) and the state-setting ``drain`` and
``snapshot`` are retried; ``invalidate``, ``pin``, ``unpin``, ``evict``, ``set_policy`` and
``rollback_policy`` never are (a repeat would bump, pin or install again, or misreport).
``generate`` is never retried once a token has arrived (the caller has
seen output; repeating could differ and would double the work); before the first token
an ``UNAVAILABLE`` worker is skipped for the next one in the route's ranking.
"""

from kvtier.client.async_client import AsyncClient
from kvtier.client.sync import Client

__all__ = ["AsyncClient", "Client"]
