"""The only module that turns protobuf messages into domain records and back.

Naming: ``to_proto_<record>(record) -> message`` and ``from_proto_<record>(message) ->
record``, one pair per record in ``kvtier.domain.records`` (plus ``NamespaceIdentity`` and
``SamplingParams``). Response messages that only wrap one record or a list of records
have their own pair named after the response (``to_proto_pause_response(info)``), so
servicers never build messages themselves.

``from_proto_*`` is where untrusted bytes become trusted records, so it validates:

- required fields (identity fields, ids, oneofs, sub-messages) and enums that are
  unset or carry an unknown number → ``InvalidArgument``;
- values out of range (negative token ids, keys that are not 16 bytes, non-finite
  floats, priorities, list limits) → ``InvalidArgument``;
- data-volume limits (prompt and prefix tokens, page-event batches, page lists of
  commands and snapshot chunks) → ``ResourceExhausted``: the sender must split the
  payload or the request can never fit.

Every error names the offending field by its path from the message being converted
(``namespace.model_id``, ``sampling.top_p``, ``events[3].page_key``). ``to_proto_*``
trusts its input: records are built by our own code. The wire never carries the
namespace policy epoch (server state), so ``to_proto_namespace_identity`` drops it and
``from_proto_namespace_identity`` returns epoch 0 for the server to resolve.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from typing import Any

from kvtier.domain.errors import InvalidArgument, ResourceExhausted
from kvtier.domain.hashing import KEY_BYTES, KV_DTYPES, NamespaceDigest, NamespaceIdentity, PageKey
from kvtier.domain.params import FinishReason, SamplingParams
from kvtier.domain.records import (
    MAX_PRIORITY,
    BootId,
    Command,
    CommandAck,
    CommandId,
    ControllerCommand,
    ControllerStatus,
    DemoteCommand,
    DrainCommand,
    DrainRequest,
    DropCommand,
    EndRequest,
    EvictRequest,
    EvictResult,
    GenerateEvent,
    GenerateFinal,
    GenerateRequest,
    GetPolicyRequest,
    Heartbeat,
    IntegrityReport,
    IntegrityResult,
    InvalidateCommand,
    InvalidateRequest,
    InvalidateResult,
    InvalidationScope,
    InventoryPage,
    InventorySnapshotChunk,
    ListSessionsRequest,
    LookupRequest,
    LookupResult,
    ModelFacts,
    ModelIdentity,
    NamespaceInventory,
    PageEvent,
    PageEventBatch,
    PageEventKind,
    PageKeyPrefix,
    PauseRequest,
    PinCommand,
    PinId,
    PinRequest,
    PinResult,
    Policy,
    PolicyHistoryRequest,
    PredictionSource,
    PrefetchCommand,
    Prefix,
    RankedWorker,
    Registration,
    RequestId,
    RequestSnapshotCommand,
    ReturningRequest,
    RollbackPolicyRequest,
    RouteDecision,
    RouteRequest,
    RunId,
    ServedModel,
    SessionId,
    SessionInfo,
    SessionPage,
    SessionState,
    SetPolicyRequest,
    SnapshotId,
    SnapshotRequest,
    TierCapacity,
    TierOccupancy,
    TokenChunk,
    TokenPrefix,
    TokensByTier,
    UnpinCommand,
    UnpinRequest,
    UnpinResult,
    Usage,
    VersionedPolicy,
    Watermarks,
    WorkerEvent,
    WorkerId,
    WorkerInfo,
    WorkerMatch,
    WorkerSnapshot,
    WorkerState,
    WorkerStats,
)
from kvtier.domain.tiers import Tier
from kvtier.rpc._gen import admin_pb2, common_pb2, router_pb2, sessions_pb2, worker_link_pb2, worker_pb2

# Data-volume limits (ResourceExhausted when exceeded).
MAX_PROMPT_TOKENS = 1 << 20  # prompt and prefix token ids per request
MAX_PREFIX_PAGE_KEYS = MAX_PROMPT_TOKENS // 16  # page keys per prefix (the default page size)
MAX_BATCH_EVENTS = 4096  # page events per PageEventBatch
MAX_COMMAND_PAGES = 65536  # page keys per Demote / Prefetch / Drop command
MAX_SNAPSHOT_CHUNK_PAGES = 16384  # pages per InventorySnapshotChunk
# Shape limits (InvalidArgument when exceeded).
MAX_ID_CHARS = 256  # worker, session, request, run, snapshot and pin ids; addresses
MAX_IDENTITY_FIELD_CHARS = 512  # each string field of a namespace / model identity
MAX_TEXT_CHARS = 4096  # reasons, error messages, tool names, problems
MAX_STOP_TOKEN_IDS = 1024
MAX_LIST_ITEMS = 4096  # adapters, tiers, workers, reports ... in one message
MAX_LIST_LIMIT = 1000  # `limit` of list RPCs
# Durations a caller gives (tool-call estimates, ETAs, pin TTLs): a year at most, so that
# "now + duration" always fits the uint64 timestamps sent back (and a typo is caught).
MAX_DURATION_MS = 365 * 24 * 3600 * 1000
# Servers and channels must raise grpc.max_receive_message_length / max_send_message_length
# to this (gRPC's default of 4 MiB is below a MAX_PROMPT_TOKENS prompt: up to 5 bytes a token).
MAX_MESSAGE_BYTES = 16 << 20
DEFAULT_LIST_SESSIONS_LIMIT = 100
DEFAULT_POLICY_HISTORY_LIMIT = 20
_SAMPLING_DEFAULTS = SamplingParams()

# --------------------------------------------------------------------------- helpers


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _invalid(path: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{path} {message}", field=path)


def _string(value: str, path: str, *, required: bool = False, max_chars: int = MAX_ID_CHARS) -> str:
    if required and not value:
        raise _invalid(path, "must be set")
    if len(value) > max_chars:
        raise _invalid(path, f"must be at most {max_chars} characters, got {len(value)}")
    return value


def _optional_string(value: str, path: str, *, max_chars: int = MAX_ID_CHARS) -> str | None:
    """Empty string on the wire ↔ None in the domain."""
    return _string(value, path, max_chars=max_chars) or None


def _count(values: Sized, path: str, limit: int, *, volume: bool = False) -> None:
    if len(values) > limit:
        error = ResourceExhausted if volume else InvalidArgument
        raise error(f"{path} has {len(values)} items; at most {limit} are allowed", field=path)


def _token_ids(values: Sequence[int], path: str, *, limit: int, volume: bool = False) -> tuple[int, ...]:
    _count(values, path, limit, volume=volume)
    tokens = tuple(values)
    if tokens and min(tokens) < 0:
        index = next(i for i, t in enumerate(tokens) if t < 0)
        raise _invalid(f"{path}[{index}]", f"must be a token id >= 0, got {tokens[index]}")
    return tokens


def _key(value: bytes, path: str) -> PageKey:
    if len(value) != KEY_BYTES:
        raise _invalid(path, f"must be a {KEY_BYTES}-byte page key, got {len(value)} bytes")
    return PageKey(value)


def _keys(values: Sequence[bytes], path: str, *, limit: int) -> tuple[PageKey, ...]:
    _count(values, path, limit, volume=True)
    return tuple(_key(v, f"{path}[{i}]") for i, v in enumerate(values))


def _digest(value: bytes, path: str) -> NamespaceDigest:
    if len(value) != KEY_BYTES:
        raise _invalid(path, f"must be a {KEY_BYTES}-byte namespace digest, got {len(value)} bytes")
    return NamespaceDigest(value)


def _finite(value: float, path: str, *, minimum: float | None = None) -> float:
    if not math.isfinite(value):
        raise _invalid(path, f"must be a finite number, got {value}")
    if minimum is not None and value < minimum:
        raise _invalid(path, f"must be >= {minimum}, got {value}")
    return value


def _optional(msg: Any, name: str) -> Any:
    """Value of a proto3 ``optional`` scalar, or None when unset."""
    return getattr(msg, name) if msg.HasField(name) else None


def _optional_duration(msg: Any, name: str, path: str, *, unit_ms: int = 1) -> int | None:
    """A proto3 ``optional`` duration (in ``unit_ms`` milliseconds), at most ``MAX_DURATION_MS``."""
    value = _optional(msg, name)
    limit = MAX_DURATION_MS // unit_ms
    if value is not None and value > limit:
        raise _invalid(_join(path, name), f"must be at most {limit} (a year), got {value}")
    return value


def _optional_spread(msg: Any, name: str, path: str) -> float | None:
    """A proto3 ``optional`` sigma of a log-normal spread: finite and > 0 when set."""
    value = _optional(msg, name)
    if value is not None and not (math.isfinite(value) and value > 0.0):
        raise _invalid(_join(path, name), f"must be a finite number > 0, got {value}")
    return value


def _required_message(msg: Any, name: str, path: str) -> Any:
    if not msg.HasField(name):
        raise _invalid(_join(path, name), "must be set")
    return getattr(msg, name)


def _tier(value: int, path: str) -> Tier:
    return Tier.from_value(value, field=path)


def _optional_tier(msg: Any, name: str, path: str) -> Tier | None:
    return _tier(getattr(msg, name), _join(path, name)) if msg.HasField(name) else None


def _tier_or_none(tier: Tier | None) -> int:
    return int(tier) if tier is not None else common_pb2.TIER_UNSPECIFIED


class _EnumMap:
    """Domain enum ⇄ wire enum by member name (``FinishReason.TOOL_CALL`` ⇄
    ``FINISH_REASON_TOOL_CALL``). Built at import, so a renamed member fails loudly."""

    def __init__(self, domain: type[enum.Enum], wire: Any, prefix: str) -> None:
        self.to_wire = {member: wire.Value(prefix + member.name) for member in domain}
        self.from_wire = {number: member for member, number in self.to_wire.items()}
        self.valid = ", ".join(member.name for member in domain)

    def parse(self, number: int, path: str) -> Any:
        if number == 0:
            raise _invalid(path, f"must be set to one of {self.valid}")
        try:
            return self.from_wire[number]
        except KeyError:
            raise _invalid(path, f"has unknown value {number}; valid values are {self.valid}") from None

    def parse_optional(self, number: int, path: str) -> Any:
        return None if number == 0 else self.parse(number, path)


_FINISH_REASONS = _EnumMap(FinishReason, worker_pb2.FinishReason, "FINISH_REASON_")
_SESSION_STATES = _EnumMap(SessionState, sessions_pb2.SessionState, "SESSION_STATE_")
_PREDICTION_SOURCES = _EnumMap(PredictionSource, sessions_pb2.PredictionSource, "PREDICTION_SOURCE_")
_PAGE_EVENT_KINDS = _EnumMap(PageEventKind, worker_link_pb2.PageEventKind, "PAGE_EVENT_KIND_")
_WORKER_STATES = _EnumMap(WorkerState, admin_pb2.WorkerState, "WORKER_STATE_")


def _rebased(err: InvalidArgument, old_root: str, new_root: str) -> InvalidArgument:
    """Re-root a field path raised by a domain ``validate()`` (``max_tokens`` or
    ``namespace.page_size``) onto the path of the message being converted."""
    old_field = err.field or old_root
    if old_root and (old_field == old_root or old_field.startswith(old_root + ".")):
        new_field = new_root + old_field[len(old_root) :]
    else:
        new_field = _join(new_root, old_field)
    if new_field == old_field:
        return err
    message = err.message
    message = (
        new_field + message[len(old_field) :] if message.startswith(old_field) else f"{new_field}: {message}"
    )
    return type(err)(message, field=new_field)


def _validate(check: Callable[[], None], old_root: str, new_root: str) -> None:
    try:
        check()
    except InvalidArgument as err:
        raise _rebased(err, old_root, new_root) from None


def _list(items: Sequence[Any], path: str, parse: Callable[[Any, str], Any]) -> tuple[Any, ...]:
    _count(items, path, MAX_LIST_ITEMS)
    return tuple(parse(item, f"{path}[{i}]") for i, item in enumerate(items))


def _unique_tiers(records: Iterable[Any], path: str) -> None:
    seen: set[Tier] = set()
    for i, record in enumerate(records):
        if record.tier in seen:
            raise _invalid(f"{path}[{i}].tier", f"repeats tier {record.tier.label}; one entry per tier")
        seen.add(record.tier)


# The fields of every message with `oneof prefix { TokenIds token_ids; PageKeys page_keys; }`.
def _prefix_fields(prefix: Prefix | None) -> dict[str, Any]:
    if prefix is None:
        return {}
    if isinstance(prefix, TokenPrefix):
        return {"token_ids": common_pb2.TokenIds(ids=prefix.token_ids)}
    return {"page_keys": common_pb2.PageKeys(keys=prefix.page_keys)}


def _prefix_from(msg: Any, path: str, *, required: bool = True) -> Prefix | None:
    which = msg.WhichOneof("prefix")
    if which == "token_ids":
        ids = _token_ids(
            msg.token_ids.ids, _join(path, "token_ids.ids"), limit=MAX_PROMPT_TOKENS, volume=True
        )
        return TokenPrefix(token_ids=ids)
    if which == "page_keys":
        return PageKeyPrefix(
            page_keys=_keys(msg.page_keys.keys, _join(path, "page_keys.keys"), limit=MAX_PREFIX_PAGE_KEYS)
        )
    if required:
        raise _invalid(_join(path, "prefix"), "must set token_ids or page_keys")
    return None


# --------------------------------------------------------------------------- common


def to_proto_namespace_identity(identity: NamespaceIdentity) -> common_pb2.NamespaceIdentity:
    """The policy epoch is server state and is not sent (see module docstring)."""
    return common_pb2.NamespaceIdentity(
        model_id=identity.model_id,
        weights_digest=identity.weights_digest,
        tokenizer_digest=identity.tokenizer_digest,
        adapter=identity.adapter,
        rope_config=identity.rope_config,
        kv_dtype=identity.kv_dtype,
        page_size=identity.page_size,
        tenant=identity.tenant,
    )


_IDENTITY_STRINGS = ("model_id", "weights_digest", "tokenizer_digest", "adapter", "rope_config", "tenant")


def from_proto_namespace_identity(
    msg: common_pb2.NamespaceIdentity, path: str = "namespace"
) -> NamespaceIdentity:
    for name in _IDENTITY_STRINGS:
        value = getattr(msg, name)
        if len(value) > MAX_IDENTITY_FIELD_CHARS:  # the path is built only for the error (Route's hot path)
            _string(value, _join(path, name), max_chars=MAX_IDENTITY_FIELD_CHARS)
    _string(msg.model_id, _join(path, "model_id"), required=True)
    if not msg.kv_dtype:
        raise _invalid(_join(path, "kv_dtype"), f"must be set to one of {', '.join(KV_DTYPES)}")
    if msg.page_size == 0:
        raise _invalid(_join(path, "page_size"), "must be set (>= 1)")
    identity = NamespaceIdentity(
        model_id=msg.model_id,
        weights_digest=msg.weights_digest,
        tokenizer_digest=msg.tokenizer_digest,
        adapter=msg.adapter,
        rope_config=msg.rope_config,
        kv_dtype=msg.kv_dtype,
        page_size=msg.page_size,
        tenant=msg.tenant,
    )
    _validate(identity.validate, "namespace", path)
    return identity


def to_proto_model_identity(model: ModelIdentity) -> common_pb2.ModelIdentity:
    return common_pb2.ModelIdentity(
        model_id=model.model_id,
        weights_digest=model.weights_digest,
        tokenizer_digest=model.tokenizer_digest,
        rope_config=model.rope_config,
        kv_dtype=model.kv_dtype,
    )


def from_proto_model_identity(msg: common_pb2.ModelIdentity, path: str = "model") -> ModelIdentity:
    for name in ("model_id", "weights_digest", "tokenizer_digest", "rope_config"):
        _string(getattr(msg, name), _join(path, name), max_chars=MAX_IDENTITY_FIELD_CHARS)
    _string(msg.model_id, _join(path, "model_id"), required=True)
    if msg.kv_dtype not in KV_DTYPES:
        raise _invalid(
            _join(path, "kv_dtype"), f"must be one of {', '.join(KV_DTYPES)}, got {msg.kv_dtype!r}"
        )
    return ModelIdentity(
        model_id=msg.model_id,
        weights_digest=msg.weights_digest,
        tokenizer_digest=msg.tokenizer_digest,
        rope_config=msg.rope_config,
        kv_dtype=msg.kv_dtype,
    )


def to_proto_tokens_by_tier(tokens: TokensByTier) -> common_pb2.TokensByTier:
    return common_pb2.TokensByTier(
        hbm_tokens=tokens.hbm_tokens, dram_tokens=tokens.dram_tokens, nvme_tokens=tokens.nvme_tokens
    )


def from_proto_tokens_by_tier(msg: common_pb2.TokensByTier, path: str = "") -> TokensByTier:
    return TokensByTier(hbm_tokens=msg.hbm_tokens, dram_tokens=msg.dram_tokens, nvme_tokens=msg.nvme_tokens)


def to_proto_tier_occupancy(occupancy: TierOccupancy) -> common_pb2.TierOccupancy:
    return common_pb2.TierOccupancy(
        tier=int(occupancy.tier),
        total_pages=occupancy.total_pages,
        free_pages=occupancy.free_pages,
        cached_pages=occupancy.cached_pages,
        in_use_pages=occupancy.in_use_pages,
        pinned_pages=occupancy.pinned_pages,
        reclaimable_pages=occupancy.reclaimable_pages,
    )


def from_proto_tier_occupancy(msg: common_pb2.TierOccupancy, path: str = "") -> TierOccupancy:
    return TierOccupancy(
        tier=_tier(msg.tier, _join(path, "tier")),
        total_pages=msg.total_pages,
        free_pages=msg.free_pages,
        cached_pages=msg.cached_pages,
        in_use_pages=msg.in_use_pages,
        pinned_pages=msg.pinned_pages,
        reclaimable_pages=msg.reclaimable_pages,
    )


def _occupancies(items: Sequence[common_pb2.TierOccupancy], path: str) -> tuple[TierOccupancy, ...]:
    occupancies = _list(items, path, from_proto_tier_occupancy)
    _unique_tiers(occupancies, path)
    return occupancies


def to_proto_tier_capacity(capacity: TierCapacity) -> common_pb2.TierCapacity:
    return common_pb2.TierCapacity(
        tier=int(capacity.tier),
        capacity_pages=capacity.capacity_pages,
        capacity_bytes=capacity.capacity_bytes,
    )


def from_proto_tier_capacity(msg: common_pb2.TierCapacity, path: str = "") -> TierCapacity:
    return TierCapacity(
        tier=_tier(msg.tier, _join(path, "tier")),
        capacity_pages=msg.capacity_pages,
        capacity_bytes=msg.capacity_bytes,
    )


def _capacities(items: Sequence[common_pb2.TierCapacity], path: str) -> tuple[TierCapacity, ...]:
    capacities = _list(items, path, from_proto_tier_capacity)
    _unique_tiers(capacities, path)
    return capacities


def to_proto_invalidation_scope(scope: InvalidationScope) -> common_pb2.InvalidationScope:
    if scope.namespace is not None:
        return common_pb2.InvalidationScope(namespace=to_proto_namespace_identity(scope.namespace))
    if scope.tenant is not None:
        return common_pb2.InvalidationScope(tenant=scope.tenant)
    if scope.model_id is not None:
        return common_pb2.InvalidationScope(model_id=scope.model_id)
    return common_pb2.InvalidationScope(all_namespaces=scope.all_namespaces)


def from_proto_invalidation_scope(
    msg: common_pb2.InvalidationScope, path: str = "scope"
) -> InvalidationScope:
    which = msg.WhichOneof("scope")
    if which == "namespace":
        scope = InvalidationScope(
            namespace=from_proto_namespace_identity(msg.namespace, _join(path, "namespace"))
        )
    elif which == "tenant":
        scope = InvalidationScope(
            tenant=_string(msg.tenant, _join(path, "tenant"), max_chars=MAX_IDENTITY_FIELD_CHARS)
        )
    elif which == "model_id":
        model_id = _string(msg.model_id, _join(path, "model_id"), max_chars=MAX_IDENTITY_FIELD_CHARS)
        scope = InvalidationScope(model_id=model_id)
    elif which == "all_namespaces" and msg.all_namespaces:
        scope = InvalidationScope(all_namespaces=True)
    else:
        raise _invalid(path, "must set exactly one of namespace, tenant, model_id, all_namespaces=true")
    _validate(scope.validate, "scope", path)
    return scope


# --------------------------------------------------------------------------- router


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


# --------------------------------------------------------------------------- worker


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
        temperature=_finite(msg.temperature, _join(path, "temperature")),
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else _SAMPLING_DEFAULTS.top_p,
        seed=_optional(msg, "seed"),
        stop_token_ids=list(
            _token_ids(msg.stop_token_ids, _join(path, "stop_token_ids"), limit=MAX_STOP_TOKEN_IDS)
        ),
        stop_sequences=[list(s.ids) for s in msg.stop_sequences],
        tool_call_sequence=list(msg.tool_call_sequence),
        ignore_eos=msg.ignore_eos,
    )
    # validate() bounds the number and length of the sequences before we scan them.
    _validate(params.validate, "", path)
    for i, sequence in enumerate(params.stop_sequences):
        _token_ids(sequence, _join(path, f"stop_sequences[{i}].ids"), limit=len(sequence))
    _token_ids(
        params.tool_call_sequence, _join(path, "tool_call_sequence"), limit=len(params.tool_call_sequence)
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
    )


def from_proto_generate_request(msg: worker_pb2.GenerateRequest, path: str = "") -> GenerateRequest:
    namespace = from_proto_namespace_identity(
        _required_message(msg, "namespace", path), _join(path, "namespace")
    )
    prompt = _token_ids(
        msg.prompt_token_ids, _join(path, "prompt_token_ids"), limit=MAX_PROMPT_TOKENS, volume=True
    )
    if not prompt:
        raise _invalid(_join(path, "prompt_token_ids"), "must not be empty")
    sampling = (
        from_proto_sampling_params(msg.sampling, _join(path, "sampling"))
        if msg.HasField("sampling")
        else SamplingParams()
    )
    if abs(msg.priority) > MAX_PRIORITY:
        raise _invalid(
            _join(path, "priority"), f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {msg.priority}"
        )
    session_id = _optional_string(msg.session_id, _join(path, "session_id"))
    request_id = _optional_string(msg.request_id, _join(path, "request_id"))
    return GenerateRequest(
        namespace=namespace,
        prompt_token_ids=prompt,
        sampling=sampling,
        session_id=SessionId(session_id) if session_id else None,
        request_id=RequestId(request_id) if request_id else None,
        priority=msg.priority,
    )


def to_proto_token_chunk(chunk: TokenChunk) -> worker_pb2.TokenChunk:
    return worker_pb2.TokenChunk(token_ids=chunk.token_ids, index=chunk.index)


def from_proto_token_chunk(msg: worker_pb2.TokenChunk, path: str = "tokens") -> TokenChunk:
    ids = _token_ids(msg.token_ids, _join(path, "token_ids"), limit=MAX_PROMPT_TOKENS, volume=True)
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
        usage=from_proto_usage(msg.usage, _join(path, "usage")),
        finish_reason=_FINISH_REASONS.parse(msg.finish_reason, _join(path, "finish_reason")),
        run_id=RunId(_string(msg.run_id, _join(path, "run_id"))),
        ttft_ms=_finite(msg.ttft_ms, _join(path, "ttft_ms"), minimum=0.0),
    )


def to_proto_generate_event(event: GenerateEvent) -> worker_pb2.GenerateEvent:
    if isinstance(event, TokenChunk):
        return worker_pb2.GenerateEvent(tokens=to_proto_token_chunk(event))
    return worker_pb2.GenerateEvent(final=to_proto_generate_final(event))


def from_proto_generate_event(msg: worker_pb2.GenerateEvent, path: str = "") -> GenerateEvent:
    which = msg.WhichOneof("event")
    if which == "tokens":
        return from_proto_token_chunk(msg.tokens, _join(path, "tokens"))
    if which == "final":
        return from_proto_generate_final(msg.final, _join(path, "final"))
    raise _invalid(_join(path, "event"), "must set tokens or final")


def to_proto_integrity_report(report: IntegrityReport) -> worker_pb2.IntegrityReport:
    return worker_pb2.IntegrityReport(
        component=report.component, tier=_tier_or_none(report.tier), problem=report.problem or ""
    )


def from_proto_integrity_report(msg: worker_pb2.IntegrityReport, path: str = "") -> IntegrityReport:
    return IntegrityReport(
        component=_string(msg.component, _join(path, "component"), required=True),
        tier=_tier(msg.tier, _join(path, "tier")) if msg.tier else None,
        problem=_optional_string(msg.problem, _join(path, "problem"), max_chars=MAX_TEXT_CHARS),
    )


def to_proto_integrity_result(result: IntegrityResult) -> worker_pb2.CheckIntegrityResponse:
    return worker_pb2.CheckIntegrityResponse(reports=[to_proto_integrity_report(r) for r in result.reports])


def from_proto_integrity_result(msg: worker_pb2.CheckIntegrityResponse, path: str = "") -> IntegrityResult:
    return IntegrityResult(reports=_list(msg.reports, _join(path, "reports"), from_proto_integrity_report))


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
        worker_id=WorkerId(_string(msg.worker_id, _join(path, "worker_id"), required=True)),
        boot_id=BootId(_string(msg.boot_id, _join(path, "boot_id"))),
        tiers=_occupancies(msg.tiers, _join(path, "tiers")),
        queue_depth=msg.queue_depth,
        num_running_seqs=msg.num_running_seqs,
    )


# --------------------------------------------------------------------------- sessions


def _session_id(value: str, path: str) -> SessionId:
    return SessionId(_string(value, path, required=True))


def to_proto_pause_request(request: PauseRequest) -> sessions_pb2.PauseRequest:
    return sessions_pb2.PauseRequest(
        session_id=request.session_id, tool_name=request.tool_name or "", expected_ms=request.expected_ms
    )


def from_proto_pause_request(msg: sessions_pb2.PauseRequest, path: str = "") -> PauseRequest:
    return PauseRequest(
        session_id=_session_id(msg.session_id, _join(path, "session_id")),
        tool_name=_optional_string(msg.tool_name, _join(path, "tool_name"), max_chars=MAX_TEXT_CHARS),
        expected_ms=_optional_duration(msg, "expected_ms", path),
    )


def to_proto_returning_request(request: ReturningRequest) -> sessions_pb2.ReturningRequest:
    return sessions_pb2.ReturningRequest(session_id=request.session_id, eta_ms=request.eta_ms)


def from_proto_returning_request(msg: sessions_pb2.ReturningRequest, path: str = "") -> ReturningRequest:
    return ReturningRequest(
        session_id=_session_id(msg.session_id, _join(path, "session_id")),
        eta_ms=_optional_duration(msg, "eta_ms", path),
    )


def to_proto_end_request(request: EndRequest) -> sessions_pb2.EndRequest:
    return sessions_pb2.EndRequest(session_id=request.session_id, drop=request.drop)


def from_proto_end_request(msg: sessions_pb2.EndRequest, path: str = "") -> EndRequest:
    return EndRequest(session_id=_session_id(msg.session_id, _join(path, "session_id")), drop=msg.drop)


def to_proto_session_info(info: SessionInfo) -> sessions_pb2.SessionInfo:
    return sessions_pb2.SessionInfo(
        session_id=info.session_id,
        state=_SESSION_STATES.to_wire[info.state],
        worker_id=info.worker_id or "",
        tool_name=info.tool_name or "",
        paused_at_ms=info.paused_at_ms,
        predicted_return_at_ms=info.predicted_return_at_ms,
        prediction_source=(
            _PREDICTION_SOURCES.to_wire[info.prediction_source] if info.prediction_source is not None else 0
        ),
        prefetch_at_ms=info.prefetch_at_ms,
        parked_tier=int(info.parked_tier) if info.parked_tier is not None else None,
        num_cached_tokens=info.num_cached_tokens,
    )


def from_proto_session_info(msg: sessions_pb2.SessionInfo, path: str = "session") -> SessionInfo:
    worker_id = _optional_string(msg.worker_id, _join(path, "worker_id"))
    return SessionInfo(
        session_id=_session_id(msg.session_id, _join(path, "session_id")),
        state=_SESSION_STATES.parse(msg.state, _join(path, "state")),
        worker_id=WorkerId(worker_id) if worker_id else None,
        tool_name=_optional_string(msg.tool_name, _join(path, "tool_name"), max_chars=MAX_TEXT_CHARS),
        paused_at_ms=_optional(msg, "paused_at_ms"),
        predicted_return_at_ms=_optional(msg, "predicted_return_at_ms"),
        prediction_source=_PREDICTION_SOURCES.parse_optional(
            msg.prediction_source, _join(path, "prediction_source")
        ),
        prefetch_at_ms=_optional(msg, "prefetch_at_ms"),
        parked_tier=_optional_tier(msg, "parked_tier", path),
        num_cached_tokens=msg.num_cached_tokens,
    )


def to_proto_pause_response(info: SessionInfo) -> sessions_pb2.PauseResponse:
    return sessions_pb2.PauseResponse(session=to_proto_session_info(info))


def from_proto_pause_response(msg: sessions_pb2.PauseResponse, path: str = "") -> SessionInfo:
    return from_proto_session_info(_required_message(msg, "session", path), _join(path, "session"))


def to_proto_returning_response(info: SessionInfo) -> sessions_pb2.ReturningResponse:
    return sessions_pb2.ReturningResponse(session=to_proto_session_info(info))


def from_proto_returning_response(msg: sessions_pb2.ReturningResponse, path: str = "") -> SessionInfo:
    return from_proto_session_info(_required_message(msg, "session", path), _join(path, "session"))


def to_proto_end_response(info: SessionInfo) -> sessions_pb2.EndResponse:
    return sessions_pb2.EndResponse(session=to_proto_session_info(info))


def from_proto_end_response(msg: sessions_pb2.EndResponse, path: str = "") -> SessionInfo:
    return from_proto_session_info(_required_message(msg, "session", path), _join(path, "session"))


# --------------------------------------------------------------------------- worker link: events


def to_proto_registration(registration: Registration) -> worker_link_pb2.Register:
    return worker_link_pb2.Register(
        worker_id=registration.worker_id,
        address=registration.address,
        boot_id=registration.boot_id,
        model=to_proto_model_identity(registration.model),
        adapters=registration.adapters,
        page_size=registration.page_size,
        capacities=[to_proto_tier_capacity(c) for c in registration.capacities],
        facts=to_proto_model_facts(registration.facts) if registration.facts is not None else None,
    )


def to_proto_model_facts(facts: ModelFacts) -> common_pb2.ModelFacts:
    return common_pb2.ModelFacts(
        vocab_size=facts.vocab_size,
        max_context_tokens=facts.max_context_tokens,
        eos_token_ids=facts.eos_token_ids,
        has_chat_template=facts.has_chat_template,
    )


def from_proto_model_facts(msg: common_pb2.ModelFacts, path: str = "facts") -> ModelFacts:
    if msg.vocab_size == 0:
        raise _invalid(_join(path, "vocab_size"), "must be set (>= 1)")
    if msg.max_context_tokens == 0:
        raise _invalid(_join(path, "max_context_tokens"), "must be set (>= 1)")
    return ModelFacts(
        vocab_size=msg.vocab_size,
        max_context_tokens=msg.max_context_tokens,
        eos_token_ids=_token_ids(msg.eos_token_ids, _join(path, "eos_token_ids"), limit=MAX_STOP_TOKEN_IDS),
        has_chat_template=msg.has_chat_template,
    )


def from_proto_registration(msg: worker_link_pb2.Register, path: str = "register") -> Registration:
    if msg.page_size == 0:
        raise _invalid(_join(path, "page_size"), "must be set (>= 1)")
    adapters_path = _join(path, "adapters")
    return Registration(
        worker_id=WorkerId(_string(msg.worker_id, _join(path, "worker_id"), required=True)),
        address=_string(msg.address, _join(path, "address"), required=True),
        boot_id=BootId(_string(msg.boot_id, _join(path, "boot_id"), required=True)),
        model=from_proto_model_identity(_required_message(msg, "model", path), _join(path, "model")),
        page_size=msg.page_size,
        capacities=_capacities(msg.capacities, _join(path, "capacities")),
        adapters=_list(
            msg.adapters, adapters_path, lambda a, p: _string(a, p, max_chars=MAX_IDENTITY_FIELD_CHARS)
        ),
        facts=from_proto_model_facts(msg.facts, _join(path, "facts")) if msg.HasField("facts") else None,
    )


def to_proto_heartbeat(heartbeat: Heartbeat) -> worker_link_pb2.Heartbeat:
    return worker_link_pb2.Heartbeat(
        seq=heartbeat.seq,
        tiers=[to_proto_tier_occupancy(t) for t in heartbeat.tiers],
        queue_depth=heartbeat.queue_depth,
        num_running_seqs=heartbeat.num_running_seqs,
    )


def from_proto_heartbeat(msg: worker_link_pb2.Heartbeat, path: str = "heartbeat") -> Heartbeat:
    return Heartbeat(
        seq=msg.seq,
        tiers=_occupancies(msg.tiers, _join(path, "tiers")),
        queue_depth=msg.queue_depth,
        num_running_seqs=msg.num_running_seqs,
    )


def to_proto_page_event(event: PageEvent) -> worker_link_pb2.PageEvent:
    return worker_link_pb2.PageEvent(
        kind=_PAGE_EVENT_KINDS.to_wire[event.kind],
        namespace_digest=event.namespace_digest,
        page_key=event.page_key,
        parent_key=event.parent_key or b"",
        depth=event.depth or 0,
        tier=_tier_or_none(event.tier),
        from_tier=int(event.from_tier) if event.from_tier is not None else None,
    )


def from_proto_page_event(msg: worker_link_pb2.PageEvent, path: str = "") -> PageEvent:
    kind = _PAGE_EVENT_KINDS.parse(msg.kind, _join(path, "kind"))
    is_insert = kind is PageEventKind.INSERT
    tier = _tier(msg.tier, _join(path, "tier")) if msg.tier or kind is not PageEventKind.DROP else None
    from_tier = _optional_tier(msg, "from_tier", path)
    if from_tier is not None and kind is not PageEventKind.MOVE:
        raise _invalid(_join(path, "from_tier"), f"must be unset for a {kind.name} event")
    if from_tier is not None and from_tier == tier:
        raise _invalid(_join(path, "from_tier"), f"must differ from tier ({from_tier.label})")
    if is_insert and msg.depth == 0:
        raise _invalid(_join(path, "depth"), "must be >= 1 for an INSERT event")
    return PageEvent(
        kind=kind,
        namespace_digest=_digest(msg.namespace_digest, _join(path, "namespace_digest")),
        page_key=_key(msg.page_key, _join(path, "page_key")),
        tier=tier,
        parent_key=_key(msg.parent_key, _join(path, "parent_key")) if msg.parent_key or is_insert else None,
        depth=msg.depth or None,
        from_tier=from_tier,
    )


def to_proto_page_event_batch(batch: PageEventBatch) -> worker_link_pb2.PageEventBatch:
    return worker_link_pb2.PageEventBatch(
        seq=batch.seq, events=[to_proto_page_event(e) for e in batch.events]
    )


def from_proto_page_event_batch(
    msg: worker_link_pb2.PageEventBatch, path: str = "page_events"
) -> PageEventBatch:
    events_path = _join(path, "events")
    _count(msg.events, events_path, MAX_BATCH_EVENTS, volume=True)
    return PageEventBatch(
        seq=msg.seq,
        events=tuple(from_proto_page_event(e, f"{events_path}[{i}]") for i, e in enumerate(msg.events)),
    )


def to_proto_inventory_page(page: InventoryPage) -> worker_link_pb2.InventoryPage:
    return worker_link_pb2.InventoryPage(page_key=page.page_key, parent_key=page.parent_key, depth=page.depth)


def from_proto_inventory_page(msg: worker_link_pb2.InventoryPage, path: str = "") -> InventoryPage:
    if msg.depth == 0:
        raise _invalid(_join(path, "depth"), "must be >= 1")
    return InventoryPage(
        page_key=_key(msg.page_key, _join(path, "page_key")),
        parent_key=_key(msg.parent_key, _join(path, "parent_key")),
        depth=msg.depth,
    )


def to_proto_namespace_inventory(inventory: NamespaceInventory) -> worker_link_pb2.NamespaceInventory:
    return worker_link_pb2.NamespaceInventory(
        namespace_digest=inventory.namespace_digest,
        tier=int(inventory.tier),
        pages=[to_proto_inventory_page(p) for p in inventory.pages],
    )


def from_proto_namespace_inventory(
    msg: worker_link_pb2.NamespaceInventory, path: str = ""
) -> NamespaceInventory:
    pages_path = _join(path, "pages")
    _count(msg.pages, pages_path, MAX_SNAPSHOT_CHUNK_PAGES, volume=True)
    return NamespaceInventory(
        namespace_digest=_digest(msg.namespace_digest, _join(path, "namespace_digest")),
        tier=_tier(msg.tier, _join(path, "tier")),
        pages=tuple(from_proto_inventory_page(p, f"{pages_path}[{i}]") for i, p in enumerate(msg.pages)),
    )


def to_proto_inventory_snapshot_chunk(
    chunk: InventorySnapshotChunk,
) -> worker_link_pb2.InventorySnapshotChunk:
    return worker_link_pb2.InventorySnapshotChunk(
        snapshot_id=chunk.snapshot_id,
        chunk_index=chunk.chunk_index,
        is_last=chunk.is_last,
        as_of_seq=chunk.as_of_seq,
        inventories=[to_proto_namespace_inventory(i) for i in chunk.inventories],
    )


def from_proto_inventory_snapshot_chunk(
    msg: worker_link_pb2.InventorySnapshotChunk, path: str = "snapshot"
) -> InventorySnapshotChunk:
    inventories_path = _join(path, "inventories")
    num_pages = sum(len(inv.pages) for inv in msg.inventories)
    if num_pages > MAX_SNAPSHOT_CHUNK_PAGES:
        raise ResourceExhausted(
            f"{inventories_path} holds {num_pages} pages; at most {MAX_SNAPSHOT_CHUNK_PAGES} per chunk",
            field=inventories_path,
        )
    return InventorySnapshotChunk(
        snapshot_id=SnapshotId(_string(msg.snapshot_id, _join(path, "snapshot_id"), required=True)),
        chunk_index=msg.chunk_index,
        is_last=msg.is_last,
        as_of_seq=msg.as_of_seq,
        inventories=_list(msg.inventories, inventories_path, from_proto_namespace_inventory),
    )


def to_proto_command_ack(ack: CommandAck) -> worker_link_pb2.CommandAck:
    return worker_link_pb2.CommandAck(
        command_id=ack.command_id, ok=ack.ok, error_code=ack.error_code or "", error_message=ack.error_message,
        num_pages=ack.num_pages, num_skipped_pages=ack.num_skipped_pages,
    )


def from_proto_command_ack(msg: worker_link_pb2.CommandAck, path: str = "ack") -> CommandAck:
    counts = dict(num_pages=msg.num_pages, num_skipped_pages=msg.num_skipped_pages)
    if msg.ok:
        return CommandAck(command_id=CommandId(msg.command_id), **counts)
    return CommandAck(
        command_id=CommandId(msg.command_id),
        error_code=_string(msg.error_code, _join(path, "error_code"), required=True),
        error_message=_string(msg.error_message, _join(path, "error_message"), max_chars=MAX_TEXT_CHARS),
        **counts,
    )


def to_proto_worker_event(event: WorkerEvent) -> worker_link_pb2.WorkerEvent:
    if isinstance(event, Registration):
        return worker_link_pb2.WorkerEvent(register=to_proto_registration(event))
    if isinstance(event, Heartbeat):
        return worker_link_pb2.WorkerEvent(heartbeat=to_proto_heartbeat(event))
    if isinstance(event, PageEventBatch):
        return worker_link_pb2.WorkerEvent(page_events=to_proto_page_event_batch(event))
    if isinstance(event, InventorySnapshotChunk):
        return worker_link_pb2.WorkerEvent(snapshot=to_proto_inventory_snapshot_chunk(event))
    return worker_link_pb2.WorkerEvent(ack=to_proto_command_ack(event))


_WORKER_EVENT_PARSERS: dict[str, Callable[[Any, str], WorkerEvent]] = {
    "register": from_proto_registration,
    "heartbeat": from_proto_heartbeat,
    "page_events": from_proto_page_event_batch,
    "snapshot": from_proto_inventory_snapshot_chunk,
    "ack": from_proto_command_ack,
}


def from_proto_worker_event(msg: worker_link_pb2.WorkerEvent, path: str = "") -> WorkerEvent:
    which = msg.WhichOneof("event")
    if which is None:
        raise _invalid(_join(path, "event"), f"must set one of {', '.join(_WORKER_EVENT_PARSERS)}")
    return _WORKER_EVENT_PARSERS[which](getattr(msg, which), _join(path, which))


# --------------------------------------------------------------------------- worker link: commands


def _command_keys(msg: Any, path: str) -> tuple[PageKey, ...]:
    keys = _keys(msg.page_keys, _join(path, "page_keys"), limit=MAX_COMMAND_PAGES)
    if not keys:
        raise _invalid(_join(path, "page_keys"), "must not be empty")
    return keys


def _command_target(msg: Any, path: str) -> tuple[tuple[PageKey, ...], SessionId | None, bool]:
    """Page keys, a session id or the whole namespace: exactly one addresses a command's pages."""
    session_id = _optional_string(msg.session_id, _join(path, "session_id"))
    if msg.whole_namespace:
        if session_id is not None:
            raise _invalid(_join(path, "session_id"), "must be empty when whole_namespace is set")
        if msg.page_keys:
            raise _invalid(_join(path, "page_keys"), "must be empty when whole_namespace is set")
        return (), None, True
    if session_id is None:
        return _command_keys(msg, path), None, False
    if msg.page_keys:
        raise _invalid(_join(path, "page_keys"), "must be empty when session_id is set")
    return (), SessionId(session_id), False


