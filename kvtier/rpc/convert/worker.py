"""Messages of the Worker service: sampling params, Generate requests and their event stream,
integrity reports, worker stats."""

from __future__ import annotations

from kvtier.domain.params import FinishReason, SamplingParams
from kvtier.domain.records import (
    MAX_PRIORITY,
    BootId,
    GenerateEvent,
    GenerateFinal,
    GenerateRequest,
    IntegrityReport,
    IntegrityResult,
    RequestId,
    RunId,
    SessionId,
    TokenChunk,
    Usage,
    WorkerId,
    WorkerStats,
)
from kvtier.rpc._gen import common_pb2, worker_pb2
from kvtier.rpc.convert.common import (
    from_proto_namespace_identity,
    from_proto_peer_fetch,
    from_proto_tokens_by_tier,
    read_occupancies,
    to_proto_namespace_identity,
    to_proto_peer_fetch,
    to_proto_tier_occupancy,
    to_proto_tokens_by_tier,
)
from kvtier.rpc.convert.fields import (
    EnumMap,
    invalid,
    join_path,
    optional_field,
    read_finite,
    read_list,
    read_optional_string,
    read_string,
    read_tier,
    read_token_ids,
    required_message,
    tier_or_unset,
    validate_as,
)
from kvtier.rpc.convert.limits import MAX_PROMPT_TOKENS, MAX_STOP_TOKEN_IDS, MAX_TEXT_CHARS

_FINISH_REASONS = EnumMap(FinishReason, worker_pb2.FinishReason, "FINISH_REASON_")

_SAMPLING_DEFAULTS = SamplingParams()


def to_proto_sampling_params(params: SamplingParams) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop_token_ids=params.stop_token_ids,
        stop_sequences=[common_pb2.TokenIds(ids=s) for s in params.stop_sequences],
        tool_call_sequence=params.tool_call_sequence,
        ignore_eos=params.ignore_eos,
    )


def from_proto_sampling_params(msg: worker_pb2.SamplingParams, path: str = "sampling") -> SamplingParams:
    params = SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else _SAMPLING_DEFAULTS.max_tokens,
        temperature=read_finite(msg.temperature, join_path(path, "temperature")),
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else _SAMPLING_DEFAULTS.top_p,
        seed=optional_field(msg, "seed"),
        stop_token_ids=list(
            read_token_ids(msg.stop_token_ids, join_path(path, "stop_token_ids"), limit=MAX_STOP_TOKEN_IDS)
        ),
        stop_sequences=[list(s.ids) for s in msg.stop_sequences],
        tool_call_sequence=list(msg.tool_call_sequence),
        ignore_eos=msg.ignore_eos,
    )
    # validate() bounds the number and length of the sequences before we scan them.
    validate_as(params.validate, "", path)
    for i, sequence in enumerate(params.stop_sequences):
        read_token_ids(sequence, join_path(path, f"stop_sequences[{i}].ids"), limit=len(sequence))
    read_token_ids(
        params.tool_call_sequence, join_path(path, "tool_call_sequence"), limit=len(params.tool_call_sequence)
    )
    return params


def to_proto_generate_request(request: GenerateRequest) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        namespace=to_proto_namespace_identity(request.namespace),
        prompt_token_ids=request.prompt_token_ids,
        sampling=to_proto_sampling_params(request.sampling),
        session_id=request.session_id or "",
        request_id=request.request_id or "",
        priority=request.priority,
        peer_fetch=to_proto_peer_fetch(request.peer_fetch) if request.peer_fetch is not None else None,
    )


def from_proto_generate_request(msg: worker_pb2.GenerateRequest, path: str = "") -> GenerateRequest:
    namespace = from_proto_namespace_identity(
        required_message(msg, "namespace", path), join_path(path, "namespace")
    )
    prompt = read_token_ids(
        msg.prompt_token_ids, join_path(path, "prompt_token_ids"), limit=MAX_PROMPT_TOKENS, volume=True
    )
    if not prompt:
        raise invalid(join_path(path, "prompt_token_ids"), "must not be empty")
    sampling = (
        from_proto_sampling_params(msg.sampling, join_path(path, "sampling"))
        if msg.HasField("sampling")
        else SamplingParams()
    )
    if abs(msg.priority) > MAX_PRIORITY:
        raise invalid(
            join_path(path, "priority"), f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {msg.priority}"
        )
    session_id = read_optional_string(msg.session_id, join_path(path, "session_id"))
    request_id = read_optional_string(msg.request_id, join_path(path, "request_id"))
    return GenerateRequest(
        namespace=namespace,
        prompt_token_ids=prompt,
        sampling=sampling,
        session_id=SessionId(session_id) if session_id else None,
        request_id=RequestId(request_id) if request_id else None,
        priority=msg.priority,
        peer_fetch=from_proto_peer_fetch(msg.peer_fetch, join_path(path, "peer_fetch"))
        if msg.HasField("peer_fetch") else None,
    )


