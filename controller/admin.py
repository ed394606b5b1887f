"""Admin service: a thin shell over the controller's parts (DESIGN §6, §7).

Who answers what:

- every controller: Status (how an operator finds the leader); ListSessions, GetPolicy and
  PolicyHistory (they read Redis, which every controller reaches);
- the leader (or an orphaned leader) only, UNAVAILABLE naming the leader elsewhere: Lookup,
  ListWorkers (workers link to the leader: a standby's registry is empty), Drain and
  Snapshot (commands go down the leader's worker links), SetPolicy and RollbackPolicy (the
  leader applies the new version at once; standbys pick it up within a second), Invalidate,
  Pin, Unpin and Evict (the leader issues epochs and holds the worker links;
  ``kvtier.controller.cache_admin``).

ListSessions pages in session-id order; its page token is opaque to callers (the hex of the
last session id returned), and a page ends with an empty token when no session follows.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import grpc.aio

from kvtier.controller.cache_admin import CacheAdmin
from kvtier.controller.policy_store import PolicyInForce
from kvtier.controller.router import Router, principal_name, principal_tenant
from kvtier.controller.sessions import SessionStore
from kvtier.controller.worker_admin import WorkerAdmin
from kvtier.domain.records import ControllerStatus
from kvtier.rpc._gen import admin_pb2, admin_pb2_grpc
from kvtier.rpc.convert.admin import (
    from_proto_drain_request,
    from_proto_evict_request,
    from_proto_invalidate_request,
    from_proto_list_sessions_request,
    from_proto_lookup_request,
    from_proto_pin_request,
    from_proto_snapshot_request,
    from_proto_unpin_request,
    to_proto_controller_status,
    to_proto_drain_response,
    to_proto_evict_result,
    to_proto_invalidate_result,
    to_proto_lookup_result,
    to_proto_pin_result,
    to_proto_session_page,
    to_proto_snapshot_result,
    to_proto_unpin_result,
    to_proto_worker_list,
)
from kvtier.rpc.convert.policy import (
    from_proto_get_policy_request,
    from_proto_policy_history_request,
    from_proto_rollback_policy_request,
    from_proto_set_policy_request,
    to_proto_get_policy_response,
    to_proto_policy_history,
    to_proto_rollback_policy_response,
    to_proto_set_policy_response,
)
from kvtier.rpc.status import rpc_errors


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(
        self,
        router: Router,
        status: Callable[[], ControllerStatus],
        *,
        policy: PolicyInForce,
        workers: WorkerAdmin,
        sessions: SessionStore,
        cache: CacheAdmin,
    ) -> None:
        self._router = router
        self._cache = cache
        self._status = status
        self._policy = policy
        self._workers = workers
        self._sessions = sessions

    @rpc_errors
    async def Status(
        self, request: admin_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StatusResponse:
        return to_proto_controller_status(self._status())

    @rpc_errors
    async def Lookup(
        self, request: admin_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.LookupResponse:
        self._router.access.check_serving()
        lookup = from_proto_lookup_request(request)
        return to_proto_lookup_result(await self._router.lookup(lookup, principal_tenant(context)))

    @rpc_errors
    async def ListWorkers(
        self, request: admin_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListWorkersResponse:
        self._router.access.check_serving()
        return to_proto_worker_list(self._workers.list_workers())

    @rpc_errors
    async def ListSessions(
        self, request: admin_pb2.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListSessionsResponse:
        page = await self._sessions.page(from_proto_list_sessions_request(request))
        return to_proto_session_page(page)

    @rpc_errors
    async def Invalidate(
        self, request: admin_pb2.InvalidateRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.InvalidateResponse:
        """Raises the policy epoch of the scope (``kvtier.controller.cache_admin``)."""
        self._router.access.check_serving()
        invalidate = from_proto_invalidate_request(request)
        result = await self._cache.invalidate(invalidate, principal_tenant(context))
        return to_proto_invalidate_result(result)

    @rpc_errors
    async def Drain(
        self, request: admin_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DrainResponse:
        """Stops routing to the worker, lets its running requests finish, then drops its cached
        pages; ``resume`` undoes it (``kvtier.controller.worker_admin``)."""
        self._router.access.check_serving()
        info = await self._workers.drain(from_proto_drain_request(request))
        return to_proto_drain_response(info)

    @rpc_errors
    async def Pin(self, request: admin_pb2.PinRequest, context: grpc.aio.ServicerContext) -> admin_pb2.PinResponse:
        self._router.access.check_serving()
        result = await self._cache.pin(from_proto_pin_request(request), principal_tenant(context))
        return to_proto_pin_result(result)

    @rpc_errors
    async def Unpin(
        self, request: admin_pb2.UnpinRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UnpinResponse:
        self._router.access.check_serving()
        return to_proto_unpin_result(await self._cache.unpin(from_proto_unpin_request(request)))

    @rpc_errors
    async def Evict(
        self, request: admin_pb2.EvictRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.EvictResponse:
        self._router.access.check_serving()
        result = await self._cache.evict(from_proto_evict_request(request), principal_tenant(context))
        return to_proto_evict_result(result)

    @rpc_errors
    async def SetPolicy(
        self, request: admin_pb2.SetPolicyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SetPolicyResponse:
        self._router.access.check_serving()
        set_request = from_proto_set_policy_request(request)
        versioned = await self._policy.set(set_request, set_by=principal_name(context))
        return to_proto_set_policy_response(versioned)

    @rpc_errors
    async def GetPolicy(
        self, request: admin_pb2.GetPolicyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetPolicyResponse:
        get_request = from_proto_get_policy_request(request)
        return to_proto_get_policy_response(await self._policy.store.get(get_request.version))

    @rpc_errors
    async def PolicyHistory(
        self, request: admin_pb2.PolicyHistoryRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.PolicyHistoryResponse:
        history_request = from_proto_policy_history_request(request)
        return to_proto_policy_history(await self._policy.store.history(history_request.limit))

    @rpc_errors
    async def RollbackPolicy(
        self, request: admin_pb2.RollbackPolicyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RollbackPolicyResponse:
        self._router.access.check_serving()
        rollback = from_proto_rollback_policy_request(request)
        versioned = await self._policy.rollback(rollback, set_by=principal_name(context))
        return to_proto_rollback_policy_response(versioned)

    @rpc_errors
    async def Snapshot(
        self, request: admin_pb2.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SnapshotResponse:
        self._router.access.check_serving()
        snapshots = await self._workers.snapshot(from_proto_snapshot_request(request))
        return to_proto_snapshot_result(snapshots)
