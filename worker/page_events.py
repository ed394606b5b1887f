"""The namespaces the worker has admitted, the namespace of each cached page, and page events.

The worker listens to the radix index and buffers an INSERT (parent key and depth, tier HBM),
MOVE or DROP per page, with the page's namespace digest, for the WorkerLink. A radix node does
not know its namespace, so a side map page key → digest is kept: a child inherits its parent's
digest; a depth-1 page is matched against the root keys of the namespaces admitted so far
(``next_key(root, tokens) == key``; one hash per known namespace).

The index calls the listeners on the engine thread; ``drain`` and ``consume_lost`` may run on
any thread (the buffer is under a lock).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping

from kvtier.cache.radix import RadixIndex, RadixNode
from kvtier.domain.errors import IntegrityError
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity, PageKey, next_key, root_key, short
from kvtier.domain.records import InventoryPage, NamespaceInventory, PageEvent
from kvtier.domain.tiers import Tier
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.worker.page_events")

# Page events waiting for the WorkerLink. Beyond this (no controller connected for a long time)
# the buffer is dropped and the link sends a full snapshot instead.
MAX_BUFFERED_PAGE_EVENTS = 1 << 16


class PageEvents:
    """Namespaces of ``index``'s pages, and the events the WorkerLink sends for them."""

    def __init__(self, index: RadixIndex) -> None:
        self._index = index
        self._key_digest: dict[PageKey, NamespaceDigest] = {}
        self._roots: dict[NamespaceDigest, PageKey] = {}
        self._identities: dict[NamespaceDigest, NamespaceIdentity] = {}  # of admitted namespaces
        self._lock = threading.Lock()
        self._events: list[PageEvent] = []
        self._lost = False
        index.on_insert.append(self._on_insert)
        index.on_remove.append(self._on_remove)
        index.on_move.append(self._on_move)
        # Pages indexed before the worker existed (restored from NVMe at start-up) carry their
        # namespace: learn them, so the first snapshot lists them and the directory routes to them.
        for node in sorted(index.nodes(), key=lambda n: n.depth):
            digest = self._digest_of(node)
            if digest is not None:
                self._key_digest[node.key] = digest
                self._roots.setdefault(digest, root_key(digest))

    # ---- namespaces (engine thread) ---------------------------------------------------
    @property
    def digests(self) -> Mapping[PageKey, NamespaceDigest]:
        """The namespace of every cached page (read-only view)."""
        return self._key_digest

    def admitted(self, digest: NamespaceDigest, identity: NamespaceIdentity) -> None:
        """A request of this namespace reached the engine: its depth-1 pages can be named."""
        if digest not in self._roots:
            self._roots[digest] = root_key(digest)
            self._identities[digest] = identity

    def identities(self) -> Mapping[NamespaceDigest, NamespaceIdentity]:
        return self._identities

    def forget(self, digest: NamespaceDigest) -> None:
        """The namespace has no page and no sequence left (invalidated)."""
        self._identities.pop(digest, None)
        self._roots.pop(digest, None)

    def nodes_of(self, digests: Collection[NamespaceDigest]) -> list[RadixNode]:
        """Cached pages of the namespaces ``digests``."""
        return [n for n in self._index.nodes() if self._key_digest.get(n.key) in digests]

    def check_integrity(self) -> None:
        missing = [node for node in self._index.nodes() if node.key not in self._key_digest]
        if missing:
            raise IntegrityError(f"{len(missing)} cached pages have no namespace (e.g. {short(missing[0].key)})")

    # ---- events ---------------------------------------------------------------------
    def drain(self) -> list[PageEvent]:
        """Page events since the last drain, oldest first (any thread)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def consume_lost(self) -> bool:
        """True once after the buffer overflowed: the receiver needs a full snapshot."""
        with self._lock:
            lost, self._lost = self._lost, False
        return lost

    def inventory(self, reset_page_events: bool) -> list[NamespaceInventory]:
        """Every cached page by namespace and tier, parents before children (engine thread). With
        ``reset_page_events`` the buffered events are discarded: the inventory reflects them."""
        if reset_page_events:
            with self._lock:
                self._events.clear()
                self._lost = False
        groups: dict[tuple[NamespaceDigest, Tier], list[InventoryPage]] = {}
        for node in sorted(self._index.nodes(), key=lambda n: n.depth):
            digest = self._key_digest.get(node.key)
            if digest is None:
                continue
            parent_key = node.parent.key if node.parent is not None else self._roots[digest]
            page = InventoryPage(page_key=node.key, parent_key=parent_key, depth=node.depth)
            groups.setdefault((digest, node.tier), []).append(page)
        return [
            NamespaceInventory(namespace_digest=digest, tier=tier, pages=tuple(pages))
            for (digest, tier), pages in groups.items()
        ]

    # ---- the index's listeners (engine thread) ---------------------------------------
    def _on_insert(self, node: RadixNode) -> None:
        digest = self._digest_of(node)
        if digest is None:
            log.error("a cached page matches no admitted namespace", extra={"page": short(node.key)})
            return
        self._key_digest[node.key] = digest
        parent_key = node.parent.key if node.parent is not None else self._roots[digest]
        self._buffer(PageEvent.insert(digest, node.key, parent_key, node.depth, node.tier))

    def _on_remove(self, node: RadixNode) -> None:
        digest = self._key_digest.pop(node.key, None)
        if digest is not None:
            self._buffer(PageEvent.drop(digest, node.key, node.tier))

    def _on_move(self, node: RadixNode, from_tier: Tier) -> None:
        digest = self._key_digest.get(node.key)
        if digest is not None:
            self._buffer(PageEvent.move(digest, node.key, node.tier, from_tier))

    def _digest_of(self, node: RadixNode) -> NamespaceDigest | None:
        if node.namespace is not None:
            return node.namespace
        if node.parent is not None:
            return self._key_digest.get(node.parent.key)
        for digest, root in self._roots.items():
            if next_key(root, node.tokens) == node.key:
                return digest
        return None

    def _buffer(self, event: PageEvent) -> None:
        with self._lock:
            if len(self._events) >= MAX_BUFFERED_PAGE_EVENTS:
                self._events.clear()
                self._lost = True
            if not self._lost:
                self._events.append(event)
