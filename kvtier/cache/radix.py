"""Local prefix index: page key → cached page in some tier, as a tree (DESIGN §5.2–5.7).

Page keys are chained hashes, so a key names a page *and its whole prefix*; the tree
records parent links so that eviction takes leaves before their parents (a cached
prefix is never orphaned). A node's page belongs to the index ("cached" in its pool);
sequences that hit an HBM node take references on that page.

Tiers along a chain never get faster going down: a child lives in its parent's tier or
a slower one. So every tier's eviction takes *its own* leaves (nodes with no child in
the same or a faster tier), and a match is an HBM prefix followed by slower pages.

    root ─ a(HBM) ─ b(HBM) ─ c(DRAM) ─ d(NVMe)
                  └ e(HBM)
    may leave their tier: b and e (HBM), c (DRAM), d (NVMe); a only after b and e did.

Evictable in tier t = node in t, no child in t or faster, not pinned, not moving, and
(HBM only) page ref count 0. Candidates sit in one heap per tier keyed by the eviction
policy's priority, pushed when a node *becomes* evictable and checked again when popped
(lazy invalidation), so eviction costs O(log n) per page, not a scan.

Pins keep a page in its tier. A pin with a time to live lapses on its own: the engine's
step calls ``expire_pins``, which releases every timed pin whose deadline passed on the
index's clock (injectable, so tests control time).

Quotas and TTLs (``kvtier.cache.quotas``, ``kvtier.cache.ttls``) listen here: ``on_evictable``
hears of every page that becomes a candidate (for per-tenant candidate heaps), and
``last_used_s`` (the clock at a node's last use) is what a namespace TTL counts from. The index
asks nobody for decisions: ``evict`` drops in policy order, and whoever owns more (the tier
manager's spill, a quota tracker's own-page rule) pops victims itself (``pop_victims``) and
hands back the ones it keeps (``requeue``).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.cache.page_pool import PageId, PagePool
from kvtier.domain.errors import IntegrityError
from kvtier.domain.hashing import NamespaceDigest, PageKey, short
from kvtier.domain.tiers import Tier


@dataclass(slots=True, eq=False)
class RadixNode:
    key: PageKey
    parent: RadixNode | None
    page: PageId
    tokens: tuple[int, ...]
    depth: int  # 1 for the first page of a sequence
    namespace: NamespaceDigest | None = None
    tier: Tier = Tier.HBM  # ``page`` is a page id in this tier's pool (a slot id for NVMe)
    last_access: int = 0
    last_used_s: float = 0.0  # the index clock at the last hit, insertion, or release by a sequence (TTLs)
    hits: int = 0  # matches that reached this page (a frequency for value-based eviction)
    access_clock: float = 0.0  # the eviction policy's clock at the last access (set by the policy)
    pins: int = 0
    version: int = 0  # bumped on every heap push; older heap entries are stale
    moving: bool = False  # a transfer is copying this page to another tier
    # An ended session's page (``mark_expendable``): while idle it goes before every other idle
    # page of its tier, whatever the policy; a hit makes it an ordinary page again.
    is_expendable: bool = False
    checksum: int | None = None  # taken when the page left HBM
    children: dict[PageKey, RadixNode] = field(default_factory=dict)
    child_tiers: list[int] = field(default_factory=lambda: [0, 0, 0])  # children per tier

    @property
    def num_children(self) -> int:
        return len(self.children)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def is_leaf_in(self, tier: Tier) -> bool:
        """No child in ``tier`` or a faster one (so this node may leave ``tier``)."""
        return sum(self.child_tiers[:tier]) == 0


class EvictionPolicy(Protocol):
    """Lower priority is evicted first. ``priority`` is called when a node becomes
    evictable; ``on_access`` when a match or an insert touches it; ``on_evict`` when the
    index hands it out as a victim, with the priority it was queued under (aging
    policies keep their clock with these two)."""

    name: str

    def priority(self, node: RadixNode) -> float: ...

    def on_access(self, node: RadixNode) -> None: ...

    def on_evict(self, node: RadixNode, priority: float) -> None: ...


class LRUPolicy:
    name = "lru"

    def priority(self, node: RadixNode) -> float:
        return float(node.last_access)

    def on_access(self, node: RadixNode) -> None:
        pass

    def on_evict(self, node: RadixNode, priority: float) -> None:
        pass


@dataclass(slots=True)
class MatchResult:
    """The longest cached prefix of a key chain. ``pages[i]`` holds page i of the prefix."""

    nodes: list[RadixNode] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return len(self.nodes)

    @property
    def pages(self) -> list[PageId]:
        return [n.page for n in self.nodes]


class RadixIndex:
    def __init__(
        self,
        pool: PagePool,
        policy: EvictionPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.policy: EvictionPolicy = policy or LRUPolicy()
        self.clock = clock  # seconds, for pin deadlines
        self._timed_pins: list[tuple[float, int, RadixNode]] = []  # (deadline, order, node), a heap
        self._nodes: dict[PageKey, RadixNode] = {}
        self._by_page: dict[PageId, RadixNode] = {}  # HBM nodes only
        self._heaps: dict[Tier, list[tuple[float, int, int, RadixNode]]] = {t: [] for t in Tier}
        self._tick = itertools.count(1)
        self._push_order = itertools.count()
        # Observers of index membership (page events for the directory, metrics).
        self.on_insert: list[Callable[[RadixNode], None]] = []
        self.on_remove: list[Callable[[RadixNode], None]] = []
        self.on_move: list[Callable[[RadixNode, Tier], None]] = []
        # Told when a node's pins, or whether a sequence holds its HBM page, change.
        self.on_hold: list[Callable[[RadixNode], None]] = []
        # Set by the tier manager, which owns the DRAM pages and NVMe slots: frees the one a
        # node leaves (the node moves up or away, or is removed). Returns nothing: no decision.
        self.release_lower: Callable[[RadixNode], None] | None = None
        # Set by a quota tracker: told of each node that becomes evictable, with its priority.
        self.on_evictable: Callable[[RadixNode, float], None] | None = None
        # Pages a victim search passes over (a quota's reservation: ``QuotaTracker.is_reserved``);
        # ``all_evictable`` lifts it for moves that must take every page (a drain).
        self.is_reserved: Callable[[RadixNode], bool] | None = None
        self._is_reservation_lifted = False
        pool.on_idle = self._page_became_idle
        pool.on_held = self._page_became_held

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: PageKey) -> bool:
        return key in self._nodes

    def get(self, key: PageKey) -> RadixNode | None:
        return self._nodes.get(key)

    def nodes(self) -> list[RadixNode]:
        return list(self._nodes.values())

    # ---- lookup -------------------------------------------------------------------
    def match(
        self, keys: Sequence[PageKey], tokens: Sequence[int] | None = None, *, count_hit: bool = True
    ) -> MatchResult:
        """Longest prefix of ``keys`` present in the index, touching each hit.

        When ``tokens`` are given, a hit also compares the page's tokens, so a hash
        collision can never serve another prefix's KV. ``count_hit=False`` looks without
        counting a use (a request still waiting for room is not yet a reuse).
        """
        result = MatchResult()
        page_size = self.pool.page_size
        now = next(self._tick)
        now_s = self.clock() if count_hit else 0.0
        for i, key in enumerate(keys):
            node = self._nodes.get(key)
            if node is None:
                break
            if tokens is not None and node.tokens != tuple(tokens[i * page_size : (i + 1) * page_size]):
                break
            if count_hit:
                self._count_use(node, now, now_s)
            result.nodes.append(node)
        return result

    # ---- membership ---------------------------------------------------------------
    def insert(
        self,
        key: PageKey,
        parent_key: PageKey | None,
        page: PageId,
        tokens: Sequence[int],
        namespace: NamespaceDigest | None = None,
        *,
        tier: Tier = Tier.HBM,
        checksum: int | None = None,
    ) -> RadixNode | None:
        """Cache ``page`` under ``key``. The caller holds a reference on ``page``.

        Returns None when the key is already cached (the caller's page stays private)
        or when the parent is not cached (the index is prefix-closed). A node in a lower
        tier (restored after a restart) is inserted with ``tier`` and its ``checksum``;
        its location then belongs to the index.
        """
        if key in self._nodes:
            return None
        parent = None
        if parent_key is not None:
            parent = self._nodes.get(parent_key)
            if parent is None or tier < parent.tier:
                return None
        if len(tokens) != self.pool.page_size:
            raise ValueError(f"a cached page holds exactly {self.pool.page_size} tokens, got {len(tokens)}")
        node = RadixNode(
            key=key,
            parent=parent,
            page=page,
            tokens=tuple(tokens),
            depth=1 if parent is None else parent.depth + 1,
            namespace=namespace,
            tier=tier,
            checksum=checksum,
            last_access=next(self._tick),
            last_used_s=self.clock(),
        )
        self._nodes[key] = node
        self.policy.on_access(node)
        if tier is Tier.HBM:
            self.pool.mark_cached(page)
            self._by_page[page] = node
        if parent is not None:
            parent.children[key] = node
            parent.child_tiers[tier - 1] += 1
        self._push_if_evictable(node)
        for listener in self.on_insert:
            listener(node)
        return node

    def remove(self, key: PageKey) -> None:
        """Remove a leaf. Removing a node that still has children is a broken contract."""
        node = self._nodes.get(key)
        if node is None:
            raise KeyError(f"page {short(key)} is not cached")
        if not node.is_leaf:
            raise IntegrityError(f"page {short(key)} has {node.num_children} cached children")
        self._detach(node)

    def drop_subtree(self, node: RadixNode) -> int:
        """Remove a node and everything below it (children first); returns how many went."""
        count = 0
        for child in list(node.children.values()):
            count += self.drop_subtree(child)
        self._detach(node)
        return count + 1

    def _detach(self, node: RadixNode) -> None:
        del self._nodes[node.key]
        self._leave_location(node)
        parent = node.parent
        if parent is not None:
            del parent.children[node.key]
            parent.child_tiers[node.tier - 1] -= 1
            self._push_if_evictable(parent)
        for listener in self.on_remove:
            listener(node)

    def _leave_location(self, node: RadixNode) -> None:
        if node.tier is Tier.HBM:
            del self._by_page[node.page]
            self.pool.unmark_cached(node.page)
        elif self.release_lower is not None:
            self.release_lower(node)

    def move(self, node: RadixNode, tier: Tier, page: int, checksum: int | None = None) -> None:
        """Point a node at a copy of its page in another tier (the copy is complete).

        Leaving HBM frees the old page unless a sequence holds it; entering HBM caches
        the new page (the caller holds a reference on it, as for ``insert``).
        """
        if self._nodes.get(node.key) is not node:
            raise IntegrityError(f"move of page {short(node.key)} that is not cached")
        parent = node.parent
        if parent is not None and tier < parent.tier:
            raise IntegrityError(f"page {short(node.key)} cannot move above its parent's tier")
        if any(tier > c.tier for c in node.children.values()):
            raise IntegrityError(f"page {short(node.key)} cannot move below a child's tier")
        old = node.tier
        self._leave_location(node)
        node.tier, node.page, node.checksum = tier, PageId(page), checksum
        if tier is Tier.HBM:
            self.pool.mark_cached(PageId(page))
            self._by_page[PageId(page)] = node
            for _ in range(node.pins):  # a page pinned in a lower tier stays pinned in HBM
                self.pool.pin(PageId(page))
        if parent is not None:
            parent.child_tiers[old - 1] -= 1
            parent.child_tiers[tier - 1] += 1
            self._push_if_evictable(parent)
        self._push_if_evictable(node)
        for listener in self.on_move:
            listener(node, old)

    # ---- pins ---------------------------------------------------------------------
    def pin(self, key: PageKey, ttl_s: float | None = None) -> None:
        """Keep a page and (implicitly, since leaves go first) its ancestors in their tier.

        Without ``ttl_s`` the caller releases the pin with ``unpin``, exactly once. With
        ``ttl_s`` the pin belongs to the index: ``expire_pins`` releases it once ``ttl_s``
        seconds of ``clock`` have passed, and the caller never unpins it.
        """
        node = self._nodes.get(key)
        if node is None:
            raise KeyError(f"page {short(key)} is not cached")
        if ttl_s is not None:
            if not ttl_s >= 0:
                raise ValueError(f"ttl_s must be >= 0 seconds, got {ttl_s}")
            heapq.heappush(self._timed_pins, (self.clock() + ttl_s, next(self._push_order), node))
        node.pins += 1
        if node.tier is Tier.HBM:
            self.pool.pin(node.page)
        for listener in self.on_hold:
            listener(node)

    def unpin(self, key: PageKey) -> None:
        node = self._nodes[key]
        if node.pins <= 0:
            raise IntegrityError(f"page {short(key)} is not pinned")
        node.pins -= 1
        if node.tier is Tier.HBM:
            self.pool.unpin(node.page)
        self._push_if_evictable(node)
        for listener in self.on_hold:
            listener(node)

    def expire_pins(self, now: float | None = None) -> int:
        """Release every timed pin whose deadline is at or before ``now`` (default: the
        clock); returns how many. A pinned page that left the index meanwhile is skipped."""
        now = self.clock() if now is None else now
        released = 0
        while self._timed_pins and self._timed_pins[0][0] <= now:
            _, _, node = heapq.heappop(self._timed_pins)
            if self._nodes.get(node.key) is node:
                self.unpin(node.key)
                released += 1
        return released

    # ---- eviction -----------------------------------------------------------------
    def touch(self, nodes: Sequence[RadixNode]) -> None:
        """Count one use of each node (what ``match`` does unless ``count_hit=False``)."""
        now = next(self._tick)
        now_s = self.clock()
        for node in nodes:
            self._count_use(node, now, now_s)

    def _count_use(self, node: RadixNode, now: int, now_s: float) -> None:
        node.last_access = now
        node.last_used_s = now_s
        node.hits += 1
        self.policy.on_access(node)
        if node.is_expendable:  # asked for again: an ordinary page, queued by the policy
            node.is_expendable = False
            node.version += 1  # its first-to-go heap entry is stale
            self._push_if_evictable(node)

    def note_released(self, pages: Sequence[PageId]) -> None:
        """A sequence is letting go of ``pages``: the cached ones were in use until now, so
        their idle time (what a namespace TTL counts) starts now."""
        now_s = self.clock()
        for page in pages:
            node = self._by_page.get(page)
            if node is not None:
                node.last_used_s = now_s

    def is_evictable(self, node: RadixNode) -> bool:
        """May leave its tier now: a leaf of that tier, unpinned, not moving, unheld."""
        if node.pins or node.moving or not node.is_leaf_in(node.tier):
            return False
        return node.tier is not Tier.HBM or self.pool.ref_count(node.page) == 0

    def _page_became_idle(self, page: PageId) -> None:
        node = self._by_page.get(page)
        if node is not None:
            self._push_if_evictable(node)
            for listener in self.on_hold:
                listener(node)

    def _page_became_held(self, page: PageId) -> None:
        if not self.on_hold:  # no listener (no tier manager): nothing to look up
            return
        node = self._by_page.get(page)
        if node is not None:
            for listener in self.on_hold:
                listener(node)

    def _push_if_evictable(self, node: RadixNode) -> None:
        if self._nodes.get(node.key) is node and self.is_evictable(node):
            node.version += 1
            priority = -math.inf if node.is_expendable else self.policy.priority(node)
            heap = self._heaps[node.tier]
            heapq.heappush(heap, (priority, next(self._push_order), node.version, node))
            if len(heap) > 2 * len(self._nodes) + 64:
                # A page hit and released again and again pushes a new entry each time and
                # stales the last; while nothing is evicted none is popped, so without this the
                # heap grows without bound. Keep it within twice the live nodes (amortised O(1)
                # per push).
                heap[:] = [e for e in heap if self._is_live_entry(e, node.tier)]
                heapq.heapify(heap)
            if self.on_evictable is not None:
                self.on_evictable(node, priority)

    def _is_live_entry(self, entry: tuple[float, int, int, RadixNode], tier: Tier) -> bool:
        _, _, version, node = entry
        return version == node.version and node.tier is tier and self._nodes.get(node.key) is node

    def pop_victims(self, tier: Tier, num_pages: int) -> list[RadixNode]:
        """Up to ``num_pages`` evictable nodes of ``tier`` in policy order, passing over reserved
        ones (``is_reserved``; they keep their place).

        The caller moves or drops each one, or hands it back with ``requeue``.
        """
        heap = self._heaps[tier]
        victims: list[RadixNode] = []
        passed: list[tuple[float, int, int, RadixNode]] = []
        is_reserved = None if self._is_reservation_lifted else self.is_reserved
        while len(victims) < num_pages and heap:
            entry = heapq.heappop(heap)
            priority, node = entry[0], entry[3]
            if not self._is_live_entry(entry, tier):
                continue
            if not self.is_evictable(node):
                continue
            if is_reserved is not None and is_reserved(node):
                passed.append(entry)
                continue
            node.version += 1  # its remaining heap entries are stale now
            self.policy.on_evict(node, priority)
            victims.append(node)
        for entry in passed:
            heapq.heappush(heap, entry)
        return victims

    @contextlib.contextmanager
    def all_evictable(self) -> Iterator[None]:
        """Victim searches inside pass over nothing (``is_reserved`` lifted): a drain moves every page."""
        lifted, self._is_reservation_lifted = self._is_reservation_lifted, True
        try:
            yield
        finally:
            self._is_reservation_lifted = lifted

    def requeue(self, node: RadixNode) -> None:
        self._push_if_evictable(node)

    def mark_expendable(self, nodes: Sequence[RadixNode]) -> None:
        """Pages nobody is expected to ask for again (an ended session's): each goes before
        every other idle page of its tier, now if it is a candidate, else once it becomes one
        (a parent after its children). A later hit makes a page ordinary again."""
        for node in nodes:
            node.is_expendable = True
            self._push_if_evictable(node)

    def evict(self, num_pages: int) -> int:
        """Drop up to ``num_pages`` idle HBM leaves in policy order, each with what hangs below
        it; returns how many HBM pages were freed. An engine with tiers or quotas frees room
        through them instead (``TierManager.free_hbm_page``, ``QuotaTracker.free_own_page``)."""
        freed = 0
        while freed < num_pages and (victims := self.pop_victims(Tier.HBM, 1)):
            self.drop_subtree(victims[0])
            freed += 1
        return freed

    def drop_or_requeue(self, node: RadixNode) -> int:
        """Drop a victim with everything below it; when that would take a pinned page along
        (``holds_pin``), hand it back to the candidates instead. Returns pages dropped (0: kept)."""
        if self.holds_pin(node):
            self.requeue(node)
            return 0
        return self.drop_subtree(node)

    def holds_pin(self, node: RadixNode) -> bool:
        """``node`` or a page below it (in a slower tier) is pinned: dropping it would
        take a pinned page along."""
        stack = [node]
        while stack:
            current = stack.pop()
            if current.pins:
                return True
            stack.extend(current.children.values())
        return False

    def reprioritize(self) -> None:
        """Rebuild the candidate heaps (after a policy change or a policy input changed)."""
        for heap in self._heaps.values():
            heap.clear()
        for node in self._nodes.values():
            self._push_if_evictable(node)

    def count_by_tier(self) -> dict[Tier, int]:
        counts = dict.fromkeys(Tier, 0)
        for node in self._nodes.values():
            counts[node.tier] += 1
        return counts

    def check_integrity(self) -> None:
        for node in self._nodes.values():
            where = f"node {short(node.key)}"
            if node.tier is Tier.HBM:
                if self._by_page.get(node.page) is not node:
                    raise IntegrityError(f"HBM page {node.page} of {where} is not indexed by page")
                if not self.pool.is_cached(node.page):
                    raise IntegrityError(f"HBM page {node.page} of {where} is not marked cached")
            tiers = [0, 0, 0]
            for key, child in node.children.items():
                if self._nodes.get(key) is not child or child.parent is not node:
                    raise IntegrityError(f"{where} lists a child that is not cached under it")
                if child.tier < node.tier:
                    raise IntegrityError(f"{where} in {node.tier.label} has a child in faster {child.tier.label}")
                tiers[child.tier - 1] += 1
            if tiers != node.child_tiers:
                raise IntegrityError(f"{where} counts children per tier {node.child_tiers}, has {tiers}")
            if node.parent is not None:
                if self._nodes.get(node.parent.key) is not node.parent:
                    raise IntegrityError(f"{where} has an uncached parent")
                if node.depth != node.parent.depth + 1:
                    raise IntegrityError(f"{where} depth {node.depth} breaks the chain")
        num_hbm = sum(1 for n in self._nodes.values() if n.tier is Tier.HBM)
        if len(self._by_page) != num_hbm:
            raise IntegrityError(f"page map holds {len(self._by_page)} HBM pages, index has {num_hbm}")
        self.pool.check_integrity()