def _check_target(
    keys: tuple[PageKey, ...], session_id: SessionId | None, whole_namespace: bool, what: str
) -> None:
    if bool(keys) + bool(session_id) + whole_namespace != 1:
        raise InvalidArgument(
            f"a {what} names its pages by page_keys, session_id or whole_namespace (exactly one)",
            field="page_keys",
        )


def to_proto_demote_command(command: DemoteCommand) -> worker_link_pb2.DemoteCommand:
    _check_target(command.page_keys, command.session_id, command.whole_namespace, "DemoteCommand")
    return worker_link_pb2.DemoteCommand(
        namespace_digest=command.namespace_digest,
        page_keys=command.page_keys,
        target_tier=int(command.target_tier),
        session_id=command.session_id or "",
        whole_namespace=command.whole_namespace,
    )


def from_proto_demote_command(msg: worker_link_pb2.DemoteCommand, path: str = "demote") -> DemoteCommand:
    keys, session_id, whole_namespace = _command_target(msg, path)
    return DemoteCommand(
        namespace_digest=_digest(msg.namespace_digest, _join(path, "namespace_digest")),
        page_keys=keys,
        target_tier=_tier(msg.target_tier, _join(path, "target_tier")),
        session_id=session_id,
        whole_namespace=whole_namespace,
    )


