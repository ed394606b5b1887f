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

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from kvtier.domain.errors import DeadlineExceeded, InvalidArgument, Unavailable
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.params import SamplingParams
from kvtier.domain.records import (
    ControllerStatus,
    DrainRequest,
    EndRequest,
    EvictRequest,
    EvictResult,
    GenerateEvent,
    GenerateFinal,
    GenerateRequest,
    GetPolicyRequest,
    IntegrityResult,
    InvalidateRequest,
    InvalidateResult,
    InvalidationScope,
    ListSessionsRequest,
    LookupRequest,
    LookupResult,
    PageKeyPrefix,
    PauseRequest,
    PinId,
    PinRequest,
    PinResult,
    Policy,
    PolicyHistoryRequest,
    Prefix,
    RequestId,
    ReturningRequest,
    RollbackPolicyRequest,
    RouteDecision,
    RouteRequest,
    ServedModel,
    SessionId,
    SessionInfo,
    SessionPage,
    SessionState,
    SetPolicyRequest,
    SnapshotRequest,
    TokenChunk,
    TokenPrefix,
    UnpinRequest,
    UnpinResult,
    VersionedPolicy,
    WorkerId,
    WorkerInfo,
    WorkerSnapshot,
    WorkerStats,
)
from kvtier.domain.tiers import Tier
from kvtier.rpc._gen import (
    admin_pb2,
    admin_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    sessions_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from kvtier.rpc.auth import read_token_file
from kvtier.rpc.convert.admin import (
    from_proto_controller_status,
    from_proto_drain_response,
    from_proto_evict_result,
    from_proto_invalidate_result,
    from_proto_lookup_result,
    from_proto_pin_result,
    from_proto_session_page,
    from_proto_snapshot_result,
    from_proto_unpin_result,
    from_proto_worker_list,
    to_proto_drain_request,
    to_proto_evict_request,
    to_proto_invalidate_request,
    to_proto_list_sessions_request,
    to_proto_lookup_request,
    to_proto_pin_request,
    to_proto_snapshot_request,
    to_proto_unpin_request,
)
from kvtier.rpc.convert.limits import (
    DEFAULT_LIST_SESSIONS_LIMIT,
    DEFAULT_POLICY_HISTORY_LIMIT,
    MAX_MESSAGE_BYTES,
)
from kvtier.rpc.convert.policy import (
    from_proto_get_policy_response,
    from_proto_policy_history,
    from_proto_rollback_policy_response,
    from_proto_set_policy_response,
    to_proto_get_policy_request,
    to_proto_policy_history_request,
    to_proto_rollback_policy_request,
    to_proto_set_policy_request,
)
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
from kvtier.rpc.convert.worker import (
    from_proto_generate_event,
    from_proto_integrity_result,
    from_proto_worker_stats,
    to_proto_generate_request,
)
from kvtier.rpc.status import error_from_rpc_error
from kvtier.rpc.tls import ClientTls, secure_or_insecure_channel
from kvtier.runtime.config import ClientConfig
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.client")

T = TypeVar("T")

PrefixLike = Sequence[int] | TokenPrefix | PageKeyPrefix
"""A prefix as admin calls take it: token ids (the server derives the page keys) or a record."""

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
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
        tls: ClientTls | None = None,
    ) -> None:
        """``token``: the bearer token sent with every call (controller and workers). ``tls``:
        dial every server over TLS (``ClientTls``: CA, client certificate for mTLS); None:
        plaintext, which a TLS server refuses."""
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
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    @classmethod
    def from_config(cls, config: ClientConfig) -> AsyncClient:
        token = read_token_file(config.auth_token_file) if config.auth_token_file is not None else None
        return cls(
            config.controller_address,
            token=token,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            retry_backoff_s=config.retry_backoff_s,
            tls=ClientTls.from_files(
                config.tls_ca_file, config.tls_cert_file, config.tls_key_file, config.tls_server_name
            ),
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
        message = to_proto_generate_request(request)
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

    # ---- admin (the operator surface behind the `kvtier` CLI; needs the admin role) ----------
    async def status(self, *, timeout_s: float | None = None) -> ControllerStatus:
        """The controller's ``Admin.Status`` (retried on UNAVAILABLE)."""
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary("Admin.Status", stub.Status, admin_pb2.StatusRequest(), timeout_s, idempotent=True)
        return from_proto_controller_status(response)

    async def list_workers(self, *, timeout_s: float | None = None) -> tuple[WorkerInfo, ...]:
        """Every registered worker, ordered by worker id (retried on UNAVAILABLE)."""
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.ListWorkers", stub.ListWorkers, admin_pb2.ListWorkersRequest(), timeout_s, idempotent=True
        )
        return from_proto_worker_list(response)

    async def list_sessions(
        self,
        state: SessionState | None = None,
        *,
        limit: int = DEFAULT_LIST_SESSIONS_LIMIT,
        page_token: str | None = None,
        timeout_s: float | None = None,
    ) -> SessionPage:
        """One page of sessions ordered by id; pass ``next_page_token`` back for the next one."""
        request = ListSessionsRequest(state=state, limit=limit, page_token=page_token)
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.ListSessions",
            stub.ListSessions,
            to_proto_list_sessions_request(request),
            timeout_s,
            idempotent=True,
        )
        return from_proto_session_page(response)

    async def iter_sessions(
        self,
        state: SessionState | None = None,
        *,
        page_size: int = DEFAULT_LIST_SESSIONS_LIMIT,
        timeout_s: float | None = None,
    ) -> AsyncIterator[SessionInfo]:
        """Every session (in ``state``), page after page; each page has its own deadline."""
        page_token: str | None = None
        while True:
            page = await self.list_sessions(
                state, limit=page_size, page_token=page_token, timeout_s=timeout_s
            )
            for session in page.sessions:
                yield session
            if page.next_page_token is None:
                return
            page_token = page.next_page_token

    async def lookup(
        self, namespace: NamespaceIdentity, prefix: PrefixLike, *, timeout_s: float | None = None
    ) -> LookupResult:
        """Which workers hold ``prefix`` (token ids or page keys), in which tiers: the directory's view."""
        request = LookupRequest(namespace=namespace, prefix=_as_prefix(prefix))
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.Lookup", stub.Lookup, to_proto_lookup_request(request), timeout_s, idempotent=True
        )
        return from_proto_lookup_result(response)

    async def invalidate(
        self, scope: InvalidationScope, reason: str = "", *, timeout_s: float | None = None
    ) -> InvalidateResult:
        """Bump the policy epoch of every namespace in ``scope`` (not retried: each call bumps it again)."""
        scope.validate()
        request = InvalidateRequest(scope=scope, reason=reason)
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.Invalidate",
            stub.Invalidate,
            to_proto_invalidate_request(request),
            timeout_s,
            idempotent=False,
        )
        return from_proto_invalidate_result(response)

    async def drain(
        self, worker_id: str, *, resume: bool = False, timeout_s: float | None = None
    ) -> WorkerInfo:
        """Stop (``resume=True``: restart) admitting requests on a worker; returns it after the change.

        Retried on UNAVAILABLE: it sets a state, so a repeat finds the state it would set."""
        request = DrainRequest(worker_id=WorkerId(worker_id), resume=resume)
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.Drain", stub.Drain, to_proto_drain_request(request), timeout_s, idempotent=True
        )
        return from_proto_drain_response(response)

    async def pin(
        self,
        namespace: NamespaceIdentity,
        prefix: PrefixLike,
        tier: Tier,
        *,
        ttl_s: int | None = None,
        timeout_s: float | None = None,
    ) -> PinResult:
        """Keep ``prefix``'s pages in ``tier`` or faster until ``unpin`` (or ``ttl_s``). Not retried:
        a repeat would add a second pin."""
        request = PinRequest(namespace=namespace, prefix=_as_prefix(prefix), tier=tier, ttl_s=ttl_s)
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.Pin", stub.Pin, to_proto_pin_request(request), timeout_s, idempotent=False
        )
        return from_proto_pin_result(response)

    async def unpin(self, pin_id: str, *, timeout_s: float | None = None) -> UnpinResult:
        """Release a pin. Not retried: a repeat after a lost answer would report NOT_FOUND."""
        request = UnpinRequest(pin_id=PinId(pin_id))
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.Unpin", stub.Unpin, to_proto_unpin_request(request), timeout_s, idempotent=False
        )
        return from_proto_unpin_result(response)

    async def evict(
        self,
        namespace: NamespaceIdentity,
        prefix: PrefixLike | None = None,
        *,
        worker_id: str | None = None,
        demote_to: Tier | None = None,
        timeout_s: float | None = None,
    ) -> EvictResult:
        """Drop (or demote to ``demote_to``) a prefix's pages and their descendants, or the whole
        namespace's without ``prefix``. Not retried: the counts of a repeat would be wrong."""
        request = EvictRequest(
            namespace=namespace,
            prefix=_as_prefix(prefix) if prefix is not None else None,
            worker_id=WorkerId(worker_id) if worker_id else None,
            demote_to_tier=demote_to,
        )
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.Evict", stub.Evict, to_proto_evict_request(request), timeout_s, idempotent=False
        )
        return from_proto_evict_result(response)

    async def set_policy(
        self,
        policy: Policy,
        *,
        expected_version: int | None = None,
        reason: str = "",
        timeout_s: float | None = None,
    ) -> VersionedPolicy:
        """Install ``policy`` as a new version. ``expected_version`` makes it conditional
        (FAILED_PRECONDITION if another version was installed since). Not retried."""
        request = SetPolicyRequest(policy=policy, expected_version=expected_version, reason=reason)
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.SetPolicy",
            stub.SetPolicy,
            to_proto_set_policy_request(request),
            timeout_s,
            idempotent=False,
        )
        return from_proto_set_policy_response(response)

    async def get_policy(
        self, version: int | None = None, *, timeout_s: float | None = None
    ) -> VersionedPolicy:
        """The policy in force, or version ``version``."""
        request = GetPolicyRequest(version=version)
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.GetPolicy",
            stub.GetPolicy,
            to_proto_get_policy_request(request),
            timeout_s,
            idempotent=True,
        )
        return from_proto_get_policy_response(response)

    async def policy_history(
        self, limit: int = DEFAULT_POLICY_HISTORY_LIMIT, *, timeout_s: float | None = None
    ) -> tuple[VersionedPolicy, ...]:
        """Installed versions, newest first."""
        request = PolicyHistoryRequest(limit=limit)
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.PolicyHistory",
            stub.PolicyHistory,
            to_proto_policy_history_request(request),
            timeout_s,
            idempotent=True,
        )
        return from_proto_policy_history(response)

    async def rollback_policy(
        self, to_version: int, reason: str = "", *, timeout_s: float | None = None
    ) -> VersionedPolicy:
        """Install a copy of version ``to_version`` as the newest version. Not retried."""
        request = RollbackPolicyRequest(to_version=to_version, reason=reason)
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.RollbackPolicy",
            stub.RollbackPolicy,
            to_proto_rollback_policy_request(request),
            timeout_s,
            idempotent=False,
        )
        return from_proto_rollback_policy_response(response)

    async def snapshot(
        self, worker_ids: Sequence[str] = (), *, wait: bool = False, timeout_s: float | None = None
    ) -> tuple[WorkerSnapshot, ...]:
        """Ask workers (default: every live one) for a full inventory and reconcile the directory
        with it; ``wait`` answers once every snapshot is reconciled. Retried on UNAVAILABLE: a
        repeat only reconciles again."""
        request = SnapshotRequest(worker_ids=tuple(WorkerId(w) for w in worker_ids), wait=wait)
        stub = admin_pb2_grpc.AdminStub(self._controller_channel())
        response = await self._unary(
            "Admin.Snapshot",
            stub.Snapshot,
            to_proto_snapshot_request(request),
            timeout_s,
            idempotent=True,
        )
        return from_proto_snapshot_result(response)

    # ---- worker inspection (tests, tools) ------------------------------------------------
    async def worker_stats(self, worker: str, *, timeout_s: float | None = None) -> WorkerStats:
        stub = worker_pb2_grpc.WorkerStub(self._channel(worker))
        response = await self._unary(
            "Worker.Stats", stub.Stats, worker_pb2.StatsRequest(), timeout_s, idempotent=True
        )
        return from_proto_worker_stats(response)

    async def check_integrity(self, worker: str, *, timeout_s: float | None = None) -> IntegrityResult:
        stub = worker_pb2_grpc.WorkerStub(self._channel(worker))
        response = await self._unary(
            "Worker.CheckIntegrity",
            stub.CheckIntegrity,
            worker_pb2.CheckIntegrityRequest(),
            timeout_s,
            idempotent=True,
        )
        return from_proto_integrity_result(response)

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
            channel = self._channels[address] = secure_or_insecure_channel(address, self._tls, self._options)
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


