"""Messages of the Router service: route requests and decisions, ranked workers, served models."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.domain.records import RankedWorker, RouteDecision, RouteRequest, ServedModel, SessionId, WorkerId
from kvtier.rpc._gen import router_pb2
from kvtier.rpc.convert.common import (
    from_proto_model_facts,
    from_proto_namespace_identity,
    from_proto_peer_fetch,
    from_proto_tokens_by_tier,
    to_proto_model_facts,
    to_proto_namespace_identity,
    to_proto_peer_fetch,
    to_proto_tokens_by_tier,
)
from kvtier.rpc.convert.fields import (
    join_path,
    prefix_fields,
    read_finite,
    read_list,
    read_optional_string,
    read_prefix,
    read_string,
    required_message,
)
from kvtier.rpc.convert.limits import MAX_IDENTITY_FIELD_CHARS, MAX_TEXT_CHARS


def to_proto_route_request(request: RouteRequest) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(
        namespace=to_proto_namespace_identity(request.namespace),
        session_id=request.session_id or "",
        **prefix_fields(request.prefix),
    )


def from_proto_route_request(msg: router_pb2.RouteRequest, path: str = "") -> RouteRequest:
    namespace = from_proto_namespace_identity(
        required_message(msg, "namespace", path), join_path(path, "namespace")
    )
    prefix = read_prefix(msg, path)
    assert prefix is not None
    return RouteRequest(
        namespace=namespace,
        prefix=prefix,
        session_id=SessionId(s)
        if (s := read_optional_string(msg.session_id, join_path(path, "session_id")))
        else None,
    )


def to_proto_ranked_worker(worker: RankedWorker) -> router_pb2.RankedWorker:
    return router_pb2.RankedWorker(
        worker_id=worker.worker_id,
        address=worker.address,
        score=worker.score,
        matched_tokens=to_proto_tokens_by_tier(worker.matched_tokens),
        is_affinity=worker.is_affinity,
        ticket=worker.ticket or "",
        fetch=to_proto_peer_fetch(worker.fetch) if worker.fetch is not None else None,
        estimated_ttft_ms=worker.estimated_ttft_ms,
    )


def from_proto_ranked_worker(msg: router_pb2.RankedWorker, path: str = "") -> RankedWorker:
    return RankedWorker(
        worker_id=WorkerId(read_string(msg.worker_id, join_path(path, "worker_id"), required=True)),
        address=read_string(msg.address, join_path(path, "address"), required=True),
        score=read_finite(msg.score, join_path(path, "score")),
        matched_tokens=from_proto_tokens_by_tier(msg.matched_tokens, join_path(path, "matched_tokens")),
        is_affinity=msg.is_affinity,
        ticket=msg.ticket or None,
        fetch=from_proto_peer_fetch(msg.fetch, join_path(path, "fetch")) if msg.HasField("fetch") else None,
        estimated_ttft_ms=read_finite(msg.estimated_ttft_ms, join_path(path, "estimated_ttft_ms")),
    )


def to_proto_route_decision(decision: RouteDecision) -> router_pb2.RouteResponse:
    return router_pb2.RouteResponse(
        workers=[to_proto_ranked_worker(w) for w in decision.workers],
        degraded=decision.is_degraded,
        degraded_reason=decision.degraded_reason or "",
    )


def to_proto_served_models(models: Sequence[ServedModel]) -> router_pb2.ListModelsResponse:
    return router_pb2.ListModelsResponse(models=[
        router_pb2.ServedModel(
            namespace=to_proto_namespace_identity(m.namespace),
            facts=to_proto_model_facts(m.facts) if m.facts is not None else None,
            adapters=m.adapters,
            num_workers=m.num_workers,
        )
        for m in models
    ])


def from_proto_served_models(msg: router_pb2.ListModelsResponse, path: str = "") -> tuple[ServedModel, ...]:
    def one(m: router_pb2.ServedModel, p: str) -> ServedModel:
        return ServedModel(
            namespace=from_proto_namespace_identity(required_message(m, "namespace", p), join_path(p, "namespace")),
            facts=from_proto_model_facts(m.facts, join_path(p, "facts")) if m.HasField("facts") else None,
            adapters=read_list(m.adapters, join_path(p, "adapters"),
                           lambda a, q: read_string(a, q, max_chars=MAX_IDENTITY_FIELD_CHARS)),
            num_workers=m.num_workers,
        )

    return read_list(msg.models, join_path(path, "models"), one)


def from_proto_route_decision(msg: router_pb2.RouteResponse, path: str = "") -> RouteDecision:
    reason = read_string(msg.degraded_reason, join_path(path, "degraded_reason"), max_chars=MAX_TEXT_CHARS)
    return RouteDecision(
        workers=read_list(msg.workers, join_path(path, "workers"), from_proto_ranked_worker),
        degraded_reason=reason if msg.degraded else None,
    )