def to_proto_prefetch_command(command: PrefetchCommand) -> worker_link_pb2.PrefetchCommand:
    return worker_link_pb2.PrefetchCommand(
        namespace_digest=command.namespace_digest,
        page_keys=command.page_keys,
        target_tier=int(command.target_tier),
        deadline_ms=command.deadline_ms,
        session_id=command.session_id or "",
        return_in_ms=command.return_in_ms,
        away_ms=command.away_ms,
        return_spread=command.return_spread,
    )


def from_proto_prefetch_command(
    msg: worker_link_pb2.PrefetchCommand, path: str = "prefetch"
) -> PrefetchCommand:
    session_id = _optional_string(msg.session_id, _join(path, "session_id"))
    keys = _keys(msg.page_keys, _join(path, "page_keys"), limit=MAX_COMMAND_PAGES)
    if not keys and session_id is None:
        raise _invalid(_join(path, "page_keys"), "must not be empty unless session_id is set")
    return PrefetchCommand(
        namespace_digest=_digest(msg.namespace_digest, _join(path, "namespace_digest")),
        page_keys=keys,
        target_tier=_tier(msg.target_tier, _join(path, "target_tier")),
        deadline_ms=_optional(msg, "deadline_ms"),
        session_id=SessionId(session_id) if session_id else None,
        return_in_ms=_optional_duration(msg, "return_in_ms", path),
        away_ms=_optional_duration(msg, "away_ms", path),
        return_spread=_optional_spread(msg, "return_spread", path),
    )


