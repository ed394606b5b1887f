"""Python client for serving frontends: route, generate, session hints (DESIGN §3, §6).

    async with AsyncClient(controller="127.0.0.1:50051") as client:
        async for event in client.generate(namespace, prompt, SamplingParams(max_tokens=64)):
            ...                                   # TokenChunk..., then one GenerateFinal
        tokens, final = await client.complete(namespace, prompt)
        await client.pause(session_id, tool="search", expected_ms=2000)

``Client`` is the same API, synchronous, on a private event-loop thread.

Deadlines: every call has one (``timeout_s``, per call or the client's default); a
generation's ``deadline_s`` covers routing and the whole stream. Errors arrive as
``kvtier.errors`` types (``error_from_rpc_error``), so callers never see grpc.

Retries: only idempotent unary calls are retried, on ``UNAVAILABLE``, with exponential
backoff inside the call's deadline: ``route`` (a read) and the session hints ``pause``,
``returning`` and ``end`` (each sets the session's state by session id, so a repeat
finds the state it would set; the controller treats them as idempotent, see
sessions.proto). ``generate`` is never retried once a token has arrived (the caller has
seen output; repeating could differ and would double the work); before the first token
an ``UNAVAILABLE`` worker is skipped for the next one in the route's ranking.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from kvtier.config import ClientConfig
from kvtier.engine.params import SamplingParams
from kvtier.errors import ConfigError, DeadlineExceeded, InvalidArgument, Unavailable
from kvtier.hashing import NamespaceIdentity
from kvtier.log import get_logger
from kvtier.records import (
    ControllerStatus,
    EndRequest,
    GenerateEvent,
    GenerateFinal,
    GenerateRequest,
    IntegrityResult,
    PauseRequest,
    RequestId,
    ReturningRequest,
    RouteDecision,
    RouteRequest,
    SessionId,
    SessionInfo,
    TokenChunk,
    TokenPrefix,
    WorkerStats,
)
from kvtier.rpc import convert
from kvtier.rpc._gen import (
    admin_pb2,
    admin_pb2_grpc,
    router_pb2_grpc,
    sessions_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from kvtier.rpc.status import error_from_rpc_error

log = get_logger("kvtier.client")

T = TypeVar("T")

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", convert.MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", convert.MAX_MESSAGE_BYTES),
    # Ping only while a call is open: a long stream whose worker died is noticed, and
    # servers with gRPC's default ping policy never see an idle channel ping.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
)


class AsyncClient:
    """Talks to the controller (Router, Sessions) and streams from workers."""

    def __init__(
        self,
        controller: str | None = None,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.2,
        channel_options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
    ) -> None:
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}", field="timeout_s")
        if max_retries < 0:
            raise InvalidArgument(f"max_retries must be >= 0, got {max_retries}", field="max_retries")
        self.controller = controller
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._options = tuple(channel_options)
        self._metadata: tuple[tuple[str, str], ...] | None = (
            (("authorization", f"Bearer {token}"),) if token else None
        )
        self._channels: dict[str, grpc.aio.Channel] = {}

    @classmethod
    def from_config(cls, config: ClientConfig) -> AsyncClient:
        token = None
        if config.auth_token_file is not None:
            try:
                token = config.auth_token_file.expanduser().read_text().strip() or None
            except OSError as exc:
                raise ConfigError(
                    f"cannot read auth_token_file {config.auth_token_file}: {exc.strerror}",
                    field="auth_token_file",
                ) from exc
        return cls(
            config.controller_address,
            token=token,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            retry_backoff_s=config.retry_backoff_s,
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

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
            "Router.Route", stub.Route, convert.to_proto_route_request(request), timeout_s, idempotent=True
        )
        return convert.from_proto_route_decision(response)

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
    ) -> AsyncIterator[GenerateEvent]:
        """Stream ``TokenChunk`` events and one final ``GenerateFinal``.

        Without ``worker`` the controller routes the request; with it (``host:port``) the
        request goes straight to that worker. Breaking out of the loop (or closing the
        iterator) cancels the stream, and the worker releases the request's pages.
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
        message = convert.to_proto_generate_request(request)
        if worker is not None:
            candidates = [worker]
        else:
            decision = await self.route(namespace, prompt, session_id, timeout_s=_remaining(deadline, aloop))
            candidates = [w.address for w in decision.workers]
            if not candidates:
                raise Unavailable(
                    f"no live worker serves model {namespace.model_id!r}; start one, or check `kvtier workers`"
                )
        for i, address in enumerate(candidates):
            call = worker_pb2_grpc.WorkerStub(self._channel(address)).Generate(
                message, timeout=_remaining(deadline, aloop), metadata=self._metadata
            )
            has_output = False
            try:
                async for event in call:
                    has_output = True
                    yield convert.from_proto_generate_event(event)
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
            "Sessions.Pause", stub.Pause, convert.to_proto_pause_request(request), timeout_s, idempotent=True
        )
        return convert.from_proto_pause_response(response)

    async def returning(
        self, session_id: str, eta_ms: int | None = None, *, timeout_s: float | None = None
    ) -> SessionInfo:
        """The tool result arrives in ``eta_ms`` (None: now); pulls the promotion forward."""
        request = ReturningRequest(SessionId(session_id), eta_ms=eta_ms)
        stub = sessions_pb2_grpc.SessionsStub(self._controller_channel())
        response = await self._unary(
            "Sessions.Returning",
            stub.Returning,
            convert.to_proto_returning_request(request),
            timeout_s,
            idempotent=True,
        )
        return convert.from_proto_returning_response(response)

    async def end(self, session_id: str, *, timeout_s: float | None = None) -> SessionInfo:
        request = EndRequest(SessionId(session_id))
        stub = sessions_pb2_grpc.SessionsStub(self._controller_channel())
        response = await self._unary(
            "Sessions.End", stub.End, convert.to_proto_end_request(request), timeout_s, idempotent=True
        )
        return convert.from_proto_end_response(response)

    # ---- worker inspection (tests, tools) ------------------------------------------------
    # ---- admin ------------------------------------------------------------------------
    async def status(self, *, timeout_s: float | None = None) -> ControllerStatus:
        """The controller's ``Admin.Status`` (retried on UNAVAILABLE)."""
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary("Admin.Status", stub.Status, admin_pb2.StatusRequest(), timeout_s, idempotent=True)
        return convert.from_proto_controller_status(response)

    async def worker_stats(self, worker: str, *, timeout_s: float | None = None) -> WorkerStats:
        stub = worker_pb2_grpc.WorkerStub(self._channel(worker))
        response = await self._unary(
            "Worker.Stats", stub.Stats, worker_pb2.StatsRequest(), timeout_s, idempotent=True
        )
        return convert.from_proto_worker_stats(response)

    async def check_integrity(self, worker: str, *, timeout_s: float | None = None) -> IntegrityResult:
        stub = worker_pb2_grpc.WorkerStub(self._channel(worker))
        response = await self._unary(
            "Worker.CheckIntegrity",
            stub.CheckIntegrity,
            worker_pb2.CheckIntegrityRequest(),
            timeout_s,
            idempotent=True,
        )
        return convert.from_proto_integrity_result(response)

    # ---- plumbing ----------------------------------------------------------------------
    def _controller_channel(self) -> grpc.aio.Channel:
        if not self.controller:
            raise InvalidArgument(
                "this client has no controller address; pass controller='host:port' (or worker= to generate)",
                field="controller",
            )
        return self._channel(self.controller)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=self._options)
        return channel

    async def _unary(
        self,
        name: str,
        method: Callable[..., Awaitable[T]],
        message: Any,
        timeout_s: float | None,
        *,
        idempotent: bool,
    ) -> T:
        aloop = asyncio.get_running_loop()
        deadline = aloop.time() + (self.timeout_s if timeout_s is None else timeout_s)
        num_retries = 0
        while True:
            try:
                return await method(message, timeout=_remaining(deadline, aloop), metadata=self._metadata)
            except grpc.aio.AioRpcError as err:
                retriable = idempotent and err.code() is grpc.StatusCode.UNAVAILABLE
                if not retriable or num_retries >= self.max_retries:
                    raise error_from_rpc_error(err) from err
                delay = self.retry_backoff_s * 2**num_retries * random.uniform(0.5, 1.0)
                if aloop.time() + delay >= deadline:
                    raise error_from_rpc_error(err) from err
                num_retries += 1
                log.debug("retrying after UNAVAILABLE", extra={"rpc": name, "retry": num_retries})
                await asyncio.sleep(delay)