def to_proto_token_chunk(chunk: TokenChunk) -> worker_pb2.TokenChunk:
    return worker_pb2.TokenChunk(token_ids=chunk.token_ids, index=chunk.index)


def from_proto_token_chunk(msg: worker_pb2.TokenChunk, path: str = "tokens") -> TokenChunk:
    ids = read_token_ids(msg.token_ids, join_path(path, "token_ids"), limit=MAX_PROMPT_TOKENS, volume=True)
    return TokenChunk(token_ids=ids, index=msg.index)


def to_proto_usage(usage: Usage) -> worker_pb2.Usage:
    return worker_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        promoted_tokens=usage.promoted_tokens,
        recomputed_tokens=usage.recomputed_tokens,
        generated_tokens=usage.generated_tokens,
        cached_tokens_by_tier=to_proto_tokens_by_tier(usage.cached_tokens_by_tier),
    )


def from_proto_usage(msg: worker_pb2.Usage, path: str = "usage") -> Usage:
    return Usage(
        prompt_tokens=msg.prompt_tokens,
        cached_tokens=msg.cached_tokens,
        promoted_tokens=msg.promoted_tokens,
        recomputed_tokens=msg.recomputed_tokens,
        generated_tokens=msg.generated_tokens,
        cached_tokens_by_tier=from_proto_tokens_by_tier(msg.cached_tokens_by_tier),
    )


def to_proto_generate_final(final: GenerateFinal) -> worker_pb2.GenerateFinal:
    return worker_pb2.GenerateFinal(
        usage=to_proto_usage(final.usage),
        finish_reason=_FINISH_REASONS.to_wire[final.finish_reason],
        run_id=final.run_id,
        ttft_ms=final.ttft_ms,
    )


def from_proto_generate_final(msg: worker_pb2.GenerateFinal, path: str = "final") -> GenerateFinal:
    return GenerateFinal(
        usage=from_proto_usage(msg.usage, join_path(path, "usage")),
        finish_reason=_FINISH_REASONS.parse(msg.finish_reason, join_path(path, "finish_reason")),
        run_id=RunId(read_string(msg.run_id, join_path(path, "run_id"))),
        ttft_ms=read_finite(msg.ttft_ms, join_path(path, "ttft_ms"), minimum=0.0),
    )


def to_proto_generate_event(event: GenerateEvent) -> worker_pb2.GenerateEvent:
    if isinstance(event, TokenChunk):
        return worker_pb2.GenerateEvent(tokens=to_proto_token_chunk(event))
    return worker_pb2.GenerateEvent(final=to_proto_generate_final(event))


def from_proto_generate_event(msg: worker_pb2.GenerateEvent, path: str = "") -> GenerateEvent:
    which = msg.WhichOneof("event")
    if which == "tokens":
        return from_proto_token_chunk(msg.tokens, join_path(path, "tokens"))
    if which == "final":
        return from_proto_generate_final(msg.final, join_path(path, "final"))
    raise invalid(join_path(path, "event"), "must set tokens or final")


def to_proto_integrity_report(report: IntegrityReport) -> worker_pb2.IntegrityReport:
    return worker_pb2.IntegrityReport(
        component=report.component, tier=tier_or_unset(report.tier), problem=report.problem or ""
    )


def from_proto_integrity_report(msg: worker_pb2.IntegrityReport, path: str = "") -> IntegrityReport:
    return IntegrityReport(
        component=read_string(msg.component, join_path(path, "component"), required=True),
        tier=read_tier(msg.tier, join_path(path, "tier")) if msg.tier else None,
        problem=read_optional_string(msg.problem, join_path(path, "problem"), max_chars=MAX_TEXT_CHARS),
    )


def to_proto_integrity_result(result: IntegrityResult) -> worker_pb2.CheckIntegrityResponse:
    return worker_pb2.CheckIntegrityResponse(reports=[to_proto_integrity_report(r) for r in result.reports])


def from_proto_integrity_result(msg: worker_pb2.CheckIntegrityResponse, path: str = "") -> IntegrityResult:
    return IntegrityResult(reports=read_list(msg.reports, join_path(path, "reports"), from_proto_integrity_report))


def to_proto_worker_stats(stats: WorkerStats) -> worker_pb2.StatsResponse:
    return worker_pb2.StatsResponse(
        worker_id=stats.worker_id,
        boot_id=stats.boot_id,
        tiers=[to_proto_tier_occupancy(t) for t in stats.tiers],
        queue_depth=stats.queue_depth,
        num_running_seqs=stats.num_running_seqs,
    )


def from_proto_worker_stats(msg: worker_pb2.StatsResponse, path: str = "") -> WorkerStats:
    return WorkerStats(
        worker_id=WorkerId(read_string(msg.worker_id, join_path(path, "worker_id"), required=True)),
        boot_id=BootId(read_string(msg.boot_id, join_path(path, "boot_id"))),
        tiers=read_occupancies(msg.tiers, join_path(path, "tiers")),
        queue_depth=msg.queue_depth,
        num_running_seqs=msg.num_running_seqs,
    )