def to_proto_drop_command(command: DropCommand) -> worker_link_pb2.DropCommand:
    _check_target(command.page_keys, command.session_id, command.whole_namespace, "DropCommand")
    return worker_link_pb2.DropCommand(
        namespace_digest=command.namespace_digest,
        page_keys=command.page_keys,
        session_id=command.session_id or "",
        whole_namespace=command.whole_namespace,
        keep_pages=command.keep_pages,
    )


def from_proto_drop_command(msg: worker_link_pb2.DropCommand, path: str = "drop") -> DropCommand:
    keys, session_id, whole_namespace = _command_target(msg, path)
    if msg.keep_pages and session_id is None:
        raise _invalid(_join(path, "keep_pages"), "may be true only with session_id")
    return DropCommand(
        namespace_digest=_digest(msg.namespace_digest, _join(path, "namespace_digest")),
        page_keys=keys,
        session_id=session_id,
        whole_namespace=whole_namespace,
        keep_pages=msg.keep_pages,
    )


def to_proto_invalidate_command(command: InvalidateCommand) -> worker_link_pb2.InvalidateCommand:
    return worker_link_pb2.InvalidateCommand(
        scope=to_proto_invalidation_scope(command.scope), policy_epoch=command.policy_epoch
    )


def from_proto_invalidate_command(
    msg: worker_link_pb2.InvalidateCommand, path: str = "invalidate"
) -> InvalidateCommand:
    scope = from_proto_invalidation_scope(_required_message(msg, "scope", path), _join(path, "scope"))
    if msg.policy_epoch == 0:
        raise _invalid(_join(path, "policy_epoch"), "must be >= 1")
    return InvalidateCommand(scope=scope, policy_epoch=msg.policy_epoch)


