"""kvtier.rpc.convert: every record survives domain → proto → bytes → proto → domain, and
invalid wire input is rejected with an error that names the field."""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import typing
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.domain import records as r
from kvtier.domain.errors import InvalidArgument, KvtierError, ResourceExhausted
from kvtier.domain.hashing import KEY_BYTES, KV_DTYPES, NamespaceIdentity
from kvtier.domain.params import MAX_STOP_SEQUENCE_TOKENS, MAX_STOP_SEQUENCES, FinishReason, SamplingParams
from kvtier.domain.tiers import Tier
from kvtier.rpc import convert
from kvtier.rpc._gen import admin_pb2, common_pb2, router_pb2, sessions_pb2, worker_link_pb2, worker_pb2
from kvtier.rpc.convert.admin import (
    from_proto_drain_request,
    from_proto_evict_request,
    from_proto_invalidate_request,
    from_proto_list_sessions_request,
    from_proto_lookup_request,
    from_proto_pin_request,
)
from kvtier.rpc.convert.common import from_proto_namespace_identity, to_proto_namespace_identity
from kvtier.rpc.convert.limits import (
    MAX_BATCH_EVENTS,
    MAX_COMMAND_PAGES,
    MAX_DURATION_MS,
    MAX_LIST_LIMIT,
    MAX_PROMPT_TOKENS,
    MAX_SNAPSHOT_CHUNK_PAGES,
    MAX_STOP_TOKEN_IDS,
)
from kvtier.rpc.convert.link_commands import from_proto_controller_command, from_proto_fetch_command
from kvtier.rpc.convert.link_events import from_proto_worker_event
from kvtier.rpc.convert.policy import (
    from_proto_get_policy_response,
    from_proto_policy_history_request,
    from_proto_rollback_policy_request,
    from_proto_set_policy_request,
)
from kvtier.rpc.convert.router import from_proto_route_request
from kvtier.rpc.convert.sessions import (
    from_proto_end_request,
    from_proto_pause_request,
    from_proto_pause_response,
    from_proto_returning_request,
    from_proto_session_info,
)
from kvtier.rpc.convert.worker import (
    from_proto_generate_event,
    from_proto_generate_final,
    from_proto_generate_request,
    from_proto_sampling_params,
)

# --------------------------------------------------------------------------- strategies

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
TEXT = st.text(max_size=12)
NAME = st.text(min_size=1, max_size=12)
OPT_NAME = st.none() | NAME
OPT_U64 = st.none() | U64
# Caller-given durations are bounded (MAX_DURATION_MS, a year).
OPT_DURATION_MS = st.none() | st.integers(0, MAX_DURATION_MS)
OPT_SPREAD = st.none() | st.floats(min_value=1e-6, max_value=10.0, allow_nan=False)
OPT_DURATION_S = st.none() | st.integers(0, MAX_DURATION_MS // 1000)
TOKEN = st.integers(0, 2**31 - 1)
TOKENS = st.lists(TOKEN, max_size=40).map(tuple)
KEY = st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)
KEYS = st.lists(KEY, max_size=6).map(tuple)
TIER = st.sampled_from(Tier)
OPT_TIER = st.none() | TIER
FINITE = st.floats(allow_nan=False, allow_infinity=False)
FRACTION = st.floats(0.0, 1.0)

namespaces = st.builds(
    NamespaceIdentity,
    model_id=NAME,
    weights_digest=TEXT,
    tokenizer_digest=TEXT,
    adapter=TEXT,
    rope_config=TEXT,
    kv_dtype=st.sampled_from(KV_DTYPES),
    page_size=st.integers(1, 4096),
    tenant=TEXT,
)
models = st.builds(
    r.ModelIdentity,
    model_id=NAME,
    weights_digest=TEXT,
    tokenizer_digest=TEXT,
    rope_config=TEXT,
    kv_dtype=st.sampled_from(KV_DTYPES),
)
prefixes = st.one_of(st.builds(r.TokenPrefix, token_ids=TOKENS), st.builds(r.PageKeyPrefix, page_keys=KEYS))
tokens_by_tier = st.builds(r.TokensByTier, hbm_tokens=U32, dram_tokens=U32, nvme_tokens=U32)
occupancies = st.builds(
    r.TierOccupancy,
    tier=TIER,
    total_pages=U64,
    free_pages=U64,
    cached_pages=U64,
    in_use_pages=U64,
    pinned_pages=U64,
    reclaimable_pages=U64,
)
occupancy_lists = st.lists(occupancies, max_size=3, unique_by=lambda o: o.tier).map(tuple)
capacities = st.builds(r.TierCapacity, tier=TIER, capacity_pages=U64, capacity_bytes=U64)
capacity_lists = st.lists(capacities, max_size=3, unique_by=lambda c: c.tier).map(tuple)
scopes = st.one_of(
    st.builds(r.InvalidationScope, namespace=namespaces),
    st.builds(r.InvalidationScope, tenant=NAME),
    st.builds(r.InvalidationScope, model_id=NAME),
    st.just(r.InvalidationScope(all_namespaces=True)),
)
sampling_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 2**32 - 1),
    temperature=st.floats(0.0, 100.0),
    top_k=U32,
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    seed=OPT_U64,
    stop_token_ids=st.lists(TOKEN, max_size=8),
    stop_sequences=st.lists(
        st.lists(TOKEN, min_size=1, max_size=MAX_STOP_SEQUENCE_TOKENS), max_size=MAX_STOP_SEQUENCES
    ),
    tool_call_sequence=st.lists(TOKEN, max_size=MAX_STOP_SEQUENCE_TOKENS),
    ignore_eos=st.booleans(),
)
peer_fetches = st.builds(r.PeerFetch, worker_id=NAME, num_pages=U32)
ranked_workers = st.builds(
    r.RankedWorker,
    worker_id=NAME,
    address=NAME,
    score=FINITE,
    matched_tokens=tokens_by_tier,
    is_affinity=st.booleans(),
    ticket=OPT_NAME,
    fetch=st.none() | peer_fetches,
    estimated_ttft_ms=FINITE,
)
token_chunks = st.builds(r.TokenChunk, token_ids=TOKENS, index=U32)
usages = st.builds(
    r.Usage,
    prompt_tokens=U32,
    cached_tokens=U32,
    promoted_tokens=U32,
    recomputed_tokens=U32,
    generated_tokens=U32,
    cached_tokens_by_tier=tokens_by_tier,
)
finals = st.builds(
    r.GenerateFinal,
    usage=usages,
    finish_reason=st.sampled_from(FinishReason),
    run_id=TEXT,
    ttft_ms=st.floats(0.0, 1e9),
)
integrity_reports = st.builds(r.IntegrityReport, component=NAME, tier=OPT_TIER, problem=OPT_NAME)
session_infos = st.builds(
    r.SessionInfo,
    session_id=NAME,
    state=st.sampled_from(r.SessionState),
    worker_id=OPT_NAME,
    tool_name=OPT_NAME,
    paused_at_ms=OPT_U64,
    predicted_return_at_ms=OPT_U64,
    prediction_source=st.none() | st.sampled_from(r.PredictionSource),
    prefetch_at_ms=OPT_U64,
    parked_tier=OPT_TIER,
    num_cached_tokens=U32,
)
model_facts = st.builds(
    r.ModelFacts, vocab_size=st.integers(1, 2**32 - 1), max_context_tokens=st.integers(1, 2**32 - 1),
    eos_token_ids=st.lists(TOKEN, max_size=4).map(tuple), has_chat_template=st.booleans(),
)
registrations = st.builds(
    r.Registration,
    worker_id=NAME,
    address=NAME,
    boot_id=NAME,
    model=models,
    page_size=st.integers(1, 2**32 - 1),
    capacities=capacity_lists,
    adapters=st.lists(TEXT, max_size=3).map(tuple),
    facts=st.none() | model_facts,
)
served_models = st.builds(
    r.ServedModel,
    namespace=namespaces,
    facts=st.none() | model_facts,
    adapters=st.lists(TEXT, max_size=3).map(tuple),
    num_workers=U32,
)
NONNEGATIVE = st.floats(0.0, 1e12)
worker_costs = st.builds(r.WorkerCosts, prefill_ms_per_token=NONNEGATIVE, fetch_bytes_per_s=NONNEGATIVE,
                         fetch_setup_ms=NONNEGATIVE, dram_promote_bytes_per_s=NONNEGATIVE,
                         nvme_promote_bytes_per_s=NONNEGATIVE, ms_per_queued_request=NONNEGATIVE)
