"""What the directory's calls answer: outcomes, rejected events, lookups and statistics.

Expected outcomes are ``Outcome`` values (``controller/directory.py`` raises only for broken
contracts). A lookup answers in pages (``PrefixLookup``, ``HeldPrefix``); the wire's records
(``LookupResult``, ``WorkerMatch`` in ``kvtier.domain.records``) are the same in tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.domain.hashing import NamespaceDigest
from kvtier.domain.records import LookupResult, TokensByTier, WorkerId, WorkerMatch
from kvtier.domain.tiers import Tier


class Outcome(enum.Enum):
    OK = "ok"
    FENCED = "fenced"  # a newer leader exists: this controller must stop writing
    DUPLICATE = "duplicate"  # batch seq equals the last applied one: nothing changed
    REGRESSED = "regressed"  # batch seq below the last applied one: nothing changed
    UNKNOWN_WORKER = "unknown_worker"  # no registration for this worker: register first
    LEASE_EXPIRED = "lease_expired"  # the incarnation is retired: register again, resend inventory
    TOO_LARGE = "too_large"  # more than max_batch_events events: nothing changed


class RejectReason(enum.Enum):
    BAD_NAMESPACE = "bad_namespace"  # namespace digest is not 16 bytes
    BAD_KEY = "bad_key"  # page key or parent key is not 16 bytes
    BAD_KIND = "bad_kind"
    BAD_TIER = "bad_tier"
    BAD_DEPTH = "bad_depth"  # INSERT with depth < 1
    BAD_PARENT = "bad_parent"  # depth 1 with a parent other than the namespace root
    MISSING_PARENT = "missing_parent"  # depth > 1 and the same worker does not hold the parent
    NOT_HELD = "not_held"  # MOVE/DROP of a page the worker does not hold


@dataclass(frozen=True, slots=True, order=True)
class RejectedEvent:
    index: int  # position in the batch
    reason: RejectReason


@dataclass(frozen=True, slots=True)
class ApplyResult:
    outcome: Outcome
    num_applied: int = 0
    rejected: tuple[RejectedEvent, ...] = ()


class Holder(NamedTuple):
    worker: WorkerId
    tier: Tier  # fastest tier holding the page


class HeldPrefix(NamedTuple):
    """The leading pages of a query one live worker holds, contiguously from depth 1.

    ``tiers[d - 1]`` is the fastest tier with a copy of the depth-``d`` page;
    ``num_hbm + num_dram + num_nvme == num_pages``. In tokens (``matched_tokens``) it is the
    ``WorkerMatch`` of ``kvtier.domain.records`` that Route and Admin.Lookup answer with.
    """

    worker: WorkerId
    tiers: bytes
    num_hbm: int
    num_dram: int
    num_nvme: int

    @classmethod
    def from_tiers(cls, worker: WorkerId, tiers: bytes) -> HeldPrefix:
        return cls(worker, tiers, tiers.count(1), tiers.count(2), tiers.count(3))

    @property
    def num_pages(self) -> int:
        return len(self.tiers)

    def num_in(self, tier: Tier) -> int:
        return (self.num_hbm, self.num_dram, self.num_nvme)[tier - 1]

    def tier_at(self, depth: int) -> Tier:
        return Tier(self.tiers[depth - 1])

    def matched_tokens(self, page_size: int) -> TokensByTier:
        return TokensByTier(
            hbm_tokens=self.num_hbm * page_size,
            dram_tokens=self.num_dram * page_size,
            nvme_tokens=self.num_nvme * page_size,
        )

    def to_match(self, page_size: int) -> WorkerMatch:
        return WorkerMatch(self.worker, self.matched_tokens(page_size))


class PrefixLookup(NamedTuple):
    """The directory's answer for a query of ``num_query_pages`` pages, in pages; as the wire's
    ``LookupResult`` (tokens) through ``to_result``."""

    num_query_pages: int
    matches: tuple[HeldPrefix, ...]  # live workers holding depth 1, longest first, then by name
    epoch: int

    def to_result(self, namespace_digest: NamespaceDigest, page_size: int) -> LookupResult:
        return LookupResult(namespace_digest, self.num_query_pages, tuple(m.to_match(page_size) for m in self.matches))

    @property
    def matched_depth(self) -> int:
        """Longest prefix one live worker holds (pages); 0 on a miss."""
        return self.matches[0].num_pages if self.matches else 0

    def holders_at(self, depth: int) -> tuple[Holder, ...]:
        return tuple(Holder(m.worker, m.tier_at(depth)) for m in self.matches if m.num_pages >= depth)

    @property
    def holders(self) -> tuple[Holder, ...]:
        """Holders of the deepest matched page."""
        return self.holders_at(self.matched_depth) if self.matches else ()

    @property
    def holders_per_depth(self) -> tuple[tuple[Holder, ...], ...]:
        return tuple(self.holders_at(d) for d in range(1, self.matched_depth + 1))


@dataclass(frozen=True, slots=True)
class RegisterResult:
    """``Directory.register_worker``'s answer (the worker's ``Registration`` record is what it registered)."""

    outcome: Outcome
    worker: WorkerId
    replaced_previous: bool = False  # an older incarnation existed and was retired


@dataclass(frozen=True, slots=True)
class PurgeResult:
    outcome: Outcome
    num_removed: int = 0  # (page, holder) entries deleted
    retired: tuple[WorkerId, ...] = ()  # incarnations retired by this call
    is_done: bool = True  # False: the budget ran out, call again


@dataclass(frozen=True, slots=True)
class EpochBump:
    """``Directory.invalidate``'s answer: one namespace's new epoch (Admin's ``InvalidateResult``
    counts the workers told of a whole scope)."""

    outcome: Outcome
    epoch: int = 0  # the namespace's new epoch


@dataclass(frozen=True, slots=True)
class ReclaimResult:
    outcome: Outcome
    num_deleted: int = 0
    num_pending_namespaces: int = 0


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    epoch: int
    num_pages: int  # distinct pages with at least one holder
    num_entries: int  # (page, holder) pairs
    entries_by_tier: dict[Tier, int]  # pairs with a copy in that tier (a pair may count in several)
    entries_by_worker: dict[WorkerId, int]
    num_orphans: int  # held pages whose parent the same worker dropped (unroutable, see lookup)
    num_inversions: int  # parent/child pairs of one worker where the child is in a faster tier
    num_pending_epochs: int  # invalidated epochs not yet reclaimed
    fence: int
    rejected: dict[str, int]  # reason -> events, since the namespace was created
    num_duplicate_batches: int
    num_regressed_batches: int

    @property
    def is_ordered(self) -> bool:
        """Lookups take the bisection fast path (no orphans, no inversions)."""
        return self.num_orphans == 0 and self.num_inversions == 0
