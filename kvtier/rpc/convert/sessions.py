"""Messages of the Sessions service: pause, returning and end requests, session info."""

from __future__ import annotations

from kvtier.domain.records import (
    EndRequest,
    PauseRequest,
    PredictionSource,
    ReturningRequest,
    SessionId,
    SessionInfo,
    SessionState,
    WorkerId,
)
from kvtier.rpc._gen import sessions_pb2
from kvtier.rpc.convert.fields import (
    EnumMap,
    join_path,
    optional_field,
    read_optional_duration,
    read_optional_string,
    read_optional_tier,
    read_string,
    required_message,
    wire_optional_tier,
)
from kvtier.rpc.convert.limits import MAX_TEXT_CHARS

SESSION_STATES = EnumMap(SessionState, sessions_pb2.SessionState, "SESSION_STATE_")
_PREDICTION_SOURCES = EnumMap(PredictionSource, sessions_pb2.PredictionSource, "PREDICTION_SOURCE_")


def _session_id(value: str, path: str) -> SessionId:
    return SessionId(read_string(value, path, required=True))


def to_proto_pause_request(request: PauseRequest) -> sessions_pb2.PauseRequest:
    return sessions_pb2.PauseRequest(
        session_id=request.session_id, tool_name=request.tool_name or "", expected_ms=request.expected_ms
    )


def from_proto_pause_request(msg: sessions_pb2.PauseRequest, path: str = "") -> PauseRequest:
    return PauseRequest(
        session_id=_session_id(msg.session_id, join_path(path, "session_id")),
        tool_name=read_optional_string(msg.tool_name, join_path(path, "tool_name"), max_chars=MAX_TEXT_CHARS),
        expected_ms=read_optional_duration(msg, "expected_ms", path),
    )


def to_proto_returning_request(request: ReturningRequest) -> sessions_pb2.ReturningRequest:
    return sessions_pb2.ReturningRequest(session_id=request.session_id, eta_ms=request.eta_ms)


def from_proto_returning_request(msg: sessions_pb2.ReturningRequest, path: str = "") -> ReturningRequest:
    return ReturningRequest(
        session_id=_session_id(msg.session_id, join_path(path, "session_id")),
        eta_ms=read_optional_duration(msg, "eta_ms", path),
    )


def to_proto_end_request(request: EndRequest) -> sessions_pb2.EndRequest:
    return sessions_pb2.EndRequest(session_id=request.session_id, drop=request.drop)


def from_proto_end_request(msg: sessions_pb2.EndRequest, path: str = "") -> EndRequest:
    return EndRequest(session_id=_session_id(msg.session_id, join_path(path, "session_id")), drop=msg.drop)


def to_proto_session_info(info: SessionInfo) -> sessions_pb2.SessionInfo:
    return sessions_pb2.SessionInfo(
        session_id=info.session_id,
        state=SESSION_STATES.to_wire[info.state],
        worker_id=info.worker_id or "",
        tool_name=info.tool_name or "",
        paused_at_ms=info.paused_at_ms,
        predicted_return_at_ms=info.predicted_return_at_ms,
        prediction_source=(
            _PREDICTION_SOURCES.to_wire[info.prediction_source] if info.prediction_source is not None
            else sessions_pb2.PREDICTION_SOURCE_UNSPECIFIED
        ),
        prefetch_at_ms=info.prefetch_at_ms,
        parked_tier=wire_optional_tier(info.parked_tier),
        num_cached_tokens=info.num_cached_tokens,
    )


def from_proto_session_info(msg: sessions_pb2.SessionInfo, path: str = "session") -> SessionInfo:
    worker_id = read_optional_string(msg.worker_id, join_path(path, "worker_id"))
    return SessionInfo(
        session_id=_session_id(msg.session_id, join_path(path, "session_id")),
        state=SESSION_STATES.parse(msg.state, join_path(path, "state")),
        worker_id=WorkerId(worker_id) if worker_id else None,
        tool_name=read_optional_string(msg.tool_name, join_path(path, "tool_name"), max_chars=MAX_TEXT_CHARS),
        paused_at_ms=optional_field(msg, "paused_at_ms"),
        predicted_return_at_ms=optional_field(msg, "predicted_return_at_ms"),
        prediction_source=_PREDICTION_SOURCES.parse_optional(
            msg.prediction_source, join_path(path, "prediction_source")
        ),
        prefetch_at_ms=optional_field(msg, "prefetch_at_ms"),
        parked_tier=read_optional_tier(msg, "parked_tier", path),
        num_cached_tokens=msg.num_cached_tokens,
    )


def to_proto_pause_response(info: SessionInfo) -> sessions_pb2.PauseResponse:
    return sessions_pb2.PauseResponse(session=to_proto_session_info(info))


def from_proto_pause_response(msg: sessions_pb2.PauseResponse, path: str = "") -> SessionInfo:
    return from_proto_session_info(required_message(msg, "session", path), join_path(path, "session"))


def to_proto_returning_response(info: SessionInfo) -> sessions_pb2.ReturningResponse:
    return sessions_pb2.ReturningResponse(session=to_proto_session_info(info))


def from_proto_returning_response(msg: sessions_pb2.ReturningResponse, path: str = "") -> SessionInfo:
    return from_proto_session_info(required_message(msg, "session", path), join_path(path, "session"))


def to_proto_end_response(info: SessionInfo) -> sessions_pb2.EndResponse:
    return sessions_pb2.EndResponse(session=to_proto_session_info(info))


def from_proto_end_response(msg: sessions_pb2.EndResponse, path: str = "") -> SessionInfo:
    return from_proto_session_info(required_message(msg, "session", path), join_path(path, "session"))