heartbeats = st.builds(r.Heartbeat, seq=U64, tiers=occupancy_lists, queue_depth=U32, num_running_seqs=U32,
                       costs=st.none() | worker_costs)


@st.composite
def page_events(draw: st.DrawFn) -> r.PageEvent:
    digest, key = draw(KEY), draw(KEY)
    kind = draw(st.sampled_from(r.PageEventKind))
    if kind is r.PageEventKind.INSERT:
        return r.PageEvent.insert(digest, key, draw(KEY), draw(st.integers(1, 2**32 - 1)), draw(TIER))
    if kind is r.PageEventKind.MOVE:
        tier = draw(TIER)
        return r.PageEvent.move(
            digest, key, tier, draw(st.none() | st.sampled_from([t for t in Tier if t != tier]))
        )
    # A DROP (or MOVE) may still carry what the worker knows of the page's position.
    return dataclasses.replace(
        r.PageEvent.drop(digest, key, draw(OPT_TIER)),
        parent_key=draw(st.none() | KEY),
        depth=draw(st.none() | st.integers(1, 2**32 - 1)),
    )


page_event_batches = st.builds(
    r.PageEventBatch, seq=U64, events=st.lists(page_events(), max_size=5).map(tuple)
)
inventory_pages = st.builds(r.InventoryPage, page_key=KEY, parent_key=KEY, depth=st.integers(1, 2**32 - 1))
namespace_inventories = st.builds(
    r.NamespaceInventory,
    namespace_digest=KEY,
    tier=TIER,
    pages=st.lists(inventory_pages, max_size=4).map(tuple),
)
snapshot_chunks = st.builds(
    r.InventorySnapshotChunk,
    snapshot_id=NAME,
    chunk_index=U32,
    is_last=st.booleans(),
    as_of_seq=U64,
    inventories=st.lists(namespace_inventories, max_size=3).map(tuple),
)
command_acks = st.one_of(
    st.builds(r.CommandAck, command_id=U64, num_pages=U32, num_skipped_pages=U32),
    st.builds(r.CommandAck, command_id=U64, error_code=NAME, error_message=TEXT, num_skipped_pages=U32),
)
NONEMPTY_KEYS = st.lists(KEY, min_size=1, max_size=6).map(tuple)
fetch_commands = st.one_of(
    st.builds(r.FetchCommand, peer_worker_id=NAME, namespace_digest=KEY, page_keys=NONEMPTY_KEYS),
    st.builds(r.FetchCommand, peer_worker_id=NAME, namespace_digest=KEY, page_keys=st.just(()),
              max_pages=st.integers(1, 2**32 - 1)),
)
commands = st.one_of(
    st.builds(r.TicketKeyCommand, key=st.binary(min_size=32, max_size=32)),
    st.builds(r.DemoteCommand, namespace_digest=KEY, page_keys=NONEMPTY_KEYS, target_tier=TIER),
    st.builds(
        r.PrefetchCommand,
        namespace_digest=KEY,
        page_keys=NONEMPTY_KEYS,
        target_tier=TIER,
        deadline_ms=OPT_U64,
        session_id=OPT_NAME,
        return_in_ms=OPT_DURATION_MS,
        away_ms=OPT_DURATION_MS,
        return_spread=OPT_SPREAD,
    ),
    st.builds(r.DropCommand, namespace_digest=KEY, page_keys=NONEMPTY_KEYS),
    st.builds(r.InvalidateCommand, scope=scopes, policy_epoch=st.integers(1, 2**64 - 1)),
    st.builds(r.RequestSnapshotCommand, snapshot_id=NAME),
    st.builds(r.DrainCommand, draining=st.booleans()),
    st.builds(r.PinCommand, pin_id=NAME, namespace_digest=KEY, page_keys=NONEMPTY_KEYS, tier=TIER,
              expires_at_ms=OPT_U64),
    st.builds(r.UnpinCommand, pin_id=NAME),
    fetch_commands,
)
worker_infos = st.builds(
    r.WorkerInfo,
    worker_id=NAME,
    address=TEXT,
    boot_id=TEXT,
    state=st.sampled_from(r.WorkerState),
    model=models,
    page_size=U32,
    capacities=capacity_lists,
    tiers=occupancy_lists,
    adapters=st.lists(TEXT, max_size=3).map(tuple),
    queue_depth=U32,
    num_running_seqs=U32,
    last_heartbeat_at_ms=U64,
)


@st.composite
def watermarks(draw: st.DrawFn) -> r.Watermarks:
    low, high = sorted((draw(FRACTION), draw(FRACTION)))
    return r.Watermarks(high=high, low=low)


