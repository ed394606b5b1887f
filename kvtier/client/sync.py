"""``Client``: ``AsyncClient``'s methods, synchronous, on a private event-loop thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from kvtier.client.admin import PrefixLike
from kvtier.client.async_client import AsyncClient
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.params import SamplingParams
from kvtier.domain.records import (
    ControllerStatus,
    EvictResult,
    GenerateEvent,
    GenerateFinal,
    IntegrityResult,
    InvalidateResult,
    InvalidationScope,
    LookupResult,
    PinResult,
    Policy,
    RouteDecision,
    ServedModel,
    SessionInfo,
    SessionPage,
    SessionState,
    UnpinResult,
    VersionedPolicy,
    WorkerInfo,
    WorkerSnapshot,
    WorkerStats,
)
from kvtier.domain.tiers import Tier
from kvtier.rpc.convert.limits import DEFAULT_POLICY_HISTORY_LIMIT
from kvtier.runtime.config import ClientConfig

T = TypeVar("T")


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