def _remaining(deadline: float, aloop: asyncio.AbstractEventLoop) -> float:
    remaining = deadline - aloop.time()
    if remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before it could be sent")
    return remaining


class Client:
    """Synchronous ``AsyncClient``: the same methods, on a private event-loop thread."""

    def __init__(self, controller: str | None = None, **kwargs: Any) -> None:
        # AsyncClient opens channels lazily, inside the loop that uses them.
        self._client = AsyncClient(controller, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-client", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: ClientConfig) -> Client:
        client = cls()
        client._client = AsyncClient.from_config(config)
        return client

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def route(
        self,
        namespace: NamespaceIdentity,
        token_ids: Sequence[int],
        session_id: str | None = None,
        **kwargs: Any,
    ) -> RouteDecision:
        return self._run(self._client.route(namespace, token_ids, session_id, **kwargs))

    def generate(
        self,
        namespace: NamespaceIdentity,
        prompt: Sequence[int],
        sampling: SamplingParams | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerateEvent]:
        events = self._client.generate(namespace, prompt, sampling, **kwargs)
        try:
            while True:
                try:
                    event = self._run(_next(events))
                except StopAsyncIteration:
                    return
                yield event
        finally:
            self._run(_close(events))

    def complete(
        self,
        namespace: NamespaceIdentity,
        prompt: Sequence[int],
        sampling: SamplingParams | None = None,
        **kwargs: Any,
    ) -> tuple[list[int], GenerateFinal]:
        return self._run(self._client.complete(namespace, prompt, sampling, **kwargs))

    def pause(
        self, session_id: str, tool: str | None = None, expected_ms: int | None = None, **kwargs: Any
    ) -> SessionInfo:
        return self._run(self._client.pause(session_id, tool, expected_ms, **kwargs))

    def returning(self, session_id: str, eta_ms: int | None = None, **kwargs: Any) -> SessionInfo:
        return self._run(self._client.returning(session_id, eta_ms, **kwargs))

    def end(self, session_id: str, **kwargs: Any) -> SessionInfo:
        return self._run(self._client.end(session_id, **kwargs))

    def worker_stats(self, worker: str, **kwargs: Any) -> WorkerStats:
        return self._run(self._client.worker_stats(worker, **kwargs))

    def check_integrity(self, worker: str, **kwargs: Any) -> IntegrityResult:
        return self._run(self._client.check_integrity(worker, **kwargs))


async def _next(events: AsyncIterator[GenerateEvent]) -> GenerateEvent:
    return await anext(events)


async def _close(events: AsyncIterator[GenerateEvent]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(RuntimeError):  # still running after an interrupt
            await aclose()