policies = st.builds(
    r.Policy,
    watermarks=st.dictionaries(TIER, watermarks()),
    tier_weights=st.dictionaries(TIER, st.floats(0.0, 1e6)),
    budget_bytes_per_s=st.dictionaries(TIER, st.integers(0, 2**63 - 1)),  # 2**63 up reads as negative
    eviction_policy=st.from_regex(r"[a-z0-9_-]{1,64}", fullmatch=True),
)
versioned_policies = st.builds(
    r.VersionedPolicy,
    policy=policies,
    version=st.integers(1, 2**64 - 1),
    set_by=TEXT,
    set_at_ms=U64,
    reason=TEXT,
)
worker_snapshots = st.builds(
    r.WorkerSnapshot, worker_id=NAME, snapshot_id=NAME, is_complete=st.booleans(), num_pages=U64
)
LIMIT = st.integers(1, MAX_LIST_LIMIT)

# name (as in to_proto_<name> / from_proto_<name>) → strategy of domain values
ROUND_TRIPS: dict[str, st.SearchStrategy[Any]] = {
    # common
    "namespace_identity": namespaces,
    "model_identity": models,
    "tokens_by_tier": tokens_by_tier,
    "tier_occupancy": occupancies,
    "tier_capacity": capacities,
    "invalidation_scope": scopes,
    "peer_fetch": peer_fetches,
    # router
    "route_request": st.builds(r.RouteRequest, namespace=namespaces, prefix=prefixes, session_id=OPT_NAME),
    "ranked_worker": ranked_workers,
    "route_decision": st.builds(
        r.RouteDecision,
        workers=st.lists(ranked_workers, max_size=4).map(tuple),
        degraded_reason=st.none() | TEXT,
    ),
    # worker
    "sampling_params": sampling_params,
    "generate_request": st.builds(
        r.GenerateRequest,
        namespace=namespaces,
        prompt_token_ids=st.lists(TOKEN, min_size=1, max_size=40).map(tuple),
        sampling=sampling_params,
        session_id=OPT_NAME,
        request_id=OPT_NAME,
        priority=st.integers(-r.MAX_PRIORITY, r.MAX_PRIORITY),
        peer_fetch=st.none() | peer_fetches,
    ),
    "token_chunk": token_chunks,
    "usage": usages,
    "generate_final": finals,
    "generate_event": token_chunks | finals,
    "integrity_report": integrity_reports,
    "integrity_result": st.builds(
        r.IntegrityResult, reports=st.lists(integrity_reports, max_size=4).map(tuple)
    ),
    "worker_stats": st.builds(
        r.WorkerStats,
        worker_id=NAME,
        boot_id=TEXT,
        tiers=occupancy_lists,
        queue_depth=U32,
        num_running_seqs=U32,
    ),
    # sessions
    "pause_request": st.builds(r.PauseRequest, session_id=NAME, tool_name=OPT_NAME, expected_ms=OPT_DURATION_MS),
    "returning_request": st.builds(r.ReturningRequest, session_id=NAME, eta_ms=OPT_DURATION_MS),
    "end_request": st.builds(r.EndRequest, session_id=NAME, drop=st.booleans()),
    "model_facts": model_facts,
    "served_models": st.lists(served_models, max_size=3).map(tuple),
    "session_info": session_infos,
    "pause_response": session_infos,
    "returning_response": session_infos,
    "end_response": session_infos,
    # worker link
    "registration": registrations,
    "heartbeat": heartbeats,
    "worker_costs": worker_costs,
    "page_event": page_events(),
    "page_event_batch": page_event_batches,
    "inventory_page": inventory_pages,
    "namespace_inventory": namespace_inventories,
    "inventory_snapshot_chunk": snapshot_chunks,
    "command_ack": command_acks,
    "worker_event": st.one_of(registrations, heartbeats, page_event_batches, snapshot_chunks, command_acks),
    "demote_command": st.one_of(
        st.builds(r.DemoteCommand, namespace_digest=KEY, page_keys=NONEMPTY_KEYS, target_tier=TIER),
        st.builds(r.DemoteCommand, namespace_digest=KEY, page_keys=st.just(()), target_tier=TIER,
                  session_id=NAME),
        st.builds(r.DemoteCommand, namespace_digest=KEY, page_keys=st.just(()), target_tier=TIER,
                  whole_namespace=st.just(True)),
    ),
    "prefetch_command": st.one_of(
        st.builds(
            r.PrefetchCommand,
            namespace_digest=KEY,
            page_keys=NONEMPTY_KEYS,
            target_tier=TIER,
            deadline_ms=OPT_U64,
            session_id=OPT_NAME,
            return_in_ms=OPT_DURATION_MS,
            away_ms=OPT_DURATION_MS,
            return_spread=OPT_SPREAD,
        ),
        st.builds(r.PrefetchCommand, namespace_digest=KEY, page_keys=st.just(()), target_tier=TIER,
                  deadline_ms=OPT_U64, session_id=NAME, return_in_ms=OPT_DURATION_MS),
    ),
    "drop_command": st.one_of(
        st.builds(r.DropCommand, namespace_digest=KEY, page_keys=NONEMPTY_KEYS),
        st.builds(r.DropCommand, namespace_digest=KEY, page_keys=st.just(()), session_id=NAME,
                  keep_pages=st.booleans()),
        st.builds(r.DropCommand, namespace_digest=KEY, page_keys=st.just(()), whole_namespace=st.just(True)),
    ),
    "invalidate_command": st.builds(
        r.InvalidateCommand, scope=scopes, policy_epoch=st.integers(1, 2**64 - 1)
    ),
    "request_snapshot_command": st.builds(r.RequestSnapshotCommand, snapshot_id=NAME),
    "drain_command": st.builds(r.DrainCommand, draining=st.booleans()),
    "pin_command": st.builds(
        r.PinCommand, pin_id=NAME, namespace_digest=KEY, page_keys=NONEMPTY_KEYS, tier=TIER, expires_at_ms=OPT_U64
    ),
    "unpin_command": st.builds(r.UnpinCommand, pin_id=NAME),
    "ticket_key_command": st.builds(r.TicketKeyCommand, key=st.binary(min_size=32, max_size=32)),
    "fetch_command": fetch_commands,
    "controller_command": st.builds(r.ControllerCommand, command_id=U64, command=commands),
    # admin
    "controller_status": st.builds(
        r.ControllerStatus,
        controller_id=TEXT,
        is_leader=st.booleans(),
        leader_address=OPT_NAME,
        version=TEXT,
        uptime_s=U64,
        num_workers=U32,
        num_live_workers=U32,
        num_active_sessions=U32,
        num_paused_sessions=U32,
        num_resuming_sessions=U32,
        tiers=occupancy_lists,
        policy_version=U64,
        is_directory_reachable=st.booleans(),
    ),
    "worker_info": worker_infos,
    "worker_list": st.lists(worker_infos, max_size=3).map(tuple),
    "list_sessions_request": st.builds(
        r.ListSessionsRequest,
        state=st.none() | st.sampled_from(r.SessionState),
        limit=LIMIT,
        page_token=OPT_NAME,
    ),
    "session_page": st.builds(
        r.SessionPage, sessions=st.lists(session_infos, max_size=3).map(tuple), next_page_token=OPT_NAME
    ),
    "lookup_request": st.builds(r.LookupRequest, namespace=namespaces, prefix=prefixes),
    "worker_match": st.builds(r.WorkerMatch, worker_id=NAME, matched_tokens=tokens_by_tier),
    "lookup_result": st.builds(
        r.LookupResult,
        namespace_digest=KEY,
        num_query_pages=U32,
        matches=st.lists(
            st.builds(r.WorkerMatch, worker_id=NAME, matched_tokens=tokens_by_tier), max_size=3
        ).map(tuple),
    ),
    "invalidate_request": st.builds(r.InvalidateRequest, scope=scopes, reason=TEXT),
    "invalidate_result": st.builds(r.InvalidateResult, policy_epoch=U64, num_workers_notified=U32),
    "drain_request": st.builds(r.DrainRequest, worker_id=NAME, resume=st.booleans()),
    "drain_response": worker_infos,
    "pin_request": st.builds(r.PinRequest, namespace=namespaces, prefix=prefixes, tier=TIER, ttl_s=OPT_DURATION_S,
                             replicas=st.integers(0, 16)),
    "pin_result": st.builds(r.PinResult, pin_id=NAME, num_pinned_pages=U64, expires_at_ms=OPT_U64),
    "unpin_request": st.builds(r.UnpinRequest, pin_id=NAME),
    "unpin_result": st.builds(r.UnpinResult, num_unpinned_pages=U64),
    "evict_request": st.builds(
        r.EvictRequest,
        namespace=namespaces,
        prefix=st.none() | prefixes,
        worker_id=OPT_NAME,
        demote_to_tier=OPT_TIER,
    ),
    "evict_result": st.builds(r.EvictResult, num_pages=U64, num_workers=U32),
    "watermarks": watermarks(),
    "policy": policies,
    "versioned_policy": versioned_policies,
    "set_policy_request": st.builds(
        r.SetPolicyRequest, policy=policies, expected_version=OPT_U64, reason=TEXT
    ),
    "set_policy_response": versioned_policies,
    "get_policy_request": st.builds(r.GetPolicyRequest, version=st.none() | st.integers(1, 2**64 - 1)),
    "get_policy_response": versioned_policies,
    "policy_history_request": st.builds(r.PolicyHistoryRequest, limit=LIMIT),
    "policy_history": st.lists(versioned_policies, max_size=3).map(tuple),
    "rollback_policy_request": st.builds(
        r.RollbackPolicyRequest, to_version=st.integers(1, 2**64 - 1), reason=TEXT
    ),
    "rollback_policy_response": versioned_policies,
    "snapshot_request": st.builds(
        r.SnapshotRequest, worker_ids=st.lists(NAME, max_size=3).map(tuple), wait=st.booleans()
    ),
    "worker_snapshot": worker_snapshots,
    "snapshot_result": st.lists(worker_snapshots, max_size=3).map(tuple),
}