def _as_prefix(prefix: PrefixLike) -> Prefix:
    if isinstance(prefix, TokenPrefix | PageKeyPrefix):
        return prefix
    return TokenPrefix(token_ids=tuple(prefix))


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

    def list_models(self, **kwargs: Any) -> tuple[ServedModel, ...]:
        return self._run(self._client.list_models(**kwargs))

    def status(self, **kwargs: Any) -> ControllerStatus:
        return self._run(self._client.status(**kwargs))

    def list_workers(self, **kwargs: Any) -> tuple[WorkerInfo, ...]:
        return self._run(self._client.list_workers(**kwargs))

    def list_sessions(self, state: SessionState | None = None, **kwargs: Any) -> SessionPage:
        return self._run(self._client.list_sessions(state, **kwargs))

    def iter_sessions(self, state: SessionState | None = None, **kwargs: Any) -> Iterator[SessionInfo]:
        sessions = self._client.iter_sessions(state, **kwargs)
        try:
            while True:
                try:
                    session = self._run(_next(sessions))
                except StopAsyncIteration:
                    return
                yield session
        finally:
            self._run(_close(sessions))

    def lookup(self, namespace: NamespaceIdentity, prefix: PrefixLike, **kwargs: Any) -> LookupResult:
        return self._run(self._client.lookup(namespace, prefix, **kwargs))

    def invalidate(self, scope: InvalidationScope, reason: str = "", **kwargs: Any) -> InvalidateResult:
        return self._run(self._client.invalidate(scope, reason, **kwargs))

    def drain(self, worker_id: str, **kwargs: Any) -> WorkerInfo:
        return self._run(self._client.drain(worker_id, **kwargs))

    def pin(self, namespace: NamespaceIdentity, prefix: PrefixLike, tier: Tier, **kwargs: Any) -> PinResult:
        return self._run(self._client.pin(namespace, prefix, tier, **kwargs))

    def unpin(self, pin_id: str, **kwargs: Any) -> UnpinResult:
        return self._run(self._client.unpin(pin_id, **kwargs))

    def evict(
        self, namespace: NamespaceIdentity, prefix: PrefixLike | None = None, **kwargs: Any
    ) -> EvictResult:
        return self._run(self._client.evict(namespace, prefix, **kwargs))

    def set_policy(self, policy: Policy, **kwargs: Any) -> VersionedPolicy:
        return self._run(self._client.set_policy(policy, **kwargs))

    def get_policy(self, version: int | None = None, **kwargs: Any) -> VersionedPolicy:
        return self._run(self._client.get_policy(version, **kwargs))

    def policy_history(
        self, limit: int = DEFAULT_POLICY_HISTORY_LIMIT, **kwargs: Any
    ) -> tuple[VersionedPolicy, ...]:
        return self._run(self._client.policy_history(limit, **kwargs))

    def rollback_policy(self, to_version: int, reason: str = "", **kwargs: Any) -> VersionedPolicy:
        return self._run(self._client.rollback_policy(to_version, reason, **kwargs))

    def snapshot(self, worker_ids: Sequence[str] = (), **kwargs: Any) -> tuple[WorkerSnapshot, ...]:
        return self._run(self._client.snapshot(worker_ids, **kwargs))

    def worker_stats(self, worker: str, **kwargs: Any) -> WorkerStats:
        return self._run(self._client.worker_stats(worker, **kwargs))

    def check_integrity(self, worker: str, **kwargs: Any) -> IntegrityResult:
        return self._run(self._client.check_integrity(worker, **kwargs))


async def _next(events: AsyncIterator[T]) -> T:
    return await anext(events)


async def _close(events: AsyncIterator[Any]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(RuntimeError):  # still running after an interrupt
            await aclose()