def to_proto_request_snapshot_command(
    command: RequestSnapshotCommand,
) -> worker_link_pb2.RequestSnapshotCommand:
    return worker_link_pb2.RequestSnapshotCommand(snapshot_id=command.snapshot_id)


def from_proto_request_snapshot_command(
    msg: worker_link_pb2.RequestSnapshotCommand, path: str = "request_snapshot"
) -> RequestSnapshotCommand:
    return RequestSnapshotCommand(
        snapshot_id=SnapshotId(_string(msg.snapshot_id, _join(path, "snapshot_id"), required=True))
    )


def to_proto_drain_command(command: DrainCommand) -> worker_link_pb2.DrainCommand:
    return worker_link_pb2.DrainCommand(draining=command.draining)


def from_proto_drain_command(msg: worker_link_pb2.DrainCommand, path: str = "drain") -> DrainCommand:
    return DrainCommand(draining=msg.draining)


def _pin_id(value: str, path: str) -> PinId:
    return PinId(_string(value, path, required=True))


def to_proto_pin_command(command: PinCommand) -> worker_link_pb2.PinCommand:
    return worker_link_pb2.PinCommand(
        pin_id=command.pin_id,
        namespace_digest=command.namespace_digest,
        page_keys=command.page_keys,
        tier=int(command.tier),
        expires_at_ms=command.expires_at_ms,
    )