def _defined_converters() -> dict[str, Callable[[Any], Any]]:
    """Every ``to_proto_*`` / ``from_proto_*`` defined in a module of ``kvtier.rpc.convert``."""
    found = {}
    for info in pkgutil.iter_modules(convert.__path__):
        module = importlib.import_module(f"{convert.__name__}.{info.name}")
        for name, value in vars(module).items():
            if name.startswith(("to_proto_", "from_proto_")) and value.__module__ == module.__name__:
                found[name] = value
    return found


CONVERTERS = _defined_converters()


def _converters(name: str) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    return CONVERTERS[f"to_proto_{name}"], CONVERTERS[f"from_proto_{name}"]


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_round_trip(name: str) -> None:
    to_proto, from_proto = _converters(name)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ROUND_TRIPS[name])
    def check(value: Any) -> None:
        message = to_proto(value)
        decoded = type(message).FromString(message.SerializeToString())
        assert decoded == message
        assert from_proto(decoded) == value

    check()


def test_every_converter_pair_is_round_tripped() -> None:
    to_names = {n.removeprefix("to_proto_") for n in CONVERTERS if n.startswith("to_proto_")}
    from_names = {n.removeprefix("from_proto_") for n in CONVERTERS if n.startswith("from_proto_")}
    assert to_names == from_names
    assert to_names == set(ROUND_TRIPS)


def test_every_record_has_a_converter() -> None:
    # TokenPrefix / PageKeyPrefix travel only inside the `oneof prefix` of requests.
    inside_other_messages = {r.TokenPrefix, r.PageKeyPrefix}
    record_types = {
        obj for obj in vars(r).values() if dataclasses.is_dataclass(obj) and obj.__module__ == r.__name__
    }
    returned: set[type] = set()
    for name in ROUND_TRIPS:
        returned |= _types_in(typing.get_type_hints(CONVERTERS[f"from_proto_{name}"])["return"])
    assert record_types - inside_other_messages <= returned


def _types_in(annotation: Any) -> set[type]:
    args = typing.get_args(annotation)
    if args:
        return set().union(*(_types_in(a) for a in args))
    return {annotation} if isinstance(annotation, type) else set()


def test_wire_enums_match_domain_enums() -> None:
    for tier in Tier:
        assert common_pb2.Tier.Value(f"TIER_{tier.name}") == tier.value
    assert len(common_pb2.Tier.keys()) == len(Tier) + 1
    for reason in FinishReason:
        assert worker_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}")
    assert len(worker_pb2.FinishReason.keys()) == len(FinishReason) + 1
    assert len(sessions_pb2.SessionState.keys()) == len(r.SessionState) + 1
    assert len(worker_link_pb2.PageEventKind.keys()) == len(r.PageEventKind) + 1
    assert len(admin_pb2.WorkerState.keys()) == len(r.WorkerState) + 1


def test_policy_epoch_never_travels() -> None:
    identity = NamespaceIdentity(model_id="m", policy_epoch=7)
    decoded = from_proto_namespace_identity(to_proto_namespace_identity(identity))
    assert decoded == dataclasses.replace(identity, policy_epoch=0)


def test_unset_sampling_fields_take_domain_defaults() -> None:
    assert from_proto_sampling_params(worker_pb2.SamplingParams()) == SamplingParams()
    request = worker_pb2.GenerateRequest(namespace=_ns(), prompt_token_ids=[1])
    assert from_proto_generate_request(request).sampling == SamplingParams()


def test_unset_list_limits_take_defaults() -> None:
    assert from_proto_list_sessions_request(admin_pb2.ListSessionsRequest()).limit == 100
    assert from_proto_policy_history_request(admin_pb2.PolicyHistoryRequest()).limit == 20


# --------------------------------------------------------------------------- invalid input


