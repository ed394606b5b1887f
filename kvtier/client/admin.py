"""The operator calls of ``AsyncClient`` (the surface behind the `kvtier` CLI; they need the admin
role): status, workers, sessions, lookup, invalidate, drain, pin, unpin, evict, policy,
snapshots and worker integrity."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from kvtier.client.connection import Connection
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.records import (
    ControllerStatus,
    DrainRequest,
    EvictRequest,
    EvictResult,
    GetPolicyRequest,
    IntegrityResult,
    InvalidateRequest,
    InvalidateResult,
    InvalidationScope,
    ListSessionsRequest,
    LookupRequest,
    LookupResult,
    PageKeyPrefix,
    PinId,
    PinRequest,
    PinResult,
    Policy,
    PolicyHistoryRequest,
    Prefix,
    RollbackPolicyRequest,
    SessionInfo,
    SessionPage,
    SessionState,
    SetPolicyRequest,
    SnapshotRequest,
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
from kvtier.rpc._gen import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc
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
from kvtier.rpc.convert.limits import DEFAULT_LIST_SESSIONS_LIMIT, DEFAULT_POLICY_HISTORY_LIMIT
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
from kvtier.rpc.convert.worker import from_proto_integrity_result, from_proto_worker_stats

PrefixLike = Sequence[int] | TokenPrefix | PageKeyPrefix
"""A prefix as admin calls take it: token ids (the server derives the page keys) or a record."""


class AdminClient(Connection):
    """Admin and worker-admin calls over a ``Connection``; reads and state-setting calls are
    retried on UNAVAILABLE, calls whose repeat would act twice never are."""

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
        replicas: int = 0,
        timeout_s: float | None = None,
    ) -> PinResult:
        """Keep ``prefix``'s pages in ``tier`` or faster until ``unpin`` (or ``ttl_s``); with
        ``replicas`` N, on N workers (copies made from a survivor when a holder is lost or
        drained). Not retried: a repeat would add a second pin."""
        request = PinRequest(namespace=namespace, prefix=_as_prefix(prefix), tier=tier, ttl_s=ttl_s,
                             replicas=replicas)
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


def _as_prefix(prefix: PrefixLike) -> Prefix:
    if isinstance(prefix, TokenPrefix | PageKeyPrefix):
        return prefix
    return TokenPrefix(token_ids=tuple(prefix))