def from_proto_pin_command(msg: worker_link_pb2.PinCommand, path: str = "pin") -> PinCommand:
    return PinCommand(
        pin_id=_pin_id(msg.pin_id, _join(path, "pin_id")),
        namespace_digest=_digest(msg.namespace_digest, _join(path, "namespace_digest")),
        page_keys=_command_keys(msg, path),
        tier=_tier(msg.tier, _join(path, "tier")),
        expires_at_ms=_optional(msg, "expires_at_ms"),
    )


def to_proto_unpin_command(command: UnpinCommand) -> worker_link_pb2.UnpinCommand:
    return worker_link_pb2.UnpinCommand(pin_id=command.pin_id)


def from_proto_unpin_command(msg: worker_link_pb2.UnpinCommand, path: str = "unpin") -> UnpinCommand:
    return UnpinCommand(pin_id=_pin_id(msg.pin_id, _join(path, "pin_id")))


# Command type -> (oneof member, to_proto); oneof member -> from_proto.
_COMMAND_WRITERS: dict[type, tuple[str, Callable[[Any], Any]]] = {
    DemoteCommand: ("demote", to_proto_demote_command),
    PrefetchCommand: ("prefetch", to_proto_prefetch_command),
    DropCommand: ("drop", to_proto_drop_command),
    InvalidateCommand: ("invalidate", to_proto_invalidate_command),
    RequestSnapshotCommand: ("request_snapshot", to_proto_request_snapshot_command),
    DrainCommand: ("drain", to_proto_drain_command),
    PinCommand: ("pin", to_proto_pin_command),
    UnpinCommand: ("unpin", to_proto_unpin_command),
}
_COMMAND_PARSERS: dict[str, Callable[[Any, str], Command]] = {
    "demote": from_proto_demote_command,
    "prefetch": from_proto_prefetch_command,
    "drop": from_proto_drop_command,
    "invalidate": from_proto_invalidate_command,
    "request_snapshot": from_proto_request_snapshot_command,
    "drain": from_proto_drain_command,
    "pin": from_proto_pin_command,
    "unpin": from_proto_unpin_command,
}


def to_proto_controller_command(command: ControllerCommand) -> worker_link_pb2.ControllerCommand:
    member, write = _COMMAND_WRITERS[type(command.command)]
    return worker_link_pb2.ControllerCommand(
        command_id=command.command_id, **{member: write(command.command)}
    )


def from_proto_controller_command(
    msg: worker_link_pb2.ControllerCommand, path: str = ""
) -> ControllerCommand:
    which = msg.WhichOneof("command")
    if which is None:
        raise _invalid(_join(path, "command"), f"must set one of {', '.join(_COMMAND_PARSERS)}")
    return ControllerCommand(
        command_id=CommandId(msg.command_id),
        command=_COMMAND_PARSERS[which](getattr(msg, which), _join(path, which)),
    )