def _ns(**overrides: Any) -> common_pb2.NamespaceIdentity:
    fields = {"model_id": "llama", "kv_dtype": "bf16", "page_size": 16, "tenant": "acme"}
    return common_pb2.NamespaceIdentity(**{**fields, **overrides})


def _route(**overrides: Any) -> router_pb2.RouteRequest:
    fields: dict[str, Any] = {"namespace": _ns(), "token_ids": common_pb2.TokenIds(ids=[1, 2, 3])}
    return router_pb2.RouteRequest(**{**fields, **overrides})


def _generate(**overrides: Any) -> worker_pb2.GenerateRequest:
    fields: dict[str, Any] = {"namespace": _ns(), "prompt_token_ids": [1, 2, 3]}
    return worker_pb2.GenerateRequest(**{**fields, **overrides})


def _sampling(**kwargs: Any) -> worker_pb2.GenerateRequest:
    return _generate(sampling=worker_pb2.SamplingParams(**kwargs))


KEY16 = b"k" * KEY_BYTES


def _page_event(**overrides: Any) -> worker_link_pb2.PageEvent:
    fields: dict[str, Any] = {
        "kind": worker_link_pb2.PAGE_EVENT_KIND_INSERT,
        "namespace_digest": KEY16,
        "page_key": KEY16,
        "parent_key": KEY16,
        "depth": 1,
        "tier": common_pb2.TIER_HBM,
    }
    return worker_link_pb2.PageEvent(**{**fields, **overrides})


def _events(*events: worker_link_pb2.PageEvent) -> worker_link_pb2.WorkerEvent:
    return worker_link_pb2.WorkerEvent(page_events=worker_link_pb2.PageEventBatch(seq=1, events=events))


def _register(**overrides: Any) -> worker_link_pb2.WorkerEvent:
    fields: dict[str, Any] = {
        "worker_id": "w0",
        "address": "127.0.0.1:1",
        "boot_id": "b",
        "model": common_pb2.ModelIdentity(model_id="llama", kv_dtype="bf16"),
        "page_size": 16,
    }
    return worker_link_pb2.WorkerEvent(register=worker_link_pb2.Register(**{**fields, **overrides}))


def _command(**member: Any) -> worker_link_pb2.ControllerCommand:
    return worker_link_pb2.ControllerCommand(command_id=1, **member)


def _policy(**overrides: Any) -> admin_pb2.SetPolicyRequest:
    fields: dict[str, Any] = {
        "watermarks": {"hbm": admin_pb2.Watermarks(high=0.9, low=0.8)},
        "tier_weights": {"hbm": 1.0},
        "eviction_policy": "value",
    }
    return admin_pb2.SetPolicyRequest(policy=admin_pb2.Policy(**{**fields, **overrides}))


OCC = common_pb2.TierOccupancy

