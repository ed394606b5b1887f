"""Admin service, minimal: Status and Lookup. The operator RPCs (ListWorkers, Drain, Invalidate,
Pin, Evict, policies, Snapshot, ListSessions) answer UNIMPLEMENTED until the operator issue.

Status answers on every controller (it is how an operator finds the leader); Lookup, like
Route, only on the leader (or an orphaned leader), since a standby renews no leases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio

from kvtier.controller.router import Router, principal_tenant
from kvtier.records import ControllerStatus
from kvtier.rpc import convert
from kvtier.rpc._gen import admin_pb2, admin_pb2_grpc
from kvtier.rpc.status import rpc_errors


def _unimplemented(rpc: str) -> Callable[..., Any]:
    async def method(self: AdminServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # UNIMPLEMENTED has no domain error in kvtier.errors (nothing else needs it); this is
        # the one status code chosen outside kvtier/rpc/status.py until the operator issue.
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"Admin.{rpc} is not implemented by this controller yet; Admin.Status and Admin.Lookup are",
        )

    method.__name__ = method.__qualname__ = rpc
    return method


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, router: Router, status: Callable[[], ControllerStatus]) -> None:
        self._router = router
        self._status = status

    @rpc_errors
    async def Status(
        self, request: admin_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StatusResponse:
        return convert.to_proto_controller_status(self._status())

    @rpc_errors
    async def Lookup(
        self, request: admin_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.LookupResponse:
        self._router.access.check_serving()
        lookup = convert.from_proto_lookup_request(request)
        return convert.to_proto_lookup_result(await self._router.lookup(lookup, principal_tenant(context)))

    ListWorkers = _unimplemented("ListWorkers")
    ListSessions = _unimplemented("ListSessions")
    Invalidate = _unimplemented("Invalidate")
    Drain = _unimplemented("Drain")
    Pin = _unimplemented("Pin")
    Unpin = _unimplemented("Unpin")
    Evict = _unimplemented("Evict")
    SetPolicy = _unimplemented("SetPolicy")
    GetPolicy = _unimplemented("GetPolicy")
    PolicyHistory = _unimplemented("PolicyHistory")
    RollbackPolicy = _unimplemented("RollbackPolicy")
    Snapshot = _unimplemented("Snapshot")