# --------------------------------------------------------------------------- admin


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
        controller_id=_string(msg.controller_id, _join(path, "controller_id")),
        is_leader=msg.is_leader,
        leader_address=_optional_string(msg.leader_address, _join(path, "leader_address")),
        version=_string(msg.version, _join(path, "version")),
        uptime_s=msg.uptime_s,
        num_workers=msg.num_workers,
        num_live_workers=msg.num_live_workers,
        num_active_sessions=msg.num_active_sessions,
        num_paused_sessions=msg.num_paused_sessions,
        num_resuming_sessions=msg.num_resuming_sessions,
        tiers=_occupancies(msg.tiers, _join(path, "tiers")),
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
        worker_id=WorkerId(_string(msg.worker_id, _join(path, "worker_id"), required=True)),
        address=_string(msg.address, _join(path, "address")),
        boot_id=BootId(_string(msg.boot_id, _join(path, "boot_id"))),
        state=_WORKER_STATES.parse(msg.state, _join(path, "state")),
        model=from_proto_model_identity(_required_message(msg, "model", path), _join(path, "model")),
        page_size=msg.page_size,
        capacities=_capacities(msg.capacities, _join(path, "capacities")),
        tiers=_occupancies(msg.tiers, _join(path, "tiers")),
        adapters=_list(
            msg.adapters,
            _join(path, "adapters"),
            lambda a, p: _string(a, p, max_chars=MAX_IDENTITY_FIELD_CHARS),
        ),
        queue_depth=msg.queue_depth,
        num_running_seqs=msg.num_running_seqs,
        last_heartbeat_at_ms=msg.last_heartbeat_at_ms,
    )


def to_proto_worker_list(workers: Sequence[WorkerInfo]) -> admin_pb2.ListWorkersResponse:
    return admin_pb2.ListWorkersResponse(workers=[to_proto_worker_info(w) for w in workers])


def from_proto_worker_list(msg: admin_pb2.ListWorkersResponse, path: str = "") -> tuple[WorkerInfo, ...]:
    return _list(msg.workers, _join(path, "workers"), from_proto_worker_info)


def _list_limit(msg: Any, path: str, default: int) -> int:
    if not msg.HasField("limit"):
        return default
    if not 1 <= msg.limit <= MAX_LIST_LIMIT:
        raise _invalid(_join(path, "limit"), f"must be in [1, {MAX_LIST_LIMIT}], got {msg.limit}")
    return msg.limit


def to_proto_list_sessions_request(request: ListSessionsRequest) -> admin_pb2.ListSessionsRequest:
    return admin_pb2.ListSessionsRequest(
        state=_SESSION_STATES.to_wire[request.state] if request.state is not None else None,
        limit=request.limit,
        page_token=request.page_token or "",
    )


def from_proto_list_sessions_request(
    msg: admin_pb2.ListSessionsRequest, path: str = ""
) -> ListSessionsRequest:
    return ListSessionsRequest(
        state=_SESSION_STATES.parse(msg.state, _join(path, "state")) if msg.HasField("state") else None,
        limit=_list_limit(msg, path, DEFAULT_LIST_SESSIONS_LIMIT),
        page_token=_optional_string(msg.page_token, _join(path, "page_token"), max_chars=MAX_TEXT_CHARS),
    )


def to_proto_session_page(page: SessionPage) -> admin_pb2.ListSessionsResponse:
    return admin_pb2.ListSessionsResponse(
        sessions=[to_proto_session_info(s) for s in page.sessions], next_page_token=page.next_page_token or ""
    )


def from_proto_session_page(msg: admin_pb2.ListSessionsResponse, path: str = "") -> SessionPage:
    return SessionPage(
        sessions=_list(msg.sessions, _join(path, "sessions"), from_proto_session_info),
        next_page_token=_optional_string(
            msg.next_page_token, _join(path, "next_page_token"), max_chars=MAX_TEXT_CHARS
        ),
    )


def to_proto_lookup_request(request: LookupRequest) -> admin_pb2.LookupRequest:
    return admin_pb2.LookupRequest(
        namespace=to_proto_namespace_identity(request.namespace), **_prefix_fields(request.prefix)
    )


def from_proto_lookup_request(msg: admin_pb2.LookupRequest, path: str = "") -> LookupRequest:
    namespace = from_proto_namespace_identity(
        _required_message(msg, "namespace", path), _join(path, "namespace")
    )
    prefix = _prefix_from(msg, path)
    assert prefix is not None
    return LookupRequest(namespace=namespace, prefix=prefix)


def to_proto_worker_match(match: WorkerMatch) -> admin_pb2.WorkerMatch:
    return admin_pb2.WorkerMatch(
        worker_id=match.worker_id, matched_tokens=to_proto_tokens_by_tier(match.matched_tokens)
    )


def from_proto_worker_match(msg: admin_pb2.WorkerMatch, path: str = "") -> WorkerMatch:
    return WorkerMatch(
        worker_id=WorkerId(_string(msg.worker_id, _join(path, "worker_id"), required=True)),
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
        namespace_digest=_digest(msg.namespace_digest, _join(path, "namespace_digest")),
        num_query_pages=msg.num_query_pages,
        matches=_list(msg.matches, _join(path, "matches"), from_proto_worker_match),
    )


def to_proto_invalidate_request(request: InvalidateRequest) -> admin_pb2.InvalidateRequest:
    return admin_pb2.InvalidateRequest(
        scope=to_proto_invalidation_scope(request.scope), reason=request.reason
    )


def from_proto_invalidate_request(msg: admin_pb2.InvalidateRequest, path: str = "") -> InvalidateRequest:
    return InvalidateRequest(
        scope=from_proto_invalidation_scope(_required_message(msg, "scope", path), _join(path, "scope")),
        reason=_string(msg.reason, _join(path, "reason"), max_chars=MAX_TEXT_CHARS),
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
        worker_id=WorkerId(_string(msg.worker_id, _join(path, "worker_id"), required=True)), resume=msg.resume
    )


def to_proto_drain_response(info: WorkerInfo) -> admin_pb2.DrainResponse:
    return admin_pb2.DrainResponse(worker=to_proto_worker_info(info))


def from_proto_drain_response(msg: admin_pb2.DrainResponse, path: str = "") -> WorkerInfo:
    return from_proto_worker_info(_required_message(msg, "worker", path), _join(path, "worker"))


def to_proto_pin_request(request: PinRequest) -> admin_pb2.PinRequest:
    return admin_pb2.PinRequest(
        namespace=to_proto_namespace_identity(request.namespace),
        tier=int(request.tier),
        ttl_s=request.ttl_s,
        **_prefix_fields(request.prefix),
    )


def from_proto_pin_request(msg: admin_pb2.PinRequest, path: str = "") -> PinRequest:
    namespace = from_proto_namespace_identity(
        _required_message(msg, "namespace", path), _join(path, "namespace")
    )
    prefix = _prefix_from(msg, path)
    assert prefix is not None
    return PinRequest(
        namespace=namespace,
        prefix=prefix,
        tier=_tier(msg.tier, _join(path, "tier")),
        ttl_s=_optional_duration(msg, "ttl_s", path, unit_ms=1000),
    )


def to_proto_pin_result(result: PinResult) -> admin_pb2.PinResponse:
    return admin_pb2.PinResponse(
        pin_id=result.pin_id, num_pinned_pages=result.num_pinned_pages, expires_at_ms=result.expires_at_ms
    )


def from_proto_pin_result(msg: admin_pb2.PinResponse, path: str = "") -> PinResult:
    return PinResult(
        pin_id=PinId(_string(msg.pin_id, _join(path, "pin_id"), required=True)),
        num_pinned_pages=msg.num_pinned_pages,
        expires_at_ms=_optional(msg, "expires_at_ms"),
    )


def to_proto_unpin_request(request: UnpinRequest) -> admin_pb2.UnpinRequest:
    return admin_pb2.UnpinRequest(pin_id=request.pin_id)


def from_proto_unpin_request(msg: admin_pb2.UnpinRequest, path: str = "") -> UnpinRequest:
    return UnpinRequest(pin_id=PinId(_string(msg.pin_id, _join(path, "pin_id"), required=True)))


def to_proto_unpin_result(result: UnpinResult) -> admin_pb2.UnpinResponse:
    return admin_pb2.UnpinResponse(num_unpinned_pages=result.num_unpinned_pages)


def from_proto_unpin_result(msg: admin_pb2.UnpinResponse, path: str = "") -> UnpinResult:
    return UnpinResult(num_unpinned_pages=msg.num_unpinned_pages)


def to_proto_evict_request(request: EvictRequest) -> admin_pb2.EvictRequest:
    return admin_pb2.EvictRequest(
        namespace=to_proto_namespace_identity(request.namespace),
        worker_id=request.worker_id or "",
        demote_to_tier=int(request.demote_to_tier) if request.demote_to_tier is not None else None,
        **_prefix_fields(request.prefix),
    )


def from_proto_evict_request(msg: admin_pb2.EvictRequest, path: str = "") -> EvictRequest:
    namespace = from_proto_namespace_identity(
        _required_message(msg, "namespace", path), _join(path, "namespace")
    )
    worker_id = _optional_string(msg.worker_id, _join(path, "worker_id"))
    return EvictRequest(
        namespace=namespace,
        prefix=_prefix_from(msg, path, required=False),
        worker_id=WorkerId(worker_id) if worker_id else None,
        demote_to_tier=_optional_tier(msg, "demote_to_tier", path),
    )