# (id, parse, message, error type, field)
INVALID: list[tuple[str, Callable[[Any], Any], Any, type[KvtierError], str]] = [
    # identity fields
    (
        "route-no-namespace",
        from_proto_route_request,
        _route(namespace=None),
        InvalidArgument,
        "namespace",
    ),
    (
        "model-id-missing",
        from_proto_route_request,
        _route(namespace=_ns(model_id="")),
        InvalidArgument,
        "namespace.model_id",
    ),
    (
        "kv-dtype-missing",
        from_proto_route_request,
        _route(namespace=_ns(kv_dtype="")),
        InvalidArgument,
        "namespace.kv_dtype",
    ),
    (
        "kv-dtype-unknown",
        from_proto_generate_request,
        _generate(namespace=_ns(kv_dtype="int3")),
        InvalidArgument,
        "namespace.kv_dtype",
    ),
    (
        "page-size-missing",
        from_proto_generate_request,
        _generate(namespace=_ns(page_size=0)),
        InvalidArgument,
        "namespace.page_size",
    ),
    (
        "identity-field-too-long",
        from_proto_route_request,
        _route(namespace=_ns(tenant="t" * 10_000)),
        InvalidArgument,
        "namespace.tenant",
    ),
    # prefixes
    ("route-no-prefix", from_proto_route_request, _route(token_ids=None), InvalidArgument, "prefix"),
    (
        "negative-token",
        from_proto_route_request,
        _route(token_ids=common_pb2.TokenIds(ids=[5, -1])),
        InvalidArgument,
        "token_ids.ids[1]",
    ),
    (
        "short-page-key",
        from_proto_lookup_request,
        admin_pb2.LookupRequest(namespace=_ns(), page_keys=common_pb2.PageKeys(keys=[KEY16, b"short"])),
        InvalidArgument,
        "page_keys.keys[1]",
    ),
    (
        "pin-tier-unset",
        from_proto_pin_request,
        admin_pb2.PinRequest(namespace=_ns(), token_ids=common_pb2.TokenIds(ids=[1])),
        InvalidArgument,
        "tier",
    ),
    # generate
    (
        "empty-prompt",
        from_proto_generate_request,
        _generate(prompt_token_ids=[]),
        InvalidArgument,
        "prompt_token_ids",
    ),
    (
        "prompt-too-long",
        from_proto_generate_request,
        _generate(prompt_token_ids=[1] * (MAX_PROMPT_TOKENS + 1)),
        ResourceExhausted,
        "prompt_token_ids",
    ),
    (
        "negative-prompt-token",
        from_proto_generate_request,
        _generate(prompt_token_ids=[1, 2, -3]),
        InvalidArgument,
        "prompt_token_ids[2]",
    ),
    ("priority", from_proto_generate_request, _generate(priority=5000), InvalidArgument, "priority"),
    (
        "max-tokens-zero",
        from_proto_generate_request,
        _sampling(max_tokens=0),
        InvalidArgument,
        "sampling.max_tokens",
    ),
    (
        "top-p-zero",
        from_proto_generate_request,
        _sampling(top_p=0.0),
        InvalidArgument,
        "sampling.top_p",
    ),
    (
        "temperature-negative",
        from_proto_generate_request,
        _sampling(temperature=-0.5),
        InvalidArgument,
        "sampling.temperature",
    ),
    (
        "temperature-nan",
        from_proto_generate_request,
        _sampling(temperature=math.nan),
        InvalidArgument,
        "sampling.temperature",
    ),
    (
        "too-many-stop-sequences",
        from_proto_generate_request,
        _sampling(stop_sequences=[common_pb2.TokenIds(ids=[1])] * (MAX_STOP_SEQUENCES + 1)),
        InvalidArgument,
        "sampling.stop_sequences",
    ),
    (
        "negative-stop-token",
        from_proto_generate_request,
        _sampling(stop_sequences=[common_pb2.TokenIds(ids=[4]), common_pb2.TokenIds(ids=[-4])]),
        InvalidArgument,
        "sampling.stop_sequences[1].ids[0]",
    ),
    (
        "too-many-stop-token-ids",
        from_proto_generate_request,
        _sampling(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)),
        InvalidArgument,
        "sampling.stop_token_ids",
    ),
    ("event-unset", from_proto_generate_event, worker_pb2.GenerateEvent(), InvalidArgument, "event"),
    (
        "finish-reason-unset",
        from_proto_generate_event,
        worker_pb2.GenerateEvent(final=worker_pb2.GenerateFinal(run_id="r")),
        InvalidArgument,
        "final.finish_reason",
    ),
    (
        "finish-reason-unknown",
        from_proto_generate_event,
        worker_pb2.GenerateEvent(final=worker_pb2.GenerateFinal(finish_reason=99)),
        InvalidArgument,
        "final.finish_reason",
    ),
    (
        "ttft-negative",
        from_proto_generate_final,
        worker_pb2.GenerateFinal(finish_reason=worker_pb2.FINISH_REASON_STOP, ttft_ms=-1.0),
        InvalidArgument,
        "final.ttft_ms",
    ),
    # sessions
    (
        "pause-no-session",
        from_proto_pause_request,
        sessions_pb2.PauseRequest(),
        InvalidArgument,
        "session_id",
    ),
    (
        "session-id-too-long",
        from_proto_end_request,
        sessions_pb2.EndRequest(session_id="s" * 1000),
        InvalidArgument,
        "session_id",
    ),
    (
        "session-state-unknown",
        from_proto_pause_response,
        sessions_pb2.PauseResponse(session=sessions_pb2.SessionInfo(session_id="s", state=42)),
        InvalidArgument,
        "session.state",
    ),
    (
        "parked-tier-unknown",
        from_proto_session_info,
        sessions_pb2.SessionInfo(session_id="s", state=sessions_pb2.SESSION_STATE_PAUSED, parked_tier=9),
        InvalidArgument,
        "session.parked_tier",
    ),
    # worker link
    (
        "worker-event-unset",
        from_proto_worker_event,
        worker_link_pb2.WorkerEvent(),
        InvalidArgument,
        "event",
    ),
    (
        "register-no-worker-id",
        from_proto_worker_event,
        _register(worker_id=""),
        InvalidArgument,
        "register.worker_id",
    ),
    (
        "register-no-model",
        from_proto_worker_event,
        _register(model=None),
        InvalidArgument,
        "register.model",
    ),
    (
        "register-page-size",
        from_proto_worker_event,
        _register(page_size=0),
        InvalidArgument,
        "register.page_size",
    ),
    (
        "register-duplicate-tier",
        from_proto_worker_event,
        _register(capacities=[common_pb2.TierCapacity(tier=1), common_pb2.TierCapacity(tier=1)]),
        InvalidArgument,
        "register.capacities[1].tier",
    ),
    (
        "heartbeat-unknown-tier",
        from_proto_worker_event,
        worker_link_pb2.WorkerEvent(heartbeat=worker_link_pb2.Heartbeat(tiers=[OCC(tier=1), OCC(tier=7)])),
        InvalidArgument,
        "heartbeat.tiers[1].tier",
    ),
    (
        "heartbeat-tier-unset",
        from_proto_worker_event,
        worker_link_pb2.WorkerEvent(heartbeat=worker_link_pb2.Heartbeat(tiers=[OCC()])),
        InvalidArgument,
        "heartbeat.tiers[0].tier",
    ),
    (
        "batch-too-large",
        from_proto_worker_event,
        _events(*[_page_event()] * (MAX_BATCH_EVENTS + 1)),
        ResourceExhausted,
        "page_events.events",
    ),
    (
        "event-short-key",
        from_proto_worker_event,
        _events(_page_event(), _page_event(page_key=b"x" * 15)),
        InvalidArgument,
        "page_events.events[1].page_key",
    ),
    (
        "event-short-digest",
        from_proto_worker_event,
        _events(_page_event(namespace_digest=b"")),
        InvalidArgument,
        "page_events.events[0].namespace_digest",
    ),
    (
        "event-kind-unset",
        from_proto_worker_event,
        _events(_page_event(kind=0)),
        InvalidArgument,
        "page_events.events[0].kind",
    ),
    (
        "move-to-same-tier",
        from_proto_worker_event,
        _events(_page_event(kind=worker_link_pb2.PAGE_EVENT_KIND_MOVE, from_tier=common_pb2.TIER_HBM)),
        InvalidArgument,
        "page_events.events[0].from_tier",
    ),
    (
        "insert-tier-unset",
        from_proto_worker_event,
        _events(_page_event(tier=0)),
        InvalidArgument,
        "page_events.events[0].tier",
    ),
    (
        "move-tier-unset",
        from_proto_worker_event,
        _events(_page_event(kind=worker_link_pb2.PAGE_EVENT_KIND_MOVE, tier=0)),
        InvalidArgument,
        "page_events.events[0].tier",
    ),
    (
        "insert-with-from-tier",
        from_proto_worker_event,
        _events(_page_event(from_tier=common_pb2.TIER_DRAM)),
        InvalidArgument,
        "page_events.events[0].from_tier",
    ),
    (
        "insert-depth-zero",
        from_proto_worker_event,
        _events(_page_event(depth=0)),
        InvalidArgument,
        "page_events.events[0].depth",
    ),
    (
        "insert-without-parent",
        from_proto_worker_event,
        _events(_page_event(parent_key=b"")),
        InvalidArgument,
        "page_events.events[0].parent_key",
    ),
    (
        "drop-short-parent",
        from_proto_worker_event,
        _events(_page_event(kind=worker_link_pb2.PAGE_EVENT_KIND_DROP, parent_key=b"p")),
        InvalidArgument,
        "page_events.events[0].parent_key",
    ),
    (
        "snapshot-chunk-too-large",
        from_proto_worker_event,
        worker_link_pb2.WorkerEvent(
            snapshot=worker_link_pb2.InventorySnapshotChunk(
                snapshot_id="s",
                inventories=[
                    worker_link_pb2.NamespaceInventory(
                        namespace_digest=KEY16,
                        tier=1,
                        pages=[worker_link_pb2.InventoryPage(page_key=KEY16, parent_key=KEY16, depth=1)]
                        * (MAX_SNAPSHOT_CHUNK_PAGES // 2 + 1),
                    )
                ]
                * 2,
            )
        ),
        ResourceExhausted,
        "snapshot.inventories",
    ),
    (
        "failed-ack-without-code",
        from_proto_worker_event,
        worker_link_pb2.WorkerEvent(ack=worker_link_pb2.CommandAck(command_id=3, ok=False)),
        InvalidArgument,
        "ack.error_code",
    ),
    ("command-unset", from_proto_controller_command, _command(), InvalidArgument, "command"),
    (
        "demote-unknown-tier",
        from_proto_controller_command,
        _command(
            demote=worker_link_pb2.DemoteCommand(namespace_digest=KEY16, page_keys=[KEY16], target_tier=9)
        ),
        InvalidArgument,
        "demote.target_tier",
    ),
    (
        "demote-no-keys",
        from_proto_controller_command,
        _command(demote=worker_link_pb2.DemoteCommand(namespace_digest=KEY16, target_tier=2)),
        InvalidArgument,
        "demote.page_keys",
    ),
    (
        "demote-keys-and-session",
        from_proto_controller_command,
        _command(demote=worker_link_pb2.DemoteCommand(namespace_digest=KEY16, page_keys=[KEY16], target_tier=2,
                                                      session_id="s")),
        InvalidArgument,
        "demote.page_keys",
    ),
    (
        "prefetch-no-keys-no-session",
        from_proto_controller_command,
        _command(prefetch=worker_link_pb2.PrefetchCommand(namespace_digest=KEY16, target_tier=1)),
        InvalidArgument,
        "prefetch.page_keys",
    ),
    (
        "prefetch-too-many-keys",
        from_proto_controller_command,
        _command(
            prefetch=worker_link_pb2.PrefetchCommand(
                namespace_digest=KEY16, page_keys=[KEY16] * (MAX_COMMAND_PAGES + 1), target_tier=1
            )
        ),
        ResourceExhausted,
        "prefetch.page_keys",
    ),
    (
        "prefetch-return-past-a-year",
        from_proto_controller_command,
        _command(prefetch=worker_link_pb2.PrefetchCommand(namespace_digest=KEY16, target_tier=1, session_id="s",
                                                          return_in_ms=MAX_DURATION_MS + 1)),
        InvalidArgument,
        "prefetch.return_in_ms",
    ),
    *(
        (
            f"prefetch-return-spread-{label}",
            from_proto_controller_command,
            _command(prefetch=worker_link_pb2.PrefetchCommand(namespace_digest=KEY16, target_tier=1, session_id="s",
                                                              return_in_ms=1_000, return_spread=spread)),
            InvalidArgument,
            "prefetch.return_spread",
        )
        for label, spread in (("zero", 0.0), ("negative", -0.4), ("nan", math.nan), ("infinite", math.inf))
    ),
    (
        "invalidate-epoch-zero",
        from_proto_controller_command,
        _command(
            invalidate=worker_link_pb2.InvalidateCommand(
                scope=common_pb2.InvalidationScope(all_namespaces=True)
            )
        ),
        InvalidArgument,
        "invalidate.policy_epoch",
    ),
    (
        "drop-whole-namespace-and-keys",
        from_proto_controller_command,
        _command(drop=worker_link_pb2.DropCommand(namespace_digest=KEY16, page_keys=[KEY16], whole_namespace=True)),
        InvalidArgument,
        "drop.page_keys",
    ),
    (
        "demote-whole-namespace-and-session",
        from_proto_controller_command,
        _command(demote=worker_link_pb2.DemoteCommand(namespace_digest=KEY16, target_tier=2, session_id="s",
                                                      whole_namespace=True)),
        InvalidArgument,
        "demote.session_id",
    ),
    (
        "pin-command-no-id",
        from_proto_controller_command,
        _command(pin=worker_link_pb2.PinCommand(namespace_digest=KEY16, page_keys=[KEY16], tier=1)),
        InvalidArgument,
        "pin.pin_id",
    ),
    (
        "pin-command-no-keys",
        from_proto_controller_command,
        _command(pin=worker_link_pb2.PinCommand(pin_id="p", namespace_digest=KEY16, tier=1)),
        InvalidArgument,
        "pin.page_keys",
    ),
    (
        "pin-command-no-tier",
        from_proto_controller_command,
        _command(pin=worker_link_pb2.PinCommand(pin_id="p", namespace_digest=KEY16, page_keys=[KEY16])),
        InvalidArgument,
        "pin.tier",
    ),
    (
        "pin-command-short-digest",
        from_proto_controller_command,
        _command(pin=worker_link_pb2.PinCommand(pin_id="p", namespace_digest=b"x", page_keys=[KEY16], tier=1)),
        InvalidArgument,
        "pin.namespace_digest",
    ),
    (
        "unpin-command-no-id",
        from_proto_controller_command,
        _command(unpin=worker_link_pb2.UnpinCommand()),
        InvalidArgument,
        "unpin.pin_id",
    ),
    (
        "snapshot-command-no-id",
        from_proto_controller_command,
        _command(request_snapshot=worker_link_pb2.RequestSnapshotCommand()),
        InvalidArgument,
        "request_snapshot.snapshot_id",
    ),
    # admin
    (
        "scope-unset",
        from_proto_invalidate_request,
        admin_pb2.InvalidateRequest(scope=common_pb2.InvalidationScope()),
        InvalidArgument,
        "scope",
    ),
    (
        "scope-all-false",
        from_proto_invalidate_request,
        admin_pb2.InvalidateRequest(scope=common_pb2.InvalidationScope(all_namespaces=False)),
        InvalidArgument,
        "scope",
    ),
    (
        "scope-empty-tenant",
        from_proto_invalidate_request,
        admin_pb2.InvalidateRequest(scope=common_pb2.InvalidationScope(tenant="")),
        InvalidArgument,
        "scope.tenant",
    ),
    (
        "scope-namespace-model-id",
        from_proto_invalidate_request,
        admin_pb2.InvalidateRequest(scope=common_pb2.InvalidationScope(namespace=_ns(model_id=""))),
        InvalidArgument,
        "scope.namespace.model_id",
    ),
    (
        "scope-namespace-page-size",
        from_proto_controller_command,
        _command(
            invalidate=worker_link_pb2.InvalidateCommand(
                scope=common_pb2.InvalidationScope(namespace=_ns(kv_dtype="int3")), policy_epoch=2
            )
        ),
        InvalidArgument,
        "invalidate.scope.namespace.kv_dtype",
    ),
    (
        "list-sessions-limit",
        from_proto_list_sessions_request,
        admin_pb2.ListSessionsRequest(limit=0),
        InvalidArgument,
        "limit",
    ),
    (
        "drain-no-worker",
        from_proto_drain_request,
        admin_pb2.DrainRequest(),
        InvalidArgument,
        "worker_id",
    ),
    (
        "evict-unknown-tier",
        from_proto_evict_request,
        admin_pb2.EvictRequest(namespace=_ns(), demote_to_tier=5),
        InvalidArgument,
        "demote_to_tier",
    ),
    (
        "rollback-version",
        from_proto_rollback_policy_request,
        admin_pb2.RollbackPolicyRequest(),
        InvalidArgument,
        "to_version",
    ),
    (
        "set-policy-unset",
        from_proto_set_policy_request,
        admin_pb2.SetPolicyRequest(),
        InvalidArgument,
        "policy",
    ),
    (
        "watermark-low-above-high",
        from_proto_set_policy_request,
        _policy(watermarks={"hbm": admin_pb2.Watermarks(high=0.5, low=0.7)}),
        InvalidArgument,
        "policy.watermarks.hbm.low",
    ),
    (
        "watermark-not-fraction",
        from_proto_set_policy_request,
        _policy(watermarks={"dram": admin_pb2.Watermarks(high=1.5, low=0.7)}),
        InvalidArgument,
        "policy.watermarks.dram.high",
    ),
    (
        "watermark-unknown-tier",
        from_proto_set_policy_request,
        _policy(watermarks={"ssd": admin_pb2.Watermarks(high=0.9, low=0.7)}),
        InvalidArgument,
        "policy.watermarks.ssd",
    ),
    (
        "weight-negative",
        from_proto_set_policy_request,
        _policy(tier_weights={"nvme": -1.0}),
        InvalidArgument,
        "policy.tier_weights.nvme",
    ),
    (
        "budget-unknown-tier",
        from_proto_set_policy_request,
        _policy(budget_bytes_per_s={"HBM": 10}),
        InvalidArgument,
        "policy.budget_bytes_per_s.HBM",
    ),
    (
        "eviction-policy-empty",
        from_proto_set_policy_request,
        _policy(eviction_policy=""),
        InvalidArgument,
        "policy.eviction_policy",
    ),
    (
        "pause-expected-beyond-a-year",
        from_proto_pause_request,
        sessions_pb2.PauseRequest(session_id="s", expected_ms=2**64 - 1),
        InvalidArgument,
        "expected_ms",
    ),
    (
        "returning-eta-beyond-a-year",
        from_proto_returning_request,
        sessions_pb2.ReturningRequest(session_id="s", eta_ms=MAX_DURATION_MS + 1),
        InvalidArgument,
        "eta_ms",
    ),
    (
        "pin-ttl-beyond-a-year",
        from_proto_pin_request,
        admin_pb2.PinRequest(
            namespace=common_pb2.NamespaceIdentity(model_id="m", kv_dtype="fp32", page_size=4),
            token_ids=common_pb2.TokenIds(ids=[1]), tier=common_pb2.TIER_HBM, ttl_s=2**63,
        ),
        InvalidArgument,
        "ttl_s",
    ),
    (
        "pin-replicas-beyond-the-limit",
        from_proto_pin_request,
        admin_pb2.PinRequest(
            namespace=common_pb2.NamespaceIdentity(model_id="m", kv_dtype="fp32", page_size=4),
            token_ids=common_pb2.TokenIds(ids=[1]), tier=common_pb2.TIER_HBM, replicas=17,
        ),
        InvalidArgument,
        "replicas",
    ),
    (
        "fetch-command-with-keys-and-max-pages",
        from_proto_fetch_command,
        worker_link_pb2.FetchCommand(peer_worker_id="w", namespace_digest=bytes(16), page_keys=[bytes(16)],
                                     max_pages=3),
        InvalidArgument,
        "fetch.page_keys",
    ),
    (
        "fetch-command-without-a-peer",
        from_proto_fetch_command,
        worker_link_pb2.FetchCommand(namespace_digest=bytes(16), max_pages=3),
        InvalidArgument,
        "fetch.peer_worker_id",
    ),
    (
        "versioned-policy-version-zero",
        from_proto_get_policy_response,
        admin_pb2.GetPolicyResponse(policy=admin_pb2.VersionedPolicy(policy=_policy().policy)),
        InvalidArgument,
        "policy.version",
    ),
]


