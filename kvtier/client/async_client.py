"""``AsyncClient``: routing, generation and session hints over a connection, with the admin calls
of ``AdminClient``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import grpc
import grpc.aio

from kvtier.client.admin import AdminClient
from kvtier.client.connection import remaining_s, ticket_metadata
from kvtier.domain.errors import InvalidArgument, Unavailable
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.params import SamplingParams
from kvtier.domain.records import (
    EndRequest,
    GenerateEvent,
    GenerateFinal,
    GenerateRequest,
    PauseRequest,
    RequestId,
    ReturningRequest,
    RouteDecision,
    RouteRequest,
    ServedModel,
    SessionId,
    SessionInfo,
    TokenChunk,
    TokenPrefix,
)
from kvtier.rpc._gen import router_pb2, router_pb2_grpc, sessions_pb2_grpc, worker_pb2_grpc
from kvtier.rpc.convert.router import (
    from_proto_route_decision,
    from_proto_served_models,
    to_proto_route_request,
)
from kvtier.rpc.convert.sessions import (
    from_proto_end_response,
    from_proto_pause_response,
    from_proto_returning_response,
    to_proto_end_request,
    to_proto_pause_request,
    to_proto_returning_request,
)
from kvtier.rpc.convert.worker import from_proto_generate_event, to_proto_generate_request
from kvtier.rpc.status import error_from_rpc_error
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.client")


class AsyncClient(AdminClient):
    """Talks to the controller (Router, Sessions, Admin) and streams from workers."""

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- routing --------------------------------------------------------------------
    async def route(
        self,
        namespace: NamespaceIdentity,
        token_ids: Sequence[int],
        session_id: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> RouteDecision:
        """Workers ranked for this prompt, best first (retried on UNAVAILABLE)."""
        request = RouteRequest(
            namespace=namespace,
            prefix=TokenPrefix(token_ids=tuple(token_ids)),
            session_id=SessionId(session_id) if session_id else None,
        )
        stub = router_pb2_grpc.RouterStub(self._controller_channel())
        response = await self._unary(
            "Router.Route", stub.Route, to_proto_route_request(request), timeout_s, idempotent=True
        )
        return from_proto_route_decision(response)

    async def list_models(self, *, timeout_s: float | None = None) -> tuple[ServedModel, ...]:
        """The models live workers serve, with the exact namespace fields to send (retried on UNAVAILABLE)."""
        stub = router_pb2_grpc.RouterStub(self._controller_channel())
        response = await self._unary(
            "Router.ListModels", stub.ListModels, router_pb2.ListModelsRequest(), timeout_s, idempotent=True
        )
        return from_proto_served_models(response)

    # ---- generation -----------------------------------------------------------------
    async def generate(
        self,
        namespace: NamespaceIdentity,
        prompt: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        request_id: str | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
        worker: str | None = None,
        ticket: str | None = None,
    ) -> AsyncGenerator[GenerateEvent, None]:
        """Stream ``TokenChunk`` events and one final ``GenerateFinal``.

        Without ``worker`` the controller routes the request; with it (``host:port``) the
        request goes straight to that worker, with ``ticket`` (``RankedWorker.ticket`` of a
        Route) when the stack authenticates. A worker is sent its Route ticket, never this
        client's bearer token. Breaking out of the loop (or closing the iterator) cancels the
        stream, and the worker releases the request's pages.
        """
        aloop = asyncio.get_running_loop()
        budget_s = self.timeout_s if deadline_s is None else deadline_s
        if budget_s <= 0:
            raise InvalidArgument(f"deadline_s must be > 0, got {deadline_s}", field="deadline_s")
        deadline = aloop.time() + budget_s
        request = GenerateRequest(
            namespace=namespace,
            prompt_token_ids=tuple(prompt),
            sampling=sampling or SamplingParams(),
            session_id=SessionId(session_id) if session_id else None,
            request_id=RequestId(request_id) if request_id else None,
            priority=priority,
        )
        message = to_proto_generate_request(request)
        if worker is not None:
            candidates = [(worker, ticket, message)]
        else:
            decision = await self.route(namespace, prompt, session_id, timeout_s=remaining_s(deadline, aloop))
            # A candidate whose estimate counts on a peer's pages fetches them first (its fetch plan).
            candidates = [(w.address, w.ticket, message if w.fetch is None else to_proto_generate_request(
                dataclasses.replace(request, peer_fetch=w.fetch))) for w in decision.workers]
            if not candidates:
                raise Unavailable(
                    f"no live worker serves model {namespace.model_id!r}; start one, or check `kvtier workers`"
                )
        for i, (address, worker_ticket, message) in enumerate(candidates):
            call = worker_pb2_grpc.WorkerStub(self._channel(address)).Generate(
                message, timeout=remaining_s(deadline, aloop), metadata=ticket_metadata(worker_ticket)
            )
            has_output = False
            try:
                async for event in call:
                    has_output = True
                    yield from_proto_generate_event(event)
                return
            except grpc.aio.AioRpcError as err:
                if not has_output and err.code() is grpc.StatusCode.UNAVAILABLE and i + 1 < len(candidates):
                    log.info(
                        "worker unavailable before the first token; trying the next one",
                        extra={"worker": address, "rank": i},
                    )
                    continue
                raise error_from_rpc_error(err) from err
            finally:
                call.cancel()  # a no-op once the stream ended; stops it when the caller left early

    async def complete(
        self,
        namespace: NamespaceIdentity,
        prompt: Sequence[int],
        sampling: SamplingParams | None = None,
        **kwargs: Any,
    ) -> tuple[list[int], GenerateFinal]:
        """Run ``generate`` to the end: all generated token ids and the final event."""
        tokens: list[int] = []
        async with contextlib.aclosing(self.generate(namespace, prompt, sampling, **kwargs)) as events:
            async for event in events:
                if isinstance(event, TokenChunk):
                    tokens.extend(event.token_ids)
                else:
                    return tokens, event
        raise Unavailable("the worker closed the stream without a final event; retry the request")

    # ---- session hints ----------------------------------------------------------------
    async def pause(
        self,
        session_id: str,
        tool: str | None = None,
        expected_ms: int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> SessionInfo:
        """The session waits on a tool call; its pages may sink and come back before it returns."""
        request = PauseRequest(SessionId(session_id), tool_name=tool, expected_ms=expected_ms)
        stub = sessions_pb2_grpc.SessionsStub(self._controller_channel())
        response = await self._unary(
            "Sessions.Pause", stub.Pause, to_proto_pause_request(request), timeout_s, idempotent=True
        )
        return from_proto_pause_response(response)

    async def returning(
        self, session_id: str, eta_ms: int | None = None, *, timeout_s: float | None = None
    ) -> SessionInfo:
        """The tool result arrives in ``eta_ms`` (None: now); pulls the promotion forward."""
        request = ReturningRequest(SessionId(session_id), eta_ms=eta_ms)
        stub = sessions_pb2_grpc.SessionsStub(self._controller_channel())
        response = await self._unary(
            "Sessions.Returning",
            stub.Returning,
            to_proto_returning_request(request),
            timeout_s,
            idempotent=True,
        )
        return from_proto_returning_response(response)

    async def end(self, session_id: str, *, drop: bool = False, timeout_s: float | None = None) -> SessionInfo:
        """End the session: its pages stay as ordinary cache entries, or with ``drop`` are freed now."""
        request = EndRequest(SessionId(session_id), drop=drop)
        stub = sessions_pb2_grpc.SessionsStub(self._controller_channel())
        response = await self._unary(
            "Sessions.End", stub.End, to_proto_end_request(request), timeout_s, idempotent=True
        )
        return from_proto_end_response(response)