def to_proto_evict_result(result: EvictResult) -> admin_pb2.EvictResponse:
    return admin_pb2.EvictResponse(num_pages=result.num_pages, num_workers=result.num_workers)


def from_proto_evict_result(msg: admin_pb2.EvictResponse, path: str = "") -> EvictResult:
    return EvictResult(num_pages=msg.num_pages, num_workers=msg.num_workers)


def to_proto_watermarks(watermarks: Watermarks) -> admin_pb2.Watermarks:
    return admin_pb2.Watermarks(high=watermarks.high, low=watermarks.low)


def from_proto_watermarks(msg: admin_pb2.Watermarks, path: str = "") -> Watermarks:
    return Watermarks(high=msg.high, low=msg.low)


def _by_tier_label(mapping: Mapping[Tier, Any], write: Callable[[Any], Any] = lambda v: v) -> dict[str, Any]:
    return {tier.label: write(value) for tier, value in mapping.items()}


def _tier_keyed(entries: Mapping[str, Any], path: str, read: Callable[[Any, str], Any]) -> dict[Tier, Any]:
    _count(entries, path, len(Tier))
    result = {}
    for label in sorted(entries):
        tier = Tier.parse(label, field=f"{path}.{label}")
        if tier.label != label:
            raise _invalid(f"{path}.{label}", f"must be spelled {tier.label!r}")
        result[tier] = read(entries[label], f"{path}.{label}")
    return result


def to_proto_policy(policy: Policy) -> admin_pb2.Policy:
    return admin_pb2.Policy(
        watermarks=_by_tier_label(policy.watermarks, to_proto_watermarks),
        tier_weights=_by_tier_label(policy.tier_weights),
        budget_bytes_per_s=_by_tier_label(policy.budget_bytes_per_s),
        eviction_policy=policy.eviction_policy,
    )


def from_proto_policy(msg: admin_pb2.Policy, path: str = "policy") -> Policy:
    policy = Policy(
        watermarks=_tier_keyed(msg.watermarks, _join(path, "watermarks"), from_proto_watermarks),
        tier_weights=_tier_keyed(msg.tier_weights, _join(path, "tier_weights"), lambda v, p: v),
        budget_bytes_per_s=_tier_keyed(
            msg.budget_bytes_per_s, _join(path, "budget_bytes_per_s"), lambda v, p: v
        ),
        eviction_policy=msg.eviction_policy,
    )
    policy.validate(path)
    return policy


def to_proto_versioned_policy(versioned: VersionedPolicy) -> admin_pb2.VersionedPolicy:
    return admin_pb2.VersionedPolicy(
        policy=to_proto_policy(versioned.policy),
        version=versioned.version,
        set_by=versioned.set_by,
        set_at_ms=versioned.set_at_ms,
        reason=versioned.reason,
    )


def from_proto_versioned_policy(msg: admin_pb2.VersionedPolicy, path: str = "policy") -> VersionedPolicy:
    if msg.version == 0:
        raise _invalid(_join(path, "version"), "must be >= 1")
    return VersionedPolicy(
        policy=from_proto_policy(_required_message(msg, "policy", path), _join(path, "policy")),
        version=msg.version,
        set_by=_string(msg.set_by, _join(path, "set_by")),
        set_at_ms=msg.set_at_ms,
        reason=_string(msg.reason, _join(path, "reason"), max_chars=MAX_TEXT_CHARS),
    )


def to_proto_set_policy_request(request: SetPolicyRequest) -> admin_pb2.SetPolicyRequest:
    return admin_pb2.SetPolicyRequest(
        policy=to_proto_policy(request.policy),
        expected_version=request.expected_version,
        reason=request.reason,
    )


def from_proto_set_policy_request(msg: admin_pb2.SetPolicyRequest, path: str = "") -> SetPolicyRequest:
    return SetPolicyRequest(
        policy=from_proto_policy(_required_message(msg, "policy", path), _join(path, "policy")),
        expected_version=_optional(msg, "expected_version"),
        reason=_string(msg.reason, _join(path, "reason"), max_chars=MAX_TEXT_CHARS),
    )


def to_proto_set_policy_response(versioned: VersionedPolicy) -> admin_pb2.SetPolicyResponse:
    return admin_pb2.SetPolicyResponse(policy=to_proto_versioned_policy(versioned))


def from_proto_set_policy_response(msg: admin_pb2.SetPolicyResponse, path: str = "") -> VersionedPolicy:
    return from_proto_versioned_policy(_required_message(msg, "policy", path), _join(path, "policy"))


def to_proto_get_policy_request(request: GetPolicyRequest) -> admin_pb2.GetPolicyRequest:
    return admin_pb2.GetPolicyRequest(version=request.version)


def from_proto_get_policy_request(msg: admin_pb2.GetPolicyRequest, path: str = "") -> GetPolicyRequest:
    version = _optional(msg, "version")
    if version == 0:
        raise _invalid(_join(path, "version"), "must be >= 1 (versions start at 1)")
    return GetPolicyRequest(version=version)


def to_proto_get_policy_response(versioned: VersionedPolicy) -> admin_pb2.GetPolicyResponse:
    return admin_pb2.GetPolicyResponse(policy=to_proto_versioned_policy(versioned))


def from_proto_get_policy_response(msg: admin_pb2.GetPolicyResponse, path: str = "") -> VersionedPolicy:
    return from_proto_versioned_policy(_required_message(msg, "policy", path), _join(path, "policy"))


def to_proto_policy_history_request(request: PolicyHistoryRequest) -> admin_pb2.PolicyHistoryRequest:
    return admin_pb2.PolicyHistoryRequest(limit=request.limit)


def from_proto_policy_history_request(
    msg: admin_pb2.PolicyHistoryRequest, path: str = ""
) -> PolicyHistoryRequest:
    return PolicyHistoryRequest(limit=_list_limit(msg, path, DEFAULT_POLICY_HISTORY_LIMIT))


def to_proto_policy_history(policies: Sequence[VersionedPolicy]) -> admin_pb2.PolicyHistoryResponse:
    return admin_pb2.PolicyHistoryResponse(policies=[to_proto_versioned_policy(p) for p in policies])


def from_proto_policy_history(
    msg: admin_pb2.PolicyHistoryResponse, path: str = ""
) -> tuple[VersionedPolicy, ...]:
    return _list(msg.policies, _join(path, "policies"), from_proto_versioned_policy)


def to_proto_rollback_policy_request(request: RollbackPolicyRequest) -> admin_pb2.RollbackPolicyRequest:
    return admin_pb2.RollbackPolicyRequest(to_version=request.to_version, reason=request.reason)


def from_proto_rollback_policy_request(
    msg: admin_pb2.RollbackPolicyRequest, path: str = ""
) -> RollbackPolicyRequest:
    if msg.to_version == 0:
        raise _invalid(_join(path, "to_version"), "must be set (>= 1)")
    return RollbackPolicyRequest(
        to_version=msg.to_version, reason=_string(msg.reason, _join(path, "reason"), max_chars=MAX_TEXT_CHARS)
    )


def to_proto_rollback_policy_response(versioned: VersionedPolicy) -> admin_pb2.RollbackPolicyResponse:
    return admin_pb2.RollbackPolicyResponse(policy=to_proto_versioned_policy(versioned))


def from_proto_rollback_policy_response(
    msg: admin_pb2.RollbackPolicyResponse, path: str = ""
) -> VersionedPolicy:
    return from_proto_versioned_policy(_required_message(msg, "policy", path), _join(path, "policy"))


def to_proto_snapshot_request(request: SnapshotRequest) -> admin_pb2.SnapshotRequest:
    return admin_pb2.SnapshotRequest(worker_ids=request.worker_ids, wait=request.wait)


def from_proto_snapshot_request(msg: admin_pb2.SnapshotRequest, path: str = "") -> SnapshotRequest:
    worker_ids = _list(
        msg.worker_ids, _join(path, "worker_ids"), lambda w, p: WorkerId(_string(w, p, required=True))
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
        worker_id=WorkerId(_string(msg.worker_id, _join(path, "worker_id"), required=True)),
        snapshot_id=SnapshotId(_string(msg.snapshot_id, _join(path, "snapshot_id"), required=True)),
        is_complete=msg.is_complete,
        num_pages=msg.num_pages,
    )


def to_proto_snapshot_result(snapshots: Sequence[WorkerSnapshot]) -> admin_pb2.SnapshotResponse:
    return admin_pb2.SnapshotResponse(snapshots=[to_proto_worker_snapshot(s) for s in snapshots])


def from_proto_snapshot_result(msg: admin_pb2.SnapshotResponse, path: str = "") -> tuple[WorkerSnapshot, ...]:
    return _list(msg.snapshots, _join(path, "snapshots"), from_proto_worker_snapshot)
