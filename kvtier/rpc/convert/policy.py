"""Admin messages of the tiering policy: watermarks, the policy and its versions, set, get,
history and rollback."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvtier.domain.records import (
    GetPolicyRequest,
    Policy,
    PolicyHistoryRequest,
    RollbackPolicyRequest,
    SetPolicyRequest,
    VersionedPolicy,
    Watermarks,
)
from kvtier.domain.tiers import Tier
from kvtier.rpc._gen import admin_pb2
from kvtier.rpc.convert.fields import (
    check_count,
    invalid,
    join_path,
    optional_field,
    read_list,
    read_list_limit,
    read_string,
    required_message,
)
from kvtier.rpc.convert.limits import DEFAULT_POLICY_HISTORY_LIMIT, MAX_TEXT_CHARS


def to_proto_watermarks(watermarks: Watermarks) -> admin_pb2.Watermarks:
    return admin_pb2.Watermarks(high=watermarks.high, low=watermarks.low)


def from_proto_watermarks(msg: admin_pb2.Watermarks, path: str = "") -> Watermarks:
    return Watermarks(high=msg.high, low=msg.low)


def _by_tier_label(mapping: Mapping[Tier, Any], write: Callable[[Any], Any] = lambda v: v) -> dict[str, Any]:
    return {tier.label: write(value) for tier, value in mapping.items()}


def _tier_keyed(entries: Mapping[str, Any], path: str, read: Callable[[Any, str], Any]) -> dict[Tier, Any]:
    check_count(entries, path, len(Tier))
    result = {}
    for label in sorted(entries):
        tier = Tier.parse(label, field=f"{path}.{label}")
        if tier.label != label:
            raise invalid(f"{path}.{label}", f"must be spelled {tier.label!r}")
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
        watermarks=_tier_keyed(msg.watermarks, join_path(path, "watermarks"), from_proto_watermarks),
        tier_weights=_tier_keyed(msg.tier_weights, join_path(path, "tier_weights"), lambda v, p: v),
        budget_bytes_per_s=_tier_keyed(
            msg.budget_bytes_per_s, join_path(path, "budget_bytes_per_s"), lambda v, p: v
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
        raise invalid(join_path(path, "version"), "must be >= 1")
    return VersionedPolicy(
        policy=from_proto_policy(required_message(msg, "policy", path), join_path(path, "policy")),
        version=msg.version,
        set_by=read_string(msg.set_by, join_path(path, "set_by")),
        set_at_ms=msg.set_at_ms,
        reason=read_string(msg.reason, join_path(path, "reason"), max_chars=MAX_TEXT_CHARS),
    )


def to_proto_set_policy_request(request: SetPolicyRequest) -> admin_pb2.SetPolicyRequest:
    return admin_pb2.SetPolicyRequest(
        policy=to_proto_policy(request.policy),
        expected_version=request.expected_version,
        reason=request.reason,
    )


def from_proto_set_policy_request(msg: admin_pb2.SetPolicyRequest, path: str = "") -> SetPolicyRequest:
    return SetPolicyRequest(
        policy=from_proto_policy(required_message(msg, "policy", path), join_path(path, "policy")),
        expected_version=optional_field(msg, "expected_version"),
        reason=read_string(msg.reason, join_path(path, "reason"), max_chars=MAX_TEXT_CHARS),
    )


def to_proto_set_policy_response(versioned: VersionedPolicy) -> admin_pb2.SetPolicyResponse:
    return admin_pb2.SetPolicyResponse(policy=to_proto_versioned_policy(versioned))


def from_proto_set_policy_response(msg: admin_pb2.SetPolicyResponse, path: str = "") -> VersionedPolicy:
    return from_proto_versioned_policy(required_message(msg, "policy", path), join_path(path, "policy"))


def to_proto_get_policy_request(request: GetPolicyRequest) -> admin_pb2.GetPolicyRequest:
    return admin_pb2.GetPolicyRequest(version=request.version)


def from_proto_get_policy_request(msg: admin_pb2.GetPolicyRequest, path: str = "") -> GetPolicyRequest:
    version = optional_field(msg, "version")
    if version == 0:
        raise invalid(join_path(path, "version"), "must be >= 1 (versions start at 1)")
    return GetPolicyRequest(version=version)


def to_proto_get_policy_response(versioned: VersionedPolicy) -> admin_pb2.GetPolicyResponse:
    return admin_pb2.GetPolicyResponse(policy=to_proto_versioned_policy(versioned))


def from_proto_get_policy_response(msg: admin_pb2.GetPolicyResponse, path: str = "") -> VersionedPolicy:
    return from_proto_versioned_policy(required_message(msg, "policy", path), join_path(path, "policy"))


def to_proto_policy_history_request(request: PolicyHistoryRequest) -> admin_pb2.PolicyHistoryRequest:
    return admin_pb2.PolicyHistoryRequest(limit=request.limit)


def from_proto_policy_history_request(
    msg: admin_pb2.PolicyHistoryRequest, path: str = ""
) -> PolicyHistoryRequest:
    return PolicyHistoryRequest(limit=read_list_limit(msg, path, DEFAULT_POLICY_HISTORY_LIMIT))


def to_proto_policy_history(policies: Sequence[VersionedPolicy]) -> admin_pb2.PolicyHistoryResponse:
    return admin_pb2.PolicyHistoryResponse(policies=[to_proto_versioned_policy(p) for p in policies])


def from_proto_policy_history(
    msg: admin_pb2.PolicyHistoryResponse, path: str = ""
) -> tuple[VersionedPolicy, ...]:
    return read_list(msg.policies, join_path(path, "policies"), from_proto_versioned_policy)


def to_proto_rollback_policy_request(request: RollbackPolicyRequest) -> admin_pb2.RollbackPolicyRequest:
    return admin_pb2.RollbackPolicyRequest(to_version=request.to_version, reason=request.reason)


def from_proto_rollback_policy_request(
    msg: admin_pb2.RollbackPolicyRequest, path: str = ""
) -> RollbackPolicyRequest:
    if msg.to_version == 0:
        raise invalid(join_path(path, "to_version"), "must be set (>= 1)")
    return RollbackPolicyRequest(
        to_version=msg.to_version, reason=read_string(msg.reason, join_path(path, "reason"), max_chars=MAX_TEXT_CHARS)
    )


def to_proto_rollback_policy_response(versioned: VersionedPolicy) -> admin_pb2.RollbackPolicyResponse:
    return admin_pb2.RollbackPolicyResponse(policy=to_proto_versioned_policy(versioned))


def from_proto_rollback_policy_response(
    msg: admin_pb2.RollbackPolicyResponse, path: str = ""
) -> VersionedPolicy:
    return from_proto_versioned_policy(required_message(msg, "policy", path), join_path(path, "policy"))
