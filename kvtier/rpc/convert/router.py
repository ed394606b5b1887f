"""Messages of the Router service: route requests and decisions, ranked workers, served models."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.domain.records import (
    RankedWorker,
    RouteDecision,
    RouteRequest,
    ServedModel,
    SessionId,
    WorkerId,
)
from kvtier.rpc._gen import router_pb2
from kvtier.rpc.convert.common import (
    from_proto_model_facts,
    from_proto_namespace_identity,
    from_proto_tokens_by_tier,
    to_proto_model_facts,
    to_proto_namespace_identity,
    to_proto_tokens_by_tier,
)
from kvtier.rpc.convert.fields import (
    _finite,
    _join,
    _list,
    _optional_string,
    _prefix_fields,
    _prefix_from,
    _required_message,
    _string,
)
from kvtier.rpc.convert.limits import MAX_IDENTITY_FIELD_CHARS, MAX_TEXT_CHARS


def to_proto_route_request(request: RouteRequest) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(
        namespace=to_proto_namespace_identity(request.namespace),
        session_id=request.session_id or "",
        **_prefix_fields(request.prefix),
    )


def from_proto_route_request(msg: router_pb2.RouteRequest, path: str = "") -> RouteRequest:
    namespace = from_proto_namespace_identity(
        _required_message(msg, "namespace", path), _join(path, "namespace")
    )
    prefix = _prefix_from(msg, path)
    assert prefix is not None
    return RouteRequest(
        namespace=namespace,
        prefix=prefix,
        session_id=SessionId(s)
        if (s := _optional_string(msg.session_id, _join(path, "session_id")))
        else None,
    )


def to_proto_ranked_worker(worker: RankedWorker) -> router_pb2.RankedWorker:
    return router_pb2.RankedWorker(
        worker_id=worker.worker_id,
        address=worker.address,
        score=worker.score,
        matched_tokens=to_proto_tokens_by_tier(worker.matched_tokens),
        is_affinity=worker.is_affinity,
    )


def from_proto_ranked_worker(msg: router_pb2.RankedWorker, path: str = "") -> RankedWorker:
    return RankedWorker(
        worker_id=WorkerId(_string(msg.worker_id, _join(path, "worker_id"), required=True)),
        address=_string(msg.address, _join(path, "address"), required=True),
        score=_finite(msg.score, _join(path, "score")),
        matched_tokens=from_proto_tokens_by_tier(msg.matched_tokens, _join(path, "matched_tokens")),
        is_affinity=msg.is_affinity,
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
            namespace=from_proto_namespace_identity(_required_message(m, "namespace", p), _join(p, "namespace")),
            facts=from_proto_model_facts(m.facts, _join(p, "facts")) if m.HasField("facts") else None,
            adapters=_list(m.adapters, _join(p, "adapters"),
                           lambda a, q: _string(a, q, max_chars=MAX_IDENTITY_FIELD_CHARS)),
            num_workers=m.num_workers,
        )

    return _list(msg.models, _join(path, "models"), one)


def from_proto_route_decision(msg: router_pb2.RouteResponse, path: str = "") -> RouteDecision:
    reason = _string(msg.degraded_reason, _join(path, "degraded_reason"), max_chars=MAX_TEXT_CHARS)
    return RouteDecision(
        workers=_list(msg.workers, _join(path, "workers"), from_proto_ranked_worker),
        degraded_reason=reason if msg.degraded else None,
    )
