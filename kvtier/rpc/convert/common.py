"""Messages of ``common.proto``: namespace and model identity, model facts, tokens and occupancy
by tier, tier capacity, invalidation scope, peer fetch plans."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.domain.hashing import KV_DTYPES, NamespaceIdentity
from kvtier.domain.kv_dtype import is_valid_namespace_kv_dtype
from kvtier.domain.records import (
    InvalidationScope,
    ModelFacts,
    ModelIdentity,
    PeerFetch,
    TierCapacity,
    TierOccupancy,
    TokensByTier,
    WorkerId,
)
from kvtier.rpc._gen import common_pb2
from kvtier.rpc.convert.fields import (
    check_unique_tiers,
    invalid,
    join_path,
    read_list,
    read_string,
    read_tier,
    read_token_ids,
    validate_as,
    wire_tier,
)
from kvtier.rpc.convert.limits import MAX_IDENTITY_FIELD_CHARS, MAX_STOP_TOKEN_IDS


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
            read_string(value, join_path(path, name), max_chars=MAX_IDENTITY_FIELD_CHARS)
    read_string(msg.model_id, join_path(path, "model_id"), required=True)
    if not msg.kv_dtype:
        raise invalid(join_path(path, "kv_dtype"), f"must be set to one of {', '.join(KV_DTYPES)}")
    if msg.page_size == 0:
        raise invalid(join_path(path, "page_size"), "must be set (>= 1)")
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
    validate_as(identity.validate, "namespace", path)
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
        read_string(getattr(msg, name), join_path(path, name), max_chars=MAX_IDENTITY_FIELD_CHARS)
    read_string(msg.model_id, join_path(path, "model_id"), required=True)
    if not is_valid_namespace_kv_dtype(msg.kv_dtype):
        raise invalid(
            join_path(path, "kv_dtype"),
            f"must be one of {', '.join(KV_DTYPES)} or an FP8 scheme such as fp8_e4m3@page-head, got {msg.kv_dtype!r}",
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
        tier=wire_tier(occupancy.tier),
        total_pages=occupancy.total_pages,
        free_pages=occupancy.free_pages,
        cached_pages=occupancy.cached_pages,
        in_use_pages=occupancy.in_use_pages,
        pinned_pages=occupancy.pinned_pages,
        reclaimable_pages=occupancy.reclaimable_pages,
    )


def from_proto_tier_occupancy(msg: common_pb2.TierOccupancy, path: str = "") -> TierOccupancy:
    return TierOccupancy(
        tier=read_tier(msg.tier, join_path(path, "tier")),
        total_pages=msg.total_pages,
        free_pages=msg.free_pages,
        cached_pages=msg.cached_pages,
        in_use_pages=msg.in_use_pages,
        pinned_pages=msg.pinned_pages,
        reclaimable_pages=msg.reclaimable_pages,
    )


def read_occupancies(items: Sequence[common_pb2.TierOccupancy], path: str) -> tuple[TierOccupancy, ...]:
    occupancies = read_list(items, path, from_proto_tier_occupancy)
    check_unique_tiers(occupancies, path)
    return occupancies


def to_proto_tier_capacity(capacity: TierCapacity) -> common_pb2.TierCapacity:
    return common_pb2.TierCapacity(
        tier=wire_tier(capacity.tier),
        capacity_pages=capacity.capacity_pages,
        capacity_bytes=capacity.capacity_bytes,
    )


def from_proto_tier_capacity(msg: common_pb2.TierCapacity, path: str = "") -> TierCapacity:
    return TierCapacity(
        tier=read_tier(msg.tier, join_path(path, "tier")),
        capacity_pages=msg.capacity_pages,
        capacity_bytes=msg.capacity_bytes,
    )


def read_capacities(items: Sequence[common_pb2.TierCapacity], path: str) -> tuple[TierCapacity, ...]:
    capacities = read_list(items, path, from_proto_tier_capacity)
    check_unique_tiers(capacities, path)
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
            namespace=from_proto_namespace_identity(msg.namespace, join_path(path, "namespace"))
        )
    elif which == "tenant":
        scope = InvalidationScope(
            tenant=read_string(msg.tenant, join_path(path, "tenant"), max_chars=MAX_IDENTITY_FIELD_CHARS)
        )
    elif which == "model_id":
        model_id = read_string(msg.model_id, join_path(path, "model_id"), max_chars=MAX_IDENTITY_FIELD_CHARS)
        scope = InvalidationScope(model_id=model_id)
    elif which == "all_namespaces" and msg.all_namespaces:
        scope = InvalidationScope(all_namespaces=True)
    else:
        raise invalid(path, "must set exactly one of namespace, tenant, model_id, all_namespaces=true")
    validate_as(scope.validate, "scope", path)
    return scope




def to_proto_model_facts(facts: ModelFacts) -> common_pb2.ModelFacts:
    return common_pb2.ModelFacts(
        vocab_size=facts.vocab_size,
        max_context_tokens=facts.max_context_tokens,
        eos_token_ids=facts.eos_token_ids,
        has_chat_template=facts.has_chat_template,
    )


def from_proto_model_facts(msg: common_pb2.ModelFacts, path: str = "facts") -> ModelFacts:
    if msg.vocab_size == 0:
        raise invalid(join_path(path, "vocab_size"), "must be set (>= 1)")
    if msg.max_context_tokens == 0:
        raise invalid(join_path(path, "max_context_tokens"), "must be set (>= 1)")
    return ModelFacts(
        vocab_size=msg.vocab_size,
        max_context_tokens=msg.max_context_tokens,
        eos_token_ids=read_token_ids(msg.eos_token_ids, join_path(path, "eos_token_ids"), limit=MAX_STOP_TOKEN_IDS),
        has_chat_template=msg.has_chat_template,
    )


def to_proto_peer_fetch(fetch: PeerFetch) -> common_pb2.PeerFetch:
    return common_pb2.PeerFetch(worker_id=fetch.worker_id, num_pages=fetch.num_pages)


def from_proto_peer_fetch(msg: common_pb2.PeerFetch, path: str = "") -> PeerFetch:
    return PeerFetch(worker_id=WorkerId(read_string(msg.worker_id, join_path(path, "worker_id"), required=True)),
                     num_pages=msg.num_pages)
