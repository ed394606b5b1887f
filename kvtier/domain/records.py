"""Protobuf-free records of everything that crosses a process boundary (DESIGN §7).

Servicers and clients turn wire messages into these with ``kvtier.rpc.convert`` and
back; everything else (engine, pools, directory, router, policies) sees only these.
Records are frozen and slotted; sequences are tuples. Optional values are ``None``,
never an empty-string or zero sentinel. Field names follow the .proto files, so a
field path in an error (``namespace.model_id``, ``events[3].page_key``) reads the same
on both sides.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NewType

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity, PageKey
from kvtier.domain.params import FinishReason, SamplingParams
from kvtier.domain.tiers import TIER_LABELS, Tier

WorkerId = NewType("WorkerId", str)
SessionId = NewType("SessionId", str)
RunId = NewType("RunId", str)
"""Worker-assigned id of one generation; appears in logs, traces and GenerateFinal."""
RequestId = NewType("RequestId", str)
"""Caller-chosen id of one request."""
BootId = NewType("BootId", str)
"""Random id of one worker process start; a new one means the old inventory is gone."""
CommandId = NewType("CommandId", int)
SnapshotId = NewType("SnapshotId", str)
PinId = NewType("PinId", str)

# --------------------------------------------------------------------------- common


@dataclass(frozen=True, slots=True)
class TokenPrefix:
    """A prompt prefix given as token ids; the server derives the page keys."""

    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PageKeyPrefix:
    """A prompt prefix given as chained page keys, root first (trace replay; a Route hashed off
    the controller's event loop carries ``PackedKeys``)."""

    page_keys: Sequence[PageKey]


Prefix = TokenPrefix | PageKeyPrefix


@dataclass(frozen=True, slots=True)
class TokensByTier:
    hbm_tokens: int = 0
    dram_tokens: int = 0
    nvme_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.hbm_tokens + self.dram_tokens + self.nvme_tokens

    def for_tier(self, tier: Tier) -> int:
        return (self.hbm_tokens, self.dram_tokens, self.nvme_tokens)[tier - 1]


@dataclass(frozen=True, slots=True)
class TierOccupancy:
    """Page accounting of one tier. Invariant: free + cached + in_use == total."""

    tier: Tier
    total_pages: int
    free_pages: int
    cached_pages: int
    in_use_pages: int
    pinned_pages: int = 0
    reclaimable_pages: int = 0  # cached pages free to take at no copy (a copy lies below)

    @property
    def unpinned_pages(self) -> int:
        """Pages with content that no pin keeps (cached or in use): what a drain drops."""
        return max(0, self.cached_pages + self.in_use_pages - self.pinned_pages)

    @property
    def used_fraction(self) -> float:
        """(cached + in_use) / total — what watermarks compare against; 0 for an empty tier."""
        return (self.cached_pages + self.in_use_pages) / self.total_pages if self.total_pages else 0.0


@dataclass(frozen=True, slots=True)
class TierCapacity:
    tier: Tier
    capacity_pages: int
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """The model-level part of a namespace: what a worker serves."""

    model_id: str
    weights_digest: str = ""
    tokenizer_digest: str = ""
    rope_config: str = ""
    kv_dtype: str = "fp32"

    @classmethod
    def of(cls, namespace: NamespaceIdentity) -> ModelIdentity:
        return cls(
            model_id=namespace.model_id,
            weights_digest=namespace.weights_digest,
            tokenizer_digest=namespace.tokenizer_digest,
            rope_config=namespace.rope_config,
            kv_dtype=namespace.kv_dtype,
        )


@dataclass(frozen=True, slots=True)
class InvalidationScope:
    """Which namespaces an invalidation hits. Exactly one of the four is set;
    "everything" must be asked for with ``all_namespaces=True``, never by omission."""

    namespace: NamespaceIdentity | None = None
    tenant: str | None = None
    model_id: str | None = None
    all_namespaces: bool = False

    def validate(self, path: str = "scope") -> None:
        num_set = sum(
            [
                self.namespace is not None,
                self.tenant is not None,
                self.model_id is not None,
                self.all_namespaces,
            ]
        )
        if num_set != 1:
            raise InvalidArgument(
                f"{path} must set exactly one of namespace, tenant, model_id, all_namespaces (got {num_set})",
                field=path,
            )
        for name in ("tenant", "model_id"):
            if getattr(self, name) == "":
                raise InvalidArgument(f"{path}.{name} must not be empty", field=f"{path}.{name}")

    def matches(self, identity: NamespaceIdentity) -> bool:
        """Whether ``identity`` is in scope (the policy epoch is ignored: it is what changes)."""
        if self.all_namespaces:
            return True
        if self.tenant is not None:
            return identity.tenant == self.tenant
        if self.model_id is not None:
            return identity.model_id == self.model_id
        assert self.namespace is not None, "validate() guarantees one member is set"
        return _without_epoch(identity) == _without_epoch(self.namespace)


def _without_epoch(identity: NamespaceIdentity) -> tuple[object, ...]:
    return (
        identity.model_id,
        identity.weights_digest,
        identity.tokenizer_digest,
        identity.adapter,
        identity.rope_config,
        identity.kv_dtype,
        identity.page_size,
        identity.tenant,
    )


# --------------------------------------------------------------------------- router


@dataclass(frozen=True, slots=True)
class RouteRequest:
    namespace: NamespaceIdentity
    prefix: Prefix
    session_id: SessionId | None = None


@dataclass(frozen=True, slots=True)
class PeerFetch:
    """Fetch the prompt's full pages, up to ``num_pages`` from its first (0: all), from the
    worker ``worker_id`` before prefilling; pages cached on the receiver are not fetched."""

    worker_id: WorkerId
    num_pages: int = 0


@dataclass(frozen=True, slots=True)
class WorkerCosts:
    """Rates a worker measured on itself, for Route's cost model (0: not measured yet)."""

    prefill_ms_per_token: float = 0.0
    fetch_bytes_per_s: float = 0.0  # peer fetches into this worker: pull, verify, install
    fetch_setup_ms: float = 0.0  # the fixed part of one peer fetch
    dram_promote_bytes_per_s: float = 0.0
    nvme_promote_bytes_per_s: float = 0.0
    ms_per_queued_request: float = 0.0  # mean wait in the engine per request ahead (queued or running)


@dataclass(frozen=True, slots=True)
class RankedWorker:
    worker_id: WorkerId
    address: str
    score: float
    matched_tokens: TokensByTier = TokensByTier()
    is_affinity: bool = False
    # Signed by the controller for this worker and the request's tenant (kvtier.rpc.tickets);
    # None while the controller runs without authentication.
    ticket: str | None = field(default=None, repr=False)
    fetch: PeerFetch | None = None  # pass as GenerateRequest.peer_fetch
    estimated_ttft_ms: float = 0.0  # 0: not estimated


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Candidates best first. A degraded decision is still usable; the reason is for logs."""

    workers: tuple[RankedWorker, ...]
    degraded_reason: str | None = None

    @property
    def is_degraded(self) -> bool:
        return self.degraded_reason is not None

    @property
    def best(self) -> RankedWorker | None:
        return self.workers[0] if self.workers else None


# --------------------------------------------------------------------------- worker


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    namespace: NamespaceIdentity
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: SessionId | None = None
    request_id: RequestId | None = None
    priority: int = 0  # in [-MAX_PRIORITY, MAX_PRIORITY]; larger runs first
    peer_fetch: PeerFetch | None = None  # pages to fetch from a peer before prefilling


MAX_PRIORITY = 1000


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Generated tokens; ``index`` is the position of ``token_ids[0]`` in the output."""

    token_ids: tuple[int, ...]
    index: int


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one generation (field meanings in worker.proto)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    promoted_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens_by_tier: TokensByTier = TokensByTier()


@dataclass(frozen=True, slots=True)
class GenerateFinal:
    usage: Usage
    finish_reason: FinishReason
    run_id: RunId
    ttft_ms: float


GenerateEvent = TokenChunk | GenerateFinal


@dataclass(frozen=True, slots=True)
class IntegrityReport:
    """Outcome of one ``check_integrity()``; ``problem`` carries the numbers when it failed."""

    component: str
    tier: Tier | None = None
    problem: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.problem is None


@dataclass(frozen=True, slots=True)
class IntegrityResult:
    reports: tuple[IntegrityReport, ...]

    @property
    def is_ok(self) -> bool:
        return all(r.is_ok for r in self.reports)

    @property
    def problems(self) -> tuple[IntegrityReport, ...]:
        return tuple(r for r in self.reports if not r.is_ok)


@dataclass(frozen=True, slots=True)
class WorkerStats:
    worker_id: WorkerId
    boot_id: BootId
    tiers: tuple[TierOccupancy, ...]
    queue_depth: int = 0
    num_running_seqs: int = 0


# --------------------------------------------------------------------------- sessions


class SessionState(enum.Enum):
    ACTIVE = "active"
    PAUSED = "paused"  # a tool call is in flight
    RESUMING = "resuming"  # the tool is returning; pages are being promoted
    ENDED = "ended"


class PredictionSource(enum.Enum):
    CALLER_ESTIMATE = "caller_estimate"  # PauseRequest.expected_ms
    CALLER_ETA = "caller_eta"  # ReturningRequest.eta_ms
    HISTORY = "history"  # per-(tenant, tool) durations
    DEFAULT = "default"  # configured default, no history yet


@dataclass(frozen=True, slots=True)
class PauseRequest:
    session_id: SessionId
    tool_name: str | None = None
    expected_ms: int | None = None


@dataclass(frozen=True, slots=True)
class ReturningRequest:
    session_id: SessionId
    eta_ms: int | None = None  # None: the next turn arrives now


@dataclass(frozen=True, slots=True)
class EndRequest:
    session_id: SessionId
    drop: bool = False  # free the session's private pages now; False keeps them as ordinary cache entries


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What the controller knows and plans for a session. Times are Unix epoch ms."""

    session_id: SessionId
    state: SessionState
    worker_id: WorkerId | None = None
    tool_name: str | None = None
    paused_at_ms: int | None = None
    predicted_return_at_ms: int | None = None
    prediction_source: PredictionSource | None = None
    prefetch_at_ms: int | None = None
    parked_tier: Tier | None = None
    num_cached_tokens: int = 0


# --------------------------------------------------------------------------- worker link


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a frontend needs to know about a served model to build requests (Router.ListModels)."""

    vocab_size: int
    max_context_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    has_chat_template: bool = False


@dataclass(frozen=True, slots=True)
class Registration:
    """First event of a worker's link."""

    worker_id: WorkerId
    address: str
    boot_id: BootId
    model: ModelIdentity
    page_size: int
    capacities: tuple[TierCapacity, ...]
    adapters: tuple[str, ...] = ()
    facts: ModelFacts | None = None  # None: the worker did not report them


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model as live workers serve it: the exact namespace fields to send (tenant: the
    caller's, or empty), its facts, and how many live workers serve it."""

    namespace: NamespaceIdentity
    facts: ModelFacts | None
    adapters: tuple[str, ...]
    num_workers: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    seq: int
    tiers: tuple[TierOccupancy, ...]
    queue_depth: int = 0
    num_running_seqs: int = 0
    costs: WorkerCosts | None = None  # None: nothing measured yet


class PageEventKind(enum.Enum):
    INSERT = "insert"  # now present in `tier`
    MOVE = "move"  # now in `tier` and no longer in `from_tier` (None: in no other tier)
    DROP = "drop"  # no longer in `tier` (None: in no tier at all)


@dataclass(frozen=True, slots=True)
class PageEvent:
    """One change of a worker's inventory. INSERT carries ``depth`` (1-based) and
    ``parent_key`` (on the wire always; the namespace root key at depth 1, which the
    directory also takes as ``None``); MOVE and DROP may omit them. The controller's
    directory applies these as they are."""

    kind: PageEventKind
    namespace_digest: NamespaceDigest
    page_key: PageKey
    tier: Tier | None  # INSERT / MOVE: required; DROP: None means every tier
    parent_key: PageKey | None = None
    depth: int | None = None
    from_tier: Tier | None = None  # MOVE only

    @classmethod
    def insert(
        cls, namespace_digest: NamespaceDigest, page_key: PageKey, parent_key: PageKey | None, depth: int,
        tier: Tier,
    ) -> PageEvent:
        return cls(PageEventKind.INSERT, namespace_digest, page_key, tier, parent_key, depth)

    @classmethod
    def move(
        cls, namespace_digest: NamespaceDigest, page_key: PageKey, tier: Tier, from_tier: Tier | None = None
    ) -> PageEvent:
        return cls(PageEventKind.MOVE, namespace_digest, page_key, tier, from_tier=from_tier)

    @classmethod
    def drop(
        cls, namespace_digest: NamespaceDigest, page_key: PageKey, tier: Tier | None = None
    ) -> PageEvent:
        return cls(PageEventKind.DROP, namespace_digest, page_key, tier)


@dataclass(frozen=True, slots=True)
class PageEventBatch:
    seq: int  # +1 per batch within one boot; a gap means "request a snapshot"
    events: tuple[PageEvent, ...]


@dataclass(frozen=True, slots=True)
class InventoryPage:
    page_key: PageKey
    parent_key: PageKey
    depth: int


@dataclass(frozen=True, slots=True)
class NamespaceInventory:
    namespace_digest: NamespaceDigest
    tier: Tier
    pages: tuple[InventoryPage, ...]


@dataclass(frozen=True, slots=True)
class InventorySnapshotChunk:
    """Chunk ``chunk_index`` of snapshot ``snapshot_id``; reflects batches with seq <= as_of_seq."""

    snapshot_id: SnapshotId
    chunk_index: int
    is_last: bool
    as_of_seq: int
    inventories: tuple[NamespaceInventory, ...]

    @property
    def num_pages(self) -> int:
        return sum(len(inv.pages) for inv in self.inventories)


@dataclass(frozen=True, slots=True)
class CommandAck:
    """Outcome of one command; ``error_code`` is a kvtier error code, None on success.

    Demote, Prefetch and Drop also count the pages they moved or removed and the pages
    they left alone (held by a running sequence, pinned, moving, or no room)."""

    command_id: CommandId
    error_code: str | None = None
    error_message: str = ""
    num_pages: int = 0
    num_skipped_pages: int = 0

    @property
    def ok(self) -> bool:
        return self.error_code is None


WorkerEvent = Registration | Heartbeat | PageEventBatch | InventorySnapshotChunk | CommandAck


@dataclass(frozen=True, slots=True)
class DemoteCommand:
    """Exactly one of ``page_keys`` (non-empty; descendants move too), ``session_id`` and
    ``whole_namespace`` addresses the pages."""

    namespace_digest: NamespaceDigest
    page_keys: tuple[PageKey, ...]
    target_tier: Tier
    session_id: SessionId | None = None
    whole_namespace: bool = False


@dataclass(frozen=True, slots=True)
class PrefetchCommand:
    """``page_keys`` may be empty when ``session_id`` is set (the worker resolves them)."""

    namespace_digest: NamespaceDigest
    page_keys: tuple[PageKey, ...]  # root first
    target_tier: Tier
    deadline_ms: int | None = None  # after receipt; None for best effort
    session_id: SessionId | None = None
    return_in_ms: int | None = None  # after receipt: when the session is expected back (ranks holds)
    # With return_in_ms: how long the session had been away at receipt, and the spread (sigma
    # of ln duration) of its predicted return; they rank a hold once its session is overdue.
    away_ms: int | None = None
    return_spread: float | None = None


@dataclass(frozen=True, slots=True)
class DropCommand:
    """Exactly one of ``page_keys`` (non-empty; descendants go too), ``session_id`` (the
    session's private pages, deepest first, shared prefixes kept) and ``whole_namespace``."""

    namespace_digest: NamespaceDigest
    page_keys: tuple[PageKey, ...]
    session_id: SessionId | None = None
    whole_namespace: bool = False
    keep_pages: bool = False  # with session_id: forget the session, keep its pages as ordinary cache entries


@dataclass(frozen=True, slots=True)
class InvalidateCommand:
    scope: InvalidationScope
    policy_epoch: int  # strictly greater than any epoch the scope used before


@dataclass(frozen=True, slots=True)
class RequestSnapshotCommand:
    snapshot_id: SnapshotId


@dataclass(frozen=True, slots=True)
class DrainCommand:
    draining: bool  # False resumes admission


@dataclass(frozen=True, slots=True)
class PinCommand:
    """Keep the listed pages (held in ``tier`` or faster) in their tier until
    ``expires_at_ms`` (wall clock; None: until unpinned)."""

    pin_id: PinId
    namespace_digest: NamespaceDigest
    page_keys: tuple[PageKey, ...]  # root first, non-empty
    tier: Tier
    expires_at_ms: int | None = None


@dataclass(frozen=True, slots=True)
class UnpinCommand:
    pin_id: PinId


@dataclass(frozen=True, slots=True)
class TicketKeyCommand:
    """The key this worker verifies Route tickets with (32 bytes; never logged)."""

    key: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class FetchCommand:
    """Bring ``page_keys`` (a chain, root first) from worker ``peer_worker_id`` into this worker;
    with no keys, the peer's ``max_pages`` most valuable pages of the namespace (by eviction value)."""

    peer_worker_id: WorkerId
    namespace_digest: NamespaceDigest
    page_keys: tuple[PageKey, ...]
    max_pages: int = 0


Command = (
    DemoteCommand
    | PrefetchCommand
    | DropCommand
    | InvalidateCommand
    | RequestSnapshotCommand
    | DrainCommand
    | PinCommand
    | UnpinCommand
    | TicketKeyCommand
    | FetchCommand
)


@dataclass(frozen=True, slots=True)
class ControllerCommand:
    command_id: CommandId
    command: Command


# --------------------------------------------------------------------------- admin


class WorkerState(enum.Enum):
    LIVE = "live"
    DRAINING = "draining"
    EXPIRED = "expired"  # lease expired; directory entries ignored and reclaimed


@dataclass(frozen=True, slots=True)
class ControllerStatus:
    controller_id: str
    is_leader: bool
    leader_address: str | None
    version: str
    uptime_s: int
    num_workers: int
    num_live_workers: int
    num_active_sessions: int
    num_paused_sessions: int
    num_resuming_sessions: int
    tiers: tuple[TierOccupancy, ...]
    policy_version: int
    is_directory_reachable: bool


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: WorkerId
    address: str
    boot_id: BootId
    state: WorkerState
    model: ModelIdentity
    page_size: int
    capacities: tuple[TierCapacity, ...] = ()
    tiers: tuple[TierOccupancy, ...] = ()
    adapters: tuple[str, ...] = ()
    queue_depth: int = 0
    num_running_seqs: int = 0
    last_heartbeat_at_ms: int = 0


@dataclass(frozen=True, slots=True)
class ListSessionsRequest:
    state: SessionState | None = None
    limit: int = 100
    page_token: str | None = None


@dataclass(frozen=True, slots=True)
class SessionPage:
    sessions: tuple[SessionInfo, ...]
    next_page_token: str | None = None


@dataclass(frozen=True, slots=True)
class LookupRequest:
    namespace: NamespaceIdentity
    prefix: Prefix


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    worker_id: WorkerId
    matched_tokens: TokensByTier


@dataclass(frozen=True, slots=True)
class LookupResult:
    namespace_digest: NamespaceDigest
    num_query_pages: int
    matches: tuple[WorkerMatch, ...]


@dataclass(frozen=True, slots=True)
class InvalidateRequest:
    scope: InvalidationScope
    reason: str = ""


@dataclass(frozen=True, slots=True)
class InvalidateResult:
    policy_epoch: int
    num_workers_notified: int


@dataclass(frozen=True, slots=True)
class DrainRequest:
    worker_id: WorkerId
    resume: bool = False


@dataclass(frozen=True, slots=True)
class PinRequest:
    namespace: NamespaceIdentity
    prefix: Prefix
    tier: Tier  # slowest tier the pinned pages may sink to
    ttl_s: int | None = None
    replicas: int = 0  # workers that keep a copy (controller/replicas.py); 0: no copies made


@dataclass(frozen=True, slots=True)
class PinResult:
    pin_id: PinId
    num_pinned_pages: int
    expires_at_ms: int | None = None


@dataclass(frozen=True, slots=True)
class UnpinRequest:
    pin_id: PinId


@dataclass(frozen=True, slots=True)
class UnpinResult:
    num_unpinned_pages: int


@dataclass(frozen=True, slots=True)
class EvictRequest:
    namespace: NamespaceIdentity
    prefix: Prefix | None = None  # None: the whole namespace
    worker_id: WorkerId | None = None  # None: every worker
    demote_to_tier: Tier | None = None  # None: drop


@dataclass(frozen=True, slots=True)
class EvictResult:
    num_pages: int
    num_workers: int


@dataclass(frozen=True, slots=True)
class Watermarks:
    """Fractions of a tier's total pages: demote above ``high`` until back at ``low``."""

    high: float
    low: float


_POLICY_NAME = re.compile(r"[a-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class Policy:
    """Tiering policy (field meanings in admin.proto). A tier missing from ``watermarks``
    is never demoted proactively; missing from ``tier_weights`` weighs 0; missing from
    ``budget_bytes_per_s`` is unlimited."""

    watermarks: Mapping[Tier, Watermarks] = field(default_factory=dict)
    tier_weights: Mapping[Tier, float] = field(default_factory=dict)
    budget_bytes_per_s: Mapping[Tier, int] = field(default_factory=dict)
    eviction_policy: str = "experts"

    @classmethod
    def default(cls) -> Policy:
        return cls(
            watermarks={
                Tier.HBM: Watermarks(high=0.90, low=0.80),
                Tier.DRAM: Watermarks(high=0.90, low=0.80),
                Tier.NVME: Watermarks(high=0.95, low=0.85),
            },
            tier_weights={Tier.HBM: 1.0, Tier.DRAM: 0.6, Tier.NVME: 0.3},
            budget_bytes_per_s={},
            eviction_policy="experts",
        )

    def validate(self, path: str = "policy") -> None:
        """Raise ``InvalidArgument`` naming the first bad field, e.g. ``policy.watermarks.hbm.low``."""
        for name in ("watermarks", "tier_weights", "budget_bytes_per_s"):
            for key in getattr(self, name):
                if not isinstance(key, Tier):
                    raise InvalidArgument(
                        f"{path}.{name}.{key}: unknown tier {key!r}; valid tiers are {', '.join(TIER_LABELS)}",
                        field=f"{path}.{name}.{key}",
                    )
        for tier, marks in self.watermarks.items():
            where = f"{path}.watermarks.{tier.label}"
            for bound in ("high", "low"):
                value = getattr(marks, bound)
                if not (0.0 <= value <= 1.0):
                    raise InvalidArgument(
                        f"{where}.{bound} must be a fraction in [0, 1], got {value}", field=f"{where}.{bound}"
                    )
            if marks.low > marks.high:
                raise InvalidArgument(
                    f"{where}.low ({marks.low}) must be <= {where}.high ({marks.high})", field=f"{where}.low"
                )
        for tier, weight in self.tier_weights.items():
            if not (math.isfinite(weight) and weight >= 0.0):
                where = f"{path}.tier_weights.{tier.label}"
                raise InvalidArgument(f"{where} must be a finite number >= 0, got {weight}", field=where)
        for tier, budget in self.budget_bytes_per_s.items():
            # The wire type is uint64: a negative int64 sent as one arrives as 2**64 - n.
            if not 0 <= budget < 2**63:
                where = f"{path}.budget_bytes_per_s.{tier.label}"
                raise InvalidArgument(
                    f"{where} must be >= 0 and < 2**63 (a negative number sent as uint64 reads as "
                    f"2**64 minus it), got {budget}", field=where)
        if not _POLICY_NAME.fullmatch(self.eviction_policy):
            where = f"{path}.eviction_policy"
            raise InvalidArgument(
                f"{where} must be 1-64 lowercase letters, digits, '_' or '-', got {self.eviction_policy!r}",
                field=where,
            )


@dataclass(frozen=True, slots=True)
class VersionedPolicy:
    policy: Policy
    version: int  # 1, 2, ...
    set_by: str  # authenticated principal
    set_at_ms: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SetPolicyRequest:
    policy: Policy
    expected_version: int | None = None  # optimistic concurrency; None overwrites
    reason: str = ""


@dataclass(frozen=True, slots=True)
class GetPolicyRequest:
    version: int | None = None  # None: the current version


@dataclass(frozen=True, slots=True)
class PolicyHistoryRequest:
    limit: int = 20


@dataclass(frozen=True, slots=True)
class RollbackPolicyRequest:
    to_version: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    worker_ids: tuple[WorkerId, ...] = ()  # empty: every live worker
    wait: bool = False


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    worker_id: WorkerId
    snapshot_id: SnapshotId
    is_complete: bool
    num_pages: int
