"""Local prefix index: page key → cached page, as a tree (DESIGN §5 decisions 2, 4, 7).

Page keys are chained hashes, so a key names a page *and its whole prefix*; the tree
only records parent links so that eviction can take leaves before their parents (a
cached prefix is never orphaned). A node's page belongs to the index ("cached" in the
pool); sequences that hit it take references on that page.

Evictable = leaf, page ref count 0, not pinned. Candidates sit in a heap keyed by the
eviction policy's priority, pushed when a node *becomes* evictable and checked again
when popped (lazy invalidation), so eviction costs O(log n) per page, not a scan.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.errors import IntegrityError
from kvtier.hashing import PageKey, short
from kvtier.page_pool import PageId, PagePool
from kvtier.tiers import Tier


@dataclass(slots=True, eq=False)
class RadixNode:
    key: PageKey
    parent: RadixNode | None
    page: PageId
    tokens: tuple[int, ...]
    depth: int  # 1 for the first page of a sequence
    tier: Tier = Tier.HBM
    last_access: int = 0
    num_children: int = 0
    pins: int = 0
    version: int = 0  # bumped on every heap push; older heap entries are stale

    @property
    def is_leaf(self) -> bool:
        return self.num_children == 0


class EvictionPolicy(Protocol):
    """Lower priority is evicted first. Called when a node becomes evictable."""

    name: str

    def priority(self, node: RadixNode) -> float: ...


class LRUPolicy:
    name = "lru"

    def priority(self, node: RadixNode) -> float:
        return float(node.last_access)


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
    def __init__(self, pool: PagePool, policy: EvictionPolicy | None = None) -> None:
        self.pool = pool
        self.policy: EvictionPolicy = policy or LRUPolicy()
        self._nodes: dict[PageKey, RadixNode] = {}
        self._by_page: dict[PageId, RadixNode] = {}
        self._heap: list[tuple[float, int, int, RadixNode]] = []
        self._tick = itertools.count(1)
        self._push_order = itertools.count()
        # Observers of index membership (page events for the directory, metrics).
        self.on_insert: list[Callable[[RadixNode], None]] = []
        self.on_remove: list[Callable[[RadixNode], None]] = []
        pool.on_idle = self._page_became_idle

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: PageKey) -> bool:
        return key in self._nodes

    def get(self, key: PageKey) -> RadixNode | None:
        return self._nodes.get(key)

    def nodes(self) -> list[RadixNode]:
        return list(self._nodes.values())

    # ---- lookup -------------------------------------------------------------------
    def match(self, keys: Sequence[PageKey], tokens: Sequence[int] | None = None) -> MatchResult:
        """Longest prefix of ``keys`` present in the index, touching each hit.

        When ``tokens`` are given, a hit also compares the page's tokens, so a hash
        collision can never serve another prefix's KV.
        """
        result = MatchResult()
        page_size = self.pool.page_size
        now = next(self._tick)
        for i, key in enumerate(keys):
            node = self._nodes.get(key)
            if node is None:
                break
            if tokens is not None and node.tokens != tuple(tokens[i * page_size : (i + 1) * page_size]):
                break
            node.last_access = now
            result.nodes.append(node)
        return result

    # ---- membership ---------------------------------------------------------------
    def insert(
        self, key: PageKey, parent_key: PageKey | None, page: PageId, tokens: Sequence[int]
    ) -> RadixNode | None:
        """Cache ``page`` under ``key``. The caller holds a reference on ``page``.

        Returns None when the key is already cached (the caller's page stays private)
        or when the parent is not cached (the index is prefix-closed).
        """
        if key in self._nodes:
            return None
        parent = None
        if parent_key is not None:
            parent = self._nodes.get(parent_key)
            if parent is None:
                return None
        if len(tokens) != self.pool.page_size:
            raise ValueError(f"a cached page holds exactly {self.pool.page_size} tokens, got {len(tokens)}")
        node = RadixNode(
            key=key,
            parent=parent,
            page=page,
            tokens=tuple(tokens),
            depth=1 if parent is None else parent.depth + 1,
            last_access=next(self._tick),
        )
        self.pool.mark_cached(page)
        self._nodes[key] = node
        self._by_page[page] = node
        if parent is not None:
            parent.num_children += 1
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

    def _detach(self, node: RadixNode) -> None:
        del self._nodes[node.key]
        del self._by_page[node.page]
        self.pool.unmark_cached(node.page)
        parent = node.parent
        if parent is not None:
            parent.num_children -= 1
            if parent.is_leaf:
                self._push_if_evictable(parent)
        for listener in self.on_remove:
            listener(node)

    # ---- pins ---------------------------------------------------------------------
    def pin(self, key: PageKey) -> None:
        """Keep a page and (implicitly, since leaves go first) its ancestors resident."""
        node = self._nodes[key]
        node.pins += 1
        self.pool.pin(node.page)

    def unpin(self, key: PageKey) -> None:
        node = self._nodes[key]
        if node.pins <= 0:
            raise IntegrityError(f"page {short(key)} is not pinned")
        node.pins -= 1
        self.pool.unpin(node.page)
        self._push_if_evictable(node)

    # ---- eviction -----------------------------------------------------------------
    def is_evictable(self, node: RadixNode) -> bool:
        return node.is_leaf and node.pins == 0 and self.pool.ref_count(node.page) == 0

    def _page_became_idle(self, page: PageId) -> None:
        node = self._by_page.get(page)
        if node is not None:
            self._push_if_evictable(node)

    def _push_if_evictable(self, node: RadixNode) -> None:
        if self._nodes.get(node.key) is node and self.is_evictable(node):
            node.version += 1
            heapq.heappush(self._heap, (self.policy.priority(node), next(self._push_order), node.version, node))

    def evict(self, num_pages: int) -> int:
        """Evict up to ``num_pages`` idle leaves in policy order; returns how many went."""
        evicted = 0
        while evicted < num_pages and self._heap:
            _, _, version, node = heapq.heappop(self._heap)
            if version != node.version or self._nodes.get(node.key) is not node or not self.is_evictable(node):
                continue
            self._detach(node)
            evicted += 1
        return evicted

    def reprioritize(self) -> None:
        """Rebuild the candidate heap (after a policy change or a policy input changed)."""
        self._heap.clear()
        for node in self._nodes.values():
            self._push_if_evictable(node)

    def check_integrity(self) -> None:
        children: dict[PageKey, int] = {}
        for node in self._nodes.values():
            if self._by_page.get(node.page) is not node:
                raise IntegrityError(f"page {node.page} of node {short(node.key)} is not indexed by page")
            if not self.pool.is_cached(node.page):
                raise IntegrityError(f"page {node.page} of node {short(node.key)} is not marked cached")
            if node.parent is not None:
                if self._nodes.get(node.parent.key) is not node.parent:
                    raise IntegrityError(f"node {short(node.key)} has an uncached parent")
                children[node.parent.key] = children.get(node.parent.key, 0) + 1
                if node.depth != node.parent.depth + 1:
                    raise IntegrityError(f"node {short(node.key)} depth {node.depth} breaks the chain")
        for node in self._nodes.values():
            if node.num_children != children.get(node.key, 0):
                raise IntegrityError(
                    f"node {short(node.key)} counts {node.num_children} children, has {children.get(node.key, 0)}"
                )
        if len(self._by_page) != len(self._nodes):
            raise IntegrityError("page map and key map differ in size")
        self.pool.check_integrity()
