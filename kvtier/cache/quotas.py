"""Per-tenant page quotas per tier (DESIGN §8; docs/decisions/0009-quotas-and-ttls.md).

Configuration (``WorkerConfig.tenant_quotas``): tenant → tier → limit, ``"*"`` for every
tenant not listed; a tier a tenant's entry does not name falls back to ``"*"``, and a tier
neither names is unlimited. A number is pages, a size with a unit is bytes::

    tenant_quotas = {acme: {hbm: 256, dram: 4GiB}, "*": {hbm: 64, dram: 1GiB, nvme: 8GiB}}

Accounting: ``QuotaTracker`` counts the pages the radix index caches per (tenant, tier),
O(1) per insert, move and remove (it listens to the index). A tenant is its namespace's
``tenant`` field: the digest → identity map is the engine's. Pages whose namespace the
engine has not seen yet (restored from NVMe before the first request) count under no
tenant and no quota until it has.

Victims: the index tells the tracker every time a page *becomes* evictable (a leaf of its
tier, unpinned, idle); the tracker keeps those in one candidate heap per (namespace, tier),
in the eviction policy's order, invalidated lazily with the node's ``version`` exactly as
the index's own per-tier heaps are. So a tenant's least valuable idle leaf in a tier is
one heap pop away, whoever else fills the tier.

Enforcement (``enforce``, bounded work per call, run by the engine before each step and
by the worker's idle loop): while a tenant holds more than its limit in a tier, its own
least valuable evictable page there is demoted to the next tier, into a free page (never
one made by evicting someone else's); when the tenant is at its limit there too, its own
least valuable page of that tier goes down first (the cascade: DRAM to NVMe, then out).
With no way down the page is dropped with what hangs below it (the tenant's own pages too). Pages in use by running
sequences, pinned pages and pages being copied are never taken; when only those are left
the tenant stays over and the overage is counted (``QuotaCounters.num_stuck``).

Allocation (``free_own_page``, asked by the scheduler before the normal eviction order): a
tenant that needs a page while the pool is full, and would pass its HBM limit once its
sequence caches what it is computing, gives up its own idle HBM pages first. When all of its pages are in use the
page comes from the normal eviction order (a running sequence must always be able to
grow; refusing it would livelock a tenant whose one sequence is larger than its quota),
and that is counted (``QuotaCounters.num_foreign_evictions``).

Reservations (``is_reserved``, docs/decisions/0009-quotas-and-ttls.md): a tenant's HBM pages
are reserved while it holds no more of them than its HBM limit. A victim search of the index
(the eviction order, spills, watermark and room-making demotions) passes over reserved pages
when it is made on behalf of a tenant over its HBM limit (``acting_for``: the scheduler's
allocations, the worker's room-making for a waiting request, counting the pages the request
will cache) or on nobody's behalf (background watermark demotion); a tenant's own pages are
never reserved against itself, and a tenant within its limit searches as if there were no
reservations. So however many sequences of an over-quota tenant run at once, they take free
pages, their own, and pages of tenants over their limit or without one; when none is left
they wait (admission) or are preempted, as for a full pool. Explicit moves (a drain, commands,
TTLs, the tenant's own enforcement) are not victim searches and do not look at reservations.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.domain.errors import ConfigError, IntegrityError, InvalidArgument
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity
from kvtier.domain.sizes import parse_size
from kvtier.domain.tiers import TIER_LABELS, Tier

if TYPE_CHECKING:
    from kvtier.cache.radix import RadixIndex, RadixNode


class PageMover(Protocol):
    """What quota enforcement needs of the tier manager (``kvtier.tiers.manager.TierManager``):
    the configured tiers, and a move of one page into a free page of a lower tier."""

    @property
    def tiers(self) -> Sequence[Tier]: ...

    def move_to_free(self, node: RadixNode, dst: Tier) -> bool: ...

log = logging.getLogger("kvtier.cache.quotas")

DEFAULT_TENANT = "*"
FIELD = "tenant_quotas"

Tenant = str | None  # None: the namespace's identity is not known (yet)
_NOBODY = object()  # ``QuotaTracker.acting_for`` no tenant
_Entry = tuple[float, int, int, "RadixNode"]  # (priority, push order, node version, node)


@dataclass(frozen=True, slots=True)
class TierLimit:
    """A limit in pages, or in bytes (whole pages of the engine's page size)."""

    amount: int
    is_bytes: bool = False

    def pages(self, page_bytes: int) -> int:
        return self.amount // page_bytes if self.is_bytes else self.amount


@dataclass(frozen=True, slots=True)
class TenantQuota:
    tenant: str  # DEFAULT_TENANT for every tenant not listed
    limits: tuple[tuple[Tier, TierLimit], ...] = ()

    def limit(self, tier: Tier) -> TierLimit | None:
        return next((limit for t, limit in self.limits if t is tier), None)


@dataclass(frozen=True, slots=True)
class QuotaTable:
    """The configured quotas (immutable: it is a ``WorkerConfig`` field)."""

    quotas: tuple[TenantQuota, ...] = ()

    def __bool__(self) -> bool:
        return any(q.limits for q in self.quotas)

    @classmethod
    def from_setting(cls, value: Any, field: str = FIELD) -> QuotaTable:
        """Parse ``{tenant: {tier: pages | "size"}}``; errors name the offending entry."""
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{field} must map tenants to per-tier limits, e.g. {{acme: {{hbm: 64, dram: 1GiB}}}}; "
                f"got {type(value).__name__}",
                field=field,
            )
        quotas = []
        for tenant, tiers in value.items():
            where = f"{field}.{tenant}"
            if not isinstance(tenant, str):
                raise ConfigError(f"{field}: tenant names are strings, got {tenant!r}", field=field)
            if not isinstance(tiers, Mapping):
                raise ConfigError(
                    f"{where} must map tiers ({', '.join(TIER_LABELS)}) to limits, got {tiers!r}", field=where
                )
            limits: dict[Tier, TierLimit] = {}
            for label, raw in tiers.items():
                try:
                    tier = Tier.parse(str(label), field=where)
                except InvalidArgument as exc:
                    raise ConfigError(exc.message, field=where) from None
                if tier in limits:
                    raise ConfigError(f"{where} names tier {tier.label} twice", field=where)
                limits[tier] = _parse_limit(raw, f"{where}.{tier.label}")
            quotas.append(TenantQuota(tenant, tuple(sorted(limits.items()))))
        return cls(tuple(quotas))

    def limit(self, tenant: str, tier: Tier) -> TierLimit | None:
        """The tenant's limit in ``tier`` (its own entry, else ``"*"``), or None: unlimited."""
        default = None
        for quota in self.quotas:
            if quota.tenant == tenant and (limit := quota.limit(tier)) is not None:
                return limit
            if quota.tenant == DEFAULT_TENANT:
                default = quota.limit(tier)
        return default


