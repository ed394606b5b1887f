"""Per-credential rate limits and concurrency caps on the controller's services (decision 0007).

    credential (token name) × service group ─► calls per second, request bytes per second,
                                               calls in flight

Groups: ``route`` (Router.Route and ListModels), ``sessions`` (Pause, Returning, End) and
``admin`` (every Admin call); WorkerLink, health and reflection are not limited. A call over a
limit is answered RESOURCE_EXHAUSTED before its request is decoded, with a ``RetryInfo`` of
when the allowance will have it (a rate: its refill; in flight: ``IN_FLIGHT_RETRY_S``). A call
over a rate whose allowance refills within ``RATE_HOLD_S`` waits for it instead (counted in
flight meanwhile): answered at once, a caller that ignores RetryInfo sends its next huge
request at once, and receiving those costs the controller more than serving the calls did
(measured: ``loadtests/route_flood.py``). So one frontend sending huge Routes back to back
spends its own allowance, not the controller's event loop that every tenant's Route shares. Buckets hold ``BURST_S`` seconds of their rate; a
request-bytes bucket at least one largest message. With authentication off there is no
credential to bound, and nothing is limited.

The interceptor sits inside the authentication interceptor (it reads the caller it set) and
outside ``MalformedRequestInterceptor`` (it sees the request's raw bytes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from kvtier.controller.token_bucket import TokenBucket
from kvtier.domain.errors import ResourceExhausted
from kvtier.rpc.auth_interceptor import current_principal
from kvtier.rpc.convert.limits import MAX_MESSAGE_BYTES
from kvtier.rpc.status import abort_with
from kvtier.runtime.config import ControllerConfig

BURST_S = 2.0
IN_FLIGHT_RETRY_S = 0.05
RATE_HOLD_S = 1.0
GROUPS = {"/kvtier.v1.Router/": "route", "/kvtier.v1.Sessions/": "sessions", "/kvtier.v1.Admin/": "admin"}


@dataclass(frozen=True, slots=True)
class GroupLimit:
    """One service group's limits per credential; 0: unlimited."""

    calls_per_s: float = 0.0
    bytes_per_s: float = 0.0
    max_in_flight: int = 0


def limits_of(config: ControllerConfig) -> dict[str, GroupLimit]:
    return {
        "route": GroupLimit(config.route_calls_per_s, config.route_bytes_per_s, config.route_in_flight),
        "sessions": GroupLimit(config.sessions_calls_per_s, 0.0, config.sessions_in_flight),
        "admin": GroupLimit(config.admin_calls_per_s, 0.0, config.admin_in_flight),
    }


@dataclass(slots=True)
class _Allowance:
    """One credential's state in one group."""

    calls: TokenBucket | None
    bytes: TokenBucket | None
    num_in_flight: int = 0
    num_refused: int = 0


class CallerLimits(grpc.aio.ServerInterceptor):
    """Limits each credential's calls per group (module doc). One event loop."""

    def __init__(self, limits: dict[str, GroupLimit], *, clock_s: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock_s = clock_s
        self._allowances: dict[tuple[str, str], _Allowance] = {}
        self.num_refused: dict[str, int] = dict.fromkeys(limits, 0)  # by group

    def _allowance(self, name: str, group: str) -> _Allowance:
        allowance = self._allowances.get((name, group))
        if allowance is None:
            limit = self.limits[group]
            calls = (TokenBucket(limit.calls_per_s, max(1.0, BURST_S * limit.calls_per_s), 0.0, self._clock_s)
                     if limit.calls_per_s > 0 else None)
            num_bytes = (TokenBucket(limit.bytes_per_s, max(float(MAX_MESSAGE_BYTES), BURST_S * limit.bytes_per_s),
                                     0.0, self._clock_s) if limit.bytes_per_s > 0 else None)
            allowance = self._allowances[(name, group)] = _Allowance(calls, num_bytes)
        return allowance

    def enter(self, name: str, group: str, num_bytes: int) -> _Allowance:
        """Count a call of ``name`` in ``group`` with a request of ``num_bytes``, or raise
        ``ResourceExhausted`` (with when to retry) when it is over a limit."""
        limit = self.limits[group]
        allowance = self._allowance(name, group)
        if limit.max_in_flight and allowance.num_in_flight >= limit.max_in_flight:
            self._refuse(allowance, group)
            raise ResourceExhausted(
                f"credential {name!r} has {allowance.num_in_flight} {group} calls in flight, its limit "
                f"({group}_in_flight); wait for one to finish", retry_after_s=IN_FLIGHT_RETRY_S)
        wait_s = max(allowance.calls.wait_s(1.0) if allowance.calls else 0.0,
                     allowance.bytes.wait_s(num_bytes) if allowance.bytes else 0.0)
        if wait_s > 0:
            self._refuse(allowance, group)
            raise ResourceExhausted(
                f"credential {name!r} is over its {group} rate ({group}_calls_per_s"
                f"{', route_bytes_per_s' if group == 'route' else ''}); retry in {wait_s:.2f} s",
                retry_after_s=wait_s)
        if allowance.calls:
            allowance.calls.take(1.0)
        if allowance.bytes:
            allowance.bytes.take(num_bytes)
        allowance.num_in_flight += 1
        return allowance

    def _refuse(self, allowance: _Allowance, group: str) -> None:
        allowance.num_refused += 1
        self.num_refused[group] += 1

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        group = next((g for prefix, g in GROUPS.items() if method.startswith(prefix)), None)
        if handler is None or group is None or handler.request_streaming or group not in self.limits:
            return handler
        serialize = handler.response_serializer
        deserialize = handler.request_deserializer

        def size(request: Any) -> int:
            return len(request) if isinstance(request, bytes) else request.ByteSize()

        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                allowance = await self._admit(request, context, group, size)
                try:
                    async for response in stream(request, context):
                        yield response
                finally:
                    if allowance is not None:
                        allowance.num_in_flight -= 1

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=deserialize, response_serializer=serialize)

        unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            allowance = await self._admit(request, context, group, size)
            try:
                return await unary(request, context)
            finally:
                if allowance is not None:
                    allowance.num_in_flight -= 1

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, request_deserializer=deserialize, response_serializer=serialize)

    async def _admit(self, request: Any, context: grpc.aio.ServicerContext, group: str,
                     size: Callable[[Any], int]) -> _Allowance | None:
        caller = current_principal()
        if caller is None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RATE_HOLD_S
        while True:
            try:
                return self.enter(caller.name, group, size(request))
            except ResourceExhausted as err:
                refused = err
            wait_s, left_s = refused.retry_after_s or 0.0, deadline - loop.time()
            if wait_s <= IN_FLIGHT_RETRY_S or wait_s > left_s:  # the in-flight cap, or too long a wait
                break
            allowance = self._allowance(caller.name, group)  # over a rate: wait for it (module doc)
            allowance.num_in_flight += 1
            try:
                await asyncio.sleep(wait_s)
            finally:
                allowance.num_in_flight -= 1
        await abort_with(context, refused)
        raise AssertionError("abort_with returned")