@pytest.mark.parametrize(
    ("parse", "message", "error", "field"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_input_names_the_field(
    parse: Callable[[Any], Any], message: Any, error: type[KvtierError], field: str
) -> None:
    decoded = type(message).FromString(message.SerializeToString())
    with pytest.raises(error) as excinfo:
        parse(decoded)
    assert type(excinfo.value) is error
    assert excinfo.value.field == field
    assert field in str(excinfo.value)


def test_unknown_tier_error_lists_valid_tiers() -> None:
    message = _register(capacities=[common_pb2.TierCapacity(tier=4)])
    with pytest.raises(InvalidArgument, match="hbm=1, dram=2, nvme=3"):
        from_proto_worker_event(message)


# --------------------------------------------------------------------------- tiers and policy (domain)


def test_tier_parse_accepts_names_and_lists_valid_ones() -> None:
    assert Tier.parse("hbm") is Tier.HBM
    assert Tier.parse(" NVMe ") is Tier.NVME
    with pytest.raises(InvalidArgument, match="valid tiers are hbm, dram, nvme") as excinfo:
        Tier.parse("ssd", field="config.tier")
    assert excinfo.value.field == "config.tier"


def test_tier_order() -> None:
    assert Tier.HBM.slower is Tier.DRAM and Tier.NVME.slower is None
    assert Tier.NVME.faster is Tier.DRAM and Tier.HBM.faster is None
    assert Tier.HBM.is_faster_than(Tier.NVME)
    assert Tier.DRAM.label == "dram"


def test_default_policy_is_valid() -> None:
    r.Policy.default().validate()


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        (r.Policy(watermarks={Tier.HBM: r.Watermarks(high=0.8, low=0.9)}), "policy.watermarks.hbm.low"),
        (r.Policy(watermarks={Tier.NVME: r.Watermarks(high=0.8, low=-0.1)}), "policy.watermarks.nvme.low"),
        (r.Policy(tier_weights={Tier.DRAM: math.inf}), "policy.tier_weights.dram"),
        (r.Policy(budget_bytes_per_s={Tier.DRAM: -1}), "policy.budget_bytes_per_s.dram"),
        (r.Policy(watermarks={"ssd": r.Watermarks(high=0.8, low=0.1)}), "policy.watermarks.ssd"),  # type: ignore[dict-item]
        (r.Policy(eviction_policy="Value!"), "policy.eviction_policy"),
    ],
)
def test_policy_validation_names_the_field(policy: r.Policy, field: str) -> None:
    with pytest.raises(InvalidArgument) as excinfo:
        policy.validate()
    assert excinfo.value.field == field


def test_invalidation_scope_matches_ignoring_epoch() -> None:
    identity = NamespaceIdentity(model_id="m", tenant="a", policy_epoch=3)
    assert r.InvalidationScope(tenant="a").matches(identity)
    assert not r.InvalidationScope(tenant="b").matches(identity)
    assert r.InvalidationScope(model_id="m").matches(identity)
    assert r.InvalidationScope(namespace=dataclasses.replace(identity, policy_epoch=0)).matches(identity)
    assert r.InvalidationScope(all_namespaces=True).matches(identity)
    with pytest.raises(InvalidArgument):
        r.InvalidationScope().validate()