def _parse_limit(raw: Any, where: str) -> TierLimit:
    expected = "a page count >= 0 or a size with a unit such as 1GiB"
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 0:
            raise ConfigError(f"{where} must be {expected}, got {raw}", field=where)
        return TierLimit(raw)
    if isinstance(raw, str) and raw.strip() and not raw.strip().isdigit():
        try:
            num_bytes = parse_size(raw)
        except ValueError:
            num_bytes = -1
        if num_bytes >= 0:
            return TierLimit(num_bytes, is_bytes=True)
    raise ConfigError(f"{where} must be {expected}, got {raw!r}", field=where)


@dataclass(slots=True)
class QuotaCounters:
    """Totals for telemetry and tests."""

    pages_demoted: int = 0  # moved one tier down to bring a tenant under its limit
    pages_dropped: int = 0  # dropped for the same reason (subtrees included)
    num_stuck: int = 0  # enforcement left a tenant over its limit: only held/pinned pages were left
    num_own_evictions: int = 0  # a full pool took an over-quota tenant's own page for its allocation
    num_foreign_evictions: int = 0  # ... and had to take another tenant's page instead (all its own in use)


class QuotaTracker:
    """Counts cached pages per (tenant, tier) of one engine and enforces the quotas.

    Engine thread only, like the index it listens to.
    """

    def __init__(
        self,
        index: RadixIndex,
        table: QuotaTable,
        *,
        page_bytes: int,
        identity_of: Callable[[NamespaceDigest], NamespaceIdentity | None],
        tiers: PageMover | None = None,
    ) -> None:
        self.index = index
        self.table = table
        self.page_bytes = page_bytes
        self.tiers = tiers
        self.counters = QuotaCounters()
        self._identity_of = identity_of
        self._tenant_of: dict[NamespaceDigest | None, Tenant] = {}
        self._digests_of: dict[Tenant, set[NamespaceDigest | None]] = {}
        self._counts: dict[tuple[Tenant, Tier], int] = {}
        self._digest_counts: dict[tuple[NamespaceDigest | None, Tier], int] = {}
        self._limits: dict[tuple[str, Tier], int | None] = {}
        self._heaps: dict[tuple[NamespaceDigest | None, Tier], list[_Entry]] = {}
        self._order = itertools.count()
        self._due: set[tuple[str, Tier]] = set()  # over their limit with something to take, maybe
        self._enforcing = False
        # Whose behalf victim searches are on, and whether it is over its HBM limit (acting_for).
        self._acting: Tenant | object = _NOBODY
        self._is_acting_over = True
        for node in index.nodes():
            self._on_insert(node)
            if index.is_evictable(node):
                self._on_evictable(node, index.policy.priority(node))
        index.on_insert.append(self._on_insert)
        index.on_remove.append(self._on_remove)
        index.on_move.append(self._on_move)
        index.on_evictable = self._on_evictable
        index.is_reserved = self.is_reserved

    # ---- queries --------------------------------------------------------------------
    def limit(self, tenant: Tenant, tier: Tier) -> int | None:
        """Pages ``tenant`` may keep cached in ``tier``; None: no limit."""
        if tenant is None:
            return None
        key = (tenant, tier)
        if key not in self._limits:
            limit = self.table.limit(tenant, tier)
            self._limits[key] = None if limit is None else limit.pages(self.page_bytes)
        return self._limits[key]

    def num_pages(self, tenant: Tenant, tier: Tier) -> int:
        """Pages of ``tenant`` the index caches in ``tier``."""
        return self._counts.get((tenant, tier), 0)

    def overage(self) -> dict[tuple[str, Tier], int]:
        """Pages above the limit now, per (tenant, tier) that is over (held pages, mostly)."""
        over = {}
        for (tenant, tier), count in self._counts.items():
            limit = self.limit(tenant, tier)
            if tenant is not None and limit is not None and count > limit:
                over[(tenant, tier)] = count - limit
        return over

    def has_work(self) -> bool:
        return bool(self._due)

    def is_reserved(self, node: RadixNode) -> bool:
        """``node`` is an HBM page of a tenant within its HBM limit, and the victim search asking
        is on behalf of another tenant over its own limit, or of nobody (module doc, Reservations)."""
        if node.tier is not Tier.HBM or not self._is_acting_over:
            return False
        tenant = self.tenant_of(node.namespace)
        if tenant is None or tenant == self._acting:
            return False
        limit = self.limit(tenant, Tier.HBM)
        return limit is not None and self.num_pages(tenant, Tier.HBM) <= limit

    @contextlib.contextmanager
    def acting_for(self, digest: NamespaceDigest, num_pending: int = 0) -> Iterator[None]:
        """Victim searches inside are on behalf of ``digest``'s tenant, which will cache
        ``num_pending`` new HBM pages: reservations hold against it only when that puts it over
        its HBM limit, and never for its own pages."""
        saved = self._acting, self._is_acting_over
        tenant = self._acting = self.tenant_of(digest)
        limit = self.limit(tenant, Tier.HBM)
        self._is_acting_over = limit is not None and self.num_pages(tenant, Tier.HBM) + num_pending > limit
        try:
            yield
        finally:
            self._acting, self._is_acting_over = saved

    def tenant_of(self, digest: NamespaceDigest | None) -> Tenant:
        tenant = self._tenant_of.get(digest, ...)
        if tenant is ...:
            identity = self._identity_of(digest) if digest is not None else None
            tenant = None if identity is None else identity.tenant
            if tenant is not None or digest is None:
                self._tenant_of[digest] = tenant
            self._digests_of.setdefault(tenant, set()).add(digest)
        return tenant

    def forget(self, digest: NamespaceDigest) -> None:
        """Drop what is kept for ``digest``, a namespace the engine forgot (invalidated, its
        pages gone): its tenant mapping and its empty counts and heaps."""
        tenant = self._tenant_of.pop(digest, None)
        digests = self._digests_of.get(tenant)
        if digests is not None:
            digests.discard(digest)
            if not digests:
                del self._digests_of[tenant]
        for tier in Tier:
            if not self._digest_counts.get((digest, tier)):
                self._digest_counts.pop((digest, tier), None)
                self._heaps.pop((digest, tier), None)

    # ---- index listeners ------------------------------------------------------------
    def learn(self, digest: NamespaceDigest) -> None:
        """The engine learnt ``digest``'s identity: pages counted under no tenant move to it."""
        if digest in self._tenant_of:
            return
        unknown = self._digests_of.get(None, set())
        had_pages = digest in unknown
        unknown.discard(digest)
        tenant = self.tenant_of(digest)
        if not had_pages or tenant is None:
            return
        for tier in Tier:
            moved = self._digest_counts.get((digest, tier), 0)
            if moved:
                self._add(None, tier, -moved)
                self._add(tenant, tier, moved)

    def _on_insert(self, node: RadixNode) -> None:
        self._count(node.namespace, node.tier, 1)

    def _on_remove(self, node: RadixNode) -> None:
        self._count(node.namespace, node.tier, -1)

    def _on_move(self, node: RadixNode, from_tier: Tier) -> None:
        self._count(node.namespace, from_tier, -1)
        self._count(node.namespace, node.tier, 1)

    def _count(self, digest: NamespaceDigest | None, tier: Tier, delta: int) -> None:
        key = (digest, tier)
        self._digest_counts[key] = self._digest_counts.get(key, 0) + delta
        self._add(self.tenant_of(digest), tier, delta)

    def _add(self, tenant: Tenant, tier: Tier, delta: int) -> None:
        count = self._counts[(tenant, tier)] = self._counts.get((tenant, tier), 0) + delta
        if delta > 0 and tenant is not None and not self._enforcing:
            limit = self.limit(tenant, tier)
            if limit is not None and count > limit:
                self._due.add((tenant, tier))

    def _on_evictable(self, node: RadixNode, priority: float) -> None:
        key = (node.namespace, node.tier)
        heap = self._heaps.setdefault(key, [])
        heapq.heappush(heap, (priority, next(self._order), node.version, node))
        if len(heap) > 2 * self._digest_counts.get(key, 0) + 64:
            # Stale entries pile up while a tenant is never over quota: keep the heap
            # within twice its live pages (amortised O(1) per push).
            heap[:] = [e for e in heap if self._is_candidate(e, node.tier)]
            heapq.heapify(heap)
        if not self._enforcing:
            tenant = self.tenant_of(node.namespace)
            limit = self.limit(tenant, node.tier)
            if tenant is not None and limit is not None and self.num_pages(tenant, node.tier) > limit:
                self._due.add((tenant, node.tier))

    # ---- victims ----------------------------------------------------------------------
    def _is_candidate(self, entry: _Entry, tier: Tier) -> bool:
        _, _, version, node = entry
        return (
            version == node.version
            and node.tier is tier
            and self.index.get(node.key) is node
            and self.index.is_evictable(node)
        )

    def _pop_own(self, tenant: Tenant, tier: Tier) -> RadixNode | None:
        """The tenant's least valuable evictable page in ``tier`` (taken off every heap)."""
        best: list[_Entry] | None = None
        for digest in self._digests_of.get(tenant, ()):
            heap = self._heaps.get((digest, tier))
            while heap and not self._is_candidate(heap[0], tier):
                heapq.heappop(heap)
            if heap and (best is None or heap[0] < best[0]):
                best = heap
        if best is None:
            return None
        node = heapq.heappop(best)[3]
        # Stales the index's heap entry too. The policy's aging clock is left alone: a quota
        # victim is chosen by its tenant's cap, not by its value against everyone else's.
        node.version += 1
        return node

    def free_own_page(self, digest: NamespaceDigest, num_pending: int = 0) -> bool:
        """For an allocation on behalf of ``digest`` with the pool full: when its tenant would
        pass its HBM limit once the allocating sequence caches its ``num_pending`` new pages,
        free one of its own idle HBM pages the way enforcement would (down a tier into a free
        page, or dropped) and return True; False: take the normal eviction order. Enforcement
        would take that page right after anyway; taking someone else's instead costs them for
        nothing."""
        tenant = self.tenant_of(digest)
        limit = self.limit(tenant, Tier.HBM)
        if tenant is None or limit is None or self.num_pages(tenant, Tier.HBM) + num_pending <= limit:
            return False
        kept: list[RadixNode] = []
        enforcing, self._enforcing = self._enforcing, True
        try:
            while (node := self._pop_own(tenant, Tier.HBM)) is not None:
                if self._demote(tenant, node):
                    self.counters.pages_demoted += 1
                elif self.index.holds_pin(node):
                    kept.append(node)
                    continue
                else:
                    self.counters.pages_dropped += self.index.drop_subtree(node)
                self.counters.num_own_evictions += 1
                return True
            self.counters.num_foreign_evictions += 1
            return False
        finally:
            for node in kept:
                self.index.requeue(node)
            self._enforcing = enforcing

    # ---- enforcement --------------------------------------------------------------------
    def enforce(self, max_pages: int = 64) -> int:
        """Bring tenants over a limit back under it, taking only their own pages (fastest
        tier first, so demotions that overfill a lower tier are handled in the same pass).
        At most ``max_pages`` pages per call; returns how many were demoted or dropped."""
        done = 0
        self._enforcing = True
        try:
            while self._due and done < max_pages:
                tenant, tier = min(self._due, key=lambda d: (d[1], d[0]))
                finished, num = self._enforce_one(tenant, tier, max_pages - done)
                done += num
                if finished:
                    self._due.discard((tenant, tier))
        finally:
            self._enforcing = False
        return done

    def _enforce_one(self, tenant: str, tier: Tier, budget: int) -> tuple[bool, int]:
        """(no more work here for now, pages handled)."""
        limit = self.limit(tenant, tier)
        kept: list[RadixNode] = []
        done = 0
        try:
            while limit is not None and self.num_pages(tenant, tier) > limit:
                if done >= budget:
                    return False, done
                node = self._pop_own(tenant, tier)
                if node is None:
                    self.counters.num_stuck += 1
                    log.debug("tenant over its %s quota by %d held pages", tier.label,
                              self.num_pages(tenant, tier) - limit)
                    return True, done
                if self._demote(tenant, node):
                    self.counters.pages_demoted += 1
                elif self.index.holds_pin(node):
                    kept.append(node)  # a pinned page below it would go along with it
                    continue
                else:
                    self.counters.pages_dropped += self.index.drop_subtree(node)
                done += 1
            return True, done
        finally:
            for node in kept:
                self.index.requeue(node)

    def _demote(self, tenant: str, node: RadixNode) -> bool:
        """Move ``node`` one tier down (the next configured one, else the one after): into a
        free page there, after moving one of the tenant's own pages there further down (or
        dropping it) when the tenant is at its limit in that tier. Nobody else's page moves."""
        if self.tiers is None:
            return False
        for dst in self.tiers.tiers:
            if dst <= node.tier:
                continue
            limit = self.limit(tenant, dst)
            if limit is not None and self.num_pages(tenant, dst) >= limit and not self._shed_one(tenant, dst):
                continue
            if self.tiers.move_to_free(node, dst):
                return True
        return False

    def _shed_one(self, tenant: str, tier: Tier) -> bool:
        """Free one of the tenant's places in ``tier``: its least valuable page there goes one
        tier further down, or is dropped (the cascade of a quota in DRAM to NVMe, then out)."""
        victim = self._pop_own(tenant, tier)
        if victim is None:
            return False
        if self._demote(tenant, victim):
            self.counters.pages_demoted += 1
            return True
        dropped = self.index.drop_or_requeue(victim)
        self.counters.pages_dropped += dropped
        return dropped > 0

    def check_integrity(self) -> None:
        """The counters equal a recount of the index."""
        counts: dict[tuple[Tenant, Tier], int] = {}
        for node in self.index.nodes():
            key = (self.tenant_of(node.namespace), node.tier)
            counts[key] = counts.get(key, 0) + 1
        live = {k: v for k, v in self._counts.items() if v}
        if counts != live:
            raise IntegrityError(f"quota counts per (tenant, tier) drifted: counted {live}, index has {counts}")
