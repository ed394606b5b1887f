"""Messages of the Admin service: controller status, workers, session lists, lookup, invalidate,
drain, pin, unpin, evict and snapshots."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.domain.records import (
    BootId,
    ControllerStatus,
    DrainRequest,
    EvictRequest,
    EvictResult,
    InvalidateRequest,
    InvalidateResult,
    ListSessionsRequest,
    LookupRequest,
    LookupResult,
    PinId,
    PinRequest,
    PinResult,
    SessionPage,
    SnapshotId,
    SnapshotRequest,
    UnpinRequest,
    UnpinResult,
    WorkerId,
    WorkerInfo,
    WorkerMatch,
    WorkerSnapshot,
    WorkerState,
)
from kvtier.rpc._gen import admin_pb2
from kvtier.rpc.convert.common import (
    from_proto_invalidation_scope,
    from_proto_model_identity,
    from_proto_namespace_identity,
    from_proto_tokens_by_tier,
    read_capacities,
    read_occupancies,
    to_proto_invalidation_scope,
    to_proto_model_identity,
    to_proto_namespace_identity,
    to_proto_tier_capacity,
    to_proto_tier_occupancy,
    to_proto_tokens_by_tier,
)
from kvtier.rpc.convert.fields import (
    EnumMap,
    invalid,
    join_path,
    optional_field,
    prefix_fields,
    read_digest,
    read_list,
    read_list_limit,
    read_optional_duration,
    read_optional_string,
    read_optional_tier,
    read_prefix,
    read_string,
    read_tier,
    required_message,
    wire_optional_tier,
    wire_tier,
)
from kvtier.rpc.convert.limits import (
    DEFAULT_LIST_SESSIONS_LIMIT,
    MAX_IDENTITY_FIELD_CHARS,
    MAX_PIN_REPLICAS,
    MAX_TEXT_CHARS,
)
from kvtier.rpc.convert.sessions import SESSION_STATES, from_proto_session_info, to_proto_session_info

_WORKER_STATES = EnumMap(WorkerState, admin_pb2.WorkerState, "WORKER_STATE_")


def to_proto_controller_status(status: ControllerStatus) -> admin_pb2.StatusResponse:
    return admin_pb2.StatusResponse(
        controller_id=status.controller_id,
        is_leader=status.is_leader,
        leader_address=status.leader_address or "",
        version=status.version,
        uptime_s=status.uptime_s,
        num_workers=status.num_workers,
        num_live_workers=status.num_live_workers,
        num_active_sessions=status.num_active_sessions,
        num_paused_sessions=status.num_paused_sessions,
        num_resuming_sessions=status.num_resuming_sessions,
        tiers=[to_proto_tier_occupancy(t) for t in status.tiers],
        policy_version=status.policy_version,
        is_directory_reachable=status.is_directory_reachable,
    )


def from_proto_controller_status(msg: admin_pb2.StatusResponse, path: str = "") -> ControllerStatus:
    return ControllerStatus(
        controller_id=read_string(msg.controller_id, join_path(path, "controller_id")),
        is_leader=msg.is_leader,
        leader_address=read_optional_string(msg.leader_address, join_path(path, "leader_address")),
        version=read_string(msg.version, join_path(path, "version")),
        uptime_s=msg.uptime_s,
        num_workers=msg.num_workers,
        num_live_workers=msg.num_live_workers,
        num_active_sessions=msg.num_active_sessions,
        num_paused_sessions=msg.num_paused_sessions,
        num_resuming_sessions=msg.num_resuming_sessions,
        tiers=read_occupancies(msg.tiers, join_path(path, "tiers")),
        policy_version=msg.policy_version,
        is_directory_reachable=msg.is_directory_reachable,
    )


def to_proto_worker_info(info: WorkerInfo) -> admin_pb2.WorkerInfo:
    return admin_pb2.WorkerInfo(
        worker_id=info.worker_id,
        address=info.address,
        boot_id=info.boot_id,
        state=_WORKER_STATES.to_wire[info.state],
        model=to_proto_model_identity(info.model),
        adapters=info.adapters,
        page_size=info.page_size,
        capacities=[to_proto_tier_capacity(c) for c in info.capacities],
        tiers=[to_proto_tier_occupancy(t) for t in info.tiers],
        queue_depth=info.queue_depth,
        num_running_seqs=info.num_running_seqs,
        last_heartbeat_at_ms=info.last_heartbeat_at_ms,
    )


def from_proto_worker_info(msg: admin_pb2.WorkerInfo, path: str = "worker") -> WorkerInfo:
    return WorkerInfo(
        worker_id=WorkerId(read_string(msg.worker_id, join_path(path, "worker_id"), required=True)),
        address=read_string(msg.address, join_path(path, "address")),
        boot_id=BootId(read_string(msg.boot_id, join_path(path, "boot_id"))),
        state=_WORKER_STATES.parse(msg.state, join_path(path, "state")),
        model=from_proto_model_identity(required_message(msg, "model", path), join_path(path, "model")),
        page_size=msg.page_size,
        capacities=read_capacities(msg.capacities, join_path(path, "capacities")),
        tiers=read_occupancies(msg.tiers, join_path(path, "tiers")),
        adapters=read_list(
            msg.adapters,
            join_path(path, "adapters"),
            lambda a, p: read_string(a, p, max_chars=MAX_IDENTITY_FIELD_CHARS),
        ),
        queue_depth=msg.queue_depth,
        num_running_seqs=msg.num_running_seqs,
        last_heartbeat_at_ms=msg.last_heartbeat_at_ms,
    )


def to_proto_worker_list(workers: Sequence[WorkerInfo]) -> admin_pb2.ListWorkersResponse:
    return admin_pb2.ListWorkersResponse(workers=[to_proto_worker_info(w) for w in workers])


def from_proto_worker_list(msg: admin_pb2.ListWorkersResponse, path: str = "") -> tuple[WorkerInfo, ...]:
    return read_list(msg.workers, join_path(path, "workers"), from_proto_worker_info)



def to_proto_list_sessions_request(request: ListSessionsRequest) -> admin_pb2.ListSessionsRequest:
    return admin_pb2.ListSessionsRequest(
        state=SESSION_STATES.to_wire[request.state] if request.state is not None else None,
        limit=request.limit,
        page_token=request.page_token or "",
    )


def from_proto_list_sessions_request(
    msg: admin_pb2.ListSessionsRequest, path: str = ""
) -> ListSessionsRequest:
    return ListSessionsRequest(
        state=SESSION_STATES.parse(msg.state, join_path(path, "state")) if msg.HasField("state") else None,
        limit=read_list_limit(msg, path, DEFAULT_LIST_SESSIONS_LIMIT),
        page_token=read_optional_string(msg.page_token, join_path(path, "page_token"), max_chars=MAX_TEXT_CHARS),
    )


def to_proto_session_page(page: SessionPage) -> admin_pb2.ListSessionsResponse:
    return admin_pb2.ListSessionsResponse(
        sessions=[to_proto_session_info(s) for s in page.sessions], next_page_token=page.next_page_token or ""
    )


def from_proto_session_page(msg: admin_pb2.ListSessionsResponse, path: str = "") -> SessionPage:
    return SessionPage(
        sessions=read_list(msg.sessions, join_path(path, "sessions"), from_proto_session_info),
        next_page_token=read_optional_string(
            msg.next_page_token, join_path(path, "next_page_token"), max_chars=MAX_TEXT_CHARS
        ),
    )


def to_proto_lookup_request(request: LookupRequest) -> admin_pb2.LookupRequest:
    return admin_pb2.LookupRequest(
        namespace=to_proto_namespace_identity(request.namespace), **prefix_fields(request.prefix)
    )


def from_proto_lookup_request(msg: admin_pb2.LookupRequest, path: str = "") -> LookupRequest:
    namespace = from_proto_namespace_identity(
        required_message(msg, "namespace", path), join_path(path, "namespace")
    )
    prefix = read_prefix(msg, path)
    assert prefix is not None
    return LookupRequest(namespace=namespace, prefix=prefix)


def to_proto_worker_match(match: WorkerMatch) -> admin_pb2.WorkerMatch:
    return admin_pb2.WorkerMatch(
        worker_id=match.worker_id, matched_tokens=to_proto_tokens_by_tier(match.matched_tokens)
    )


def from_proto_worker_match(msg: admin_pb2.WorkerMatch, path: str = "") -> WorkerMatch:
    return WorkerMatch(
        worker_id=WorkerId(read_string(msg.worker_id, join_path(path, "worker_id"), required=True)),
        matched_tokens=from_proto_tokens_by_tier(msg.matched_tokens),
    )


def to_proto_lookup_result(result: LookupResult) -> admin_pb2.LookupResponse:
    return admin_pb2.LookupResponse(
        namespace_digest=result.namespace_digest,
        num_query_pages=result.num_query_pages,
        matches=[to_proto_worker_match(m) for m in result.matches],
    )


def from_proto_lookup_result(msg: admin_pb2.LookupResponse, path: str = "") -> LookupResult:
    return LookupResult(
        namespace_digest=read_digest(msg.namespace_digest, join_path(path, "namespace_digest")),
        num_query_pages=msg.num_query_pages,
        matches=read_list(msg.matches, join_path(path, "matches"), from_proto_worker_match),
    )


def to_proto_invalidate_request(request: InvalidateRequest) -> admin_pb2.InvalidateRequest:
    return admin_pb2.InvalidateRequest(
        scope=to_proto_invalidation_scope(request.scope), reason=request.reason
    )


def from_proto_invalidate_request(msg: admin_pb2.InvalidateRequest, path: str = "") -> InvalidateRequest:
    return InvalidateRequest(
        scope=from_proto_invalidation_scope(required_message(msg, "scope", path), join_path(path, "scope")),
        reason=read_string(msg.reason, join_path(path, "reason"), max_chars=MAX_TEXT_CHARS),
    )


def to_proto_invalidate_result(result: InvalidateResult) -> admin_pb2.InvalidateResponse:
    return admin_pb2.InvalidateResponse(
        policy_epoch=result.policy_epoch, num_workers_notified=result.num_workers_notified
    )


def from_proto_invalidate_result(msg: admin_pb2.InvalidateResponse, path: str = "") -> InvalidateResult:
    return InvalidateResult(policy_epoch=msg.policy_epoch, num_workers_notified=msg.num_workers_notified)


def to_proto_drain_request(request: DrainRequest) -> admin_pb2.DrainRequest:
    return admin_pb2.DrainRequest(worker_id=request.worker_id, resume=request.resume)


def from_proto_drain_request(msg: admin_pb2.DrainRequest, path: str = "") -> DrainRequest:
    return DrainRequest(
        worker_id=WorkerId(read_string(msg.worker_id, join_path(path, "worker_id"), required=True)), resume=msg.resume
    )


def to_proto_drain_response(info: WorkerInfo) -> admin_pb2.DrainResponse:
    return admin_pb2.DrainResponse(worker=to_proto_worker_info(info))


def from_proto_drain_response(msg: admin_pb2.DrainResponse, path: str = "") -> WorkerInfo:
    return from_proto_worker_info(required_message(msg, "worker", path), join_path(path, "worker"))


def to_proto_pin_request(request: PinRequest) -> admin_pb2.PinRequest:
    return admin_pb2.PinRequest(
        namespace=to_proto_namespace_identity(request.namespace),
        tier=wire_tier(request.tier),
        ttl_s=request.ttl_s,
        replicas=request.replicas,
        **prefix_fields(request.prefix),
    )


def from_proto_pin_request(msg: admin_pb2.PinRequest, path: str = "") -> PinRequest:
    namespace = from_proto_namespace_identity(
        required_message(msg, "namespace", path), join_path(path, "namespace")
    )
    prefix = read_prefix(msg, path)
    assert prefix is not None
    return PinRequest(
        namespace=namespace,
        prefix=prefix,
        tier=read_tier(msg.tier, join_path(path, "tier")),
        ttl_s=read_optional_duration(msg, "ttl_s", path, unit_ms=1000),
        replicas=_replicas(msg.replicas, join_path(path, "replicas")),
    )


def _replicas(value: int, path: str) -> int:
    if value > MAX_PIN_REPLICAS:
        raise invalid(path, f"must be at most {MAX_PIN_REPLICAS} workers, got {value}")
    return value


def to_proto_pin_result(result: PinResult) -> admin_pb2.PinResponse:
    return admin_pb2.PinResponse(
        pin_id=result.pin_id, num_pinned_pages=result.num_pinned_pages, expires_at_ms=result.expires_at_ms
    )


def from_proto_pin_result(msg: admin_pb2.PinResponse, path: str = "") -> PinResult:
    return PinResult(
        pin_id=PinId(read_string(msg.pin_id, join_path(path, "pin_id"), required=True)),
        num_pinned_pages=msg.num_pinned_pages,
        expires_at_ms=optional_field(msg, "expires_at_ms"),
    )


def to_proto_unpin_request(request: UnpinRequest) -> admin_pb2.UnpinRequest:
    return admin_pb2.UnpinRequest(pin_id=request.pin_id)


def from_proto_unpin_request(msg: admin_pb2.UnpinRequest, path: str = "") -> UnpinRequest:
    return UnpinRequest(pin_id=PinId(read_string(msg.pin_id, join_path(path, "pin_id"), required=True)))


def to_proto_unpin_result(result: UnpinResult) -> admin_pb2.UnpinResponse:
    return admin_pb2.UnpinResponse(num_unpinned_pages=result.num_unpinned_pages)


def from_proto_unpin_result(msg: admin_pb2.UnpinResponse, path: str = "") -> UnpinResult:
    return UnpinResult(num_unpinned_pages=msg.num_unpinned_pages)


def to_proto_evict_request(request: EvictRequest) -> admin_pb2.EvictRequest:
    return admin_pb2.EvictRequest(
        namespace=to_proto_namespace_identity(request.namespace),
        worker_id=request.worker_id or "",
        demote_to_tier=wire_optional_tier(request.demote_to_tier),
        **prefix_fields(request.prefix),
    )


def from_proto_evict_request(msg: admin_pb2.EvictRequest, path: str = "") -> EvictRequest:
    namespace = from_proto_namespace_identity(
        required_message(msg, "namespace", path), join_path(path, "namespace")
    )
    worker_id = read_optional_string(msg.worker_id, join_path(path, "worker_id"))
    return EvictRequest(
        namespace=namespace,
        prefix=read_prefix(msg, path, required=False),
        worker_id=WorkerId(worker_id) if worker_id else None,
        demote_to_tier=read_optional_tier(msg, "demote_to_tier", path),
    )


def to_proto_evict_result(result: EvictResult) -> admin_pb2.EvictResponse:
    return admin_pb2.EvictResponse(num_pages=result.num_pages, num_workers=result.num_workers)


def from_proto_evict_result(msg: admin_pb2.EvictResponse, path: str = "") -> EvictResult:
    return EvictResult(num_pages=msg.num_pages, num_workers=msg.num_workers)



def to_proto_snapshot_request(request: SnapshotRequest) -> admin_pb2.SnapshotRequest:
    return admin_pb2.SnapshotRequest(worker_ids=request.worker_ids, wait=request.wait)


def from_proto_snapshot_request(msg: admin_pb2.SnapshotRequest, path: str = "") -> SnapshotRequest:
    worker_ids = read_list(
        msg.worker_ids, join_path(path, "worker_ids"), lambda w, p: WorkerId(read_string(w, p, required=True))
    )
    return SnapshotRequest(worker_ids=worker_ids, wait=msg.wait)


def to_proto_worker_snapshot(snapshot: WorkerSnapshot) -> admin_pb2.WorkerSnapshot:
    return admin_pb2.WorkerSnapshot(
        worker_id=snapshot.worker_id,
        snapshot_id=snapshot.snapshot_id,
        is_complete=snapshot.is_complete,
        num_pages=snapshot.num_pages,
    )


def from_proto_worker_snapshot(msg: admin_pb2.WorkerSnapshot, path: str = "") -> WorkerSnapshot:
    return WorkerSnapshot(
        worker_id=WorkerId(read_string(msg.worker_id, join_path(path, "worker_id"), required=True)),
        snapshot_id=SnapshotId(read_string(msg.snapshot_id, join_path(path, "snapshot_id"), required=True)),
        is_complete=msg.is_complete,
        num_pages=msg.num_pages,
    )


def to_proto_snapshot_result(snapshots: Sequence[WorkerSnapshot]) -> admin_pb2.SnapshotResponse:
    return admin_pb2.SnapshotResponse(snapshots=[to_proto_worker_snapshot(s) for s in snapshots])


def from_proto_snapshot_result(msg: admin_pb2.SnapshotResponse, path: str = "") -> tuple[WorkerSnapshot, ...]:
    return read_list(msg.snapshots, join_path(path, "snapshots"), from_proto_worker_snapshot)
