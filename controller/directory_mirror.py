"""The leader's in-memory copy of the directory's holdings, for Route (decision 0010).

Only the leader writes the directory, and every write goes through its ``Directory``
object: page events (``apply_events``, after Redis has accepted them, minus the events Redis
rejected), namespace invalidations, and retired incarnations. This mirror applies the same
tier-mask changes as ``lua/apply_events.lua`` to a dict per namespace, so a Route can rank
workers without a Redis round trip — the round trip *and* the event-loop turns of awaiting
it were most of Route's cost above a gRPC health check. Redis stays the record: Admin.Lookup,
standbys and every other reader use it, and a new leader's mirror fills from the inventory
snapshots its workers send when they register (every registration is a new incarnation).

The mirror answers for an incarnation only if it saw every write of it (``Directory``
tracks that: incarnations registered by this object, none of whose writes failed midway);
otherwise Route reads Redis (``Directory.lookup``). The answer is the Lua lookup's, liveness filtered by
the caller alike; ``tests/test_directory_mirror.py`` checks the two agree over random event
streams.

Layout: ``namespace -> page key -> holders``, holders an ``int`` (``wid << 3 | tier mask``)
for the usual single holder and a ``dict[wid, mask]`` for shared pages — about 150 B per
(page, holder), the size of the Redis entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.domain.hashing import NamespaceDigest, PageKey

INSERT, MOVE, DROP = 1, 2, 3  # directory_scripts.KIND_CODES (the numbers the Lua reads)
_MASK_BITS = 3
_MASK = (1 << _MASK_BITS) - 1
FASTEST = (0, 1, 2, 1, 3, 1, 2, 1)  # tier mask -> fastest tier (0: none), as namespace_keys.lua

Holders = int | dict[int, int]


def next_mask(kind: int, mask: int, tier: int, from_tier: int) -> int:
    """A worker's tier mask on a page after one *accepted* event (``apply_events.lua``)."""
    if kind == INSERT:
        return mask | 1 << (tier - 1)
    if kind == MOVE:  # now in `tier`; gone from `from_tier`, or from every other tier when 0
        keep = 0 if from_tier == 0 else mask & ~(1 << (from_tier - 1))
        return keep | 1 << (tier - 1)
    return 0 if tier == 0 else mask & ~(1 << (tier - 1))  # DROP


class DirectoryMirror:
    """Tier masks by (namespace, page, incarnation id); see the module docstring."""

    def __init__(self) -> None:
        self._pages: dict[bytes, dict[bytes, Holders]] = {}
        self._namespaces_of: dict[int, set[bytes]] = {}  # wid -> namespaces it has entries in
        self._epochs: dict[bytes, int] = {}  # learned from Redis (lookups, invalidations)
        self._num_entries = 0  # (page, holder) pairs, kept as they change: a scrape reads it

    # -- writes (only what Redis accepted) ------------------------------------------------------

    def apply(self, wid: int, namespace: bytes, events: Iterable[tuple[int, bytes, int, int]]) -> None:
        """``(kind, key, tier, from_tier)`` of events Redis applied for ``wid``, in order."""
        pages = self._pages.setdefault(namespace, {})
        self._namespaces_of.setdefault(wid, set()).add(namespace)
        for kind, key, tier, from_tier in events:
            holders = pages.get(key)
            mask = _mask_of(holders, wid)
            new = next_mask(kind, mask, tier, from_tier)
            if new != mask:
                self._num_entries += (new != 0) - (mask != 0)
                updated = _with_mask(holders, wid, new)
                if updated is None:
                    del pages[key]
                else:
                    pages[key] = updated

    def forget_worker(self, wid: int) -> int:
        """Remove every entry of a retired incarnation; returns how many there were."""
        removed = 0
        for namespace in self._namespaces_of.pop(wid, ()):
            pages = self._pages.get(namespace)
            if not pages:
                continue
            for key in [k for k, h in pages.items() if _mask_of(h, wid)]:
                updated = _with_mask(pages[key], wid, 0)
                removed += 1
                if updated is None:
                    del pages[key]
                else:
                    pages[key] = updated
        self._num_entries -= removed
        return removed

    def invalidate(self, namespace: bytes, epoch: int) -> None:
        """The namespace's epoch moved to ``epoch``: every entry of it is gone."""
        pages = self._pages.pop(namespace, None) or {}
        self._num_entries -= sum(1 if isinstance(h, int) else len(h) for h in pages.values())
        self._epochs[namespace] = epoch

    # -- reads ----------------------------------------------------------------------------------

    def epoch(self, namespace: bytes) -> int | None:
        return self._epochs.get(namespace)

    def learn_epoch(self, namespace: bytes, epoch: int) -> None:
        """An epoch read from Redis; one learned from an invalidation here is never overwritten
        (a lookup sent before the invalidation may answer after it)."""
        self._epochs.setdefault(namespace, epoch)

    def forget_epochs(self) -> None:
        """Another leader may have invalidated namespaces meanwhile: read the epochs again."""
        self._epochs.clear()

    def lookup(self, namespace: NamespaceDigest, keys: Sequence[PageKey]) -> list[tuple[int, bytes]]:
        """``(wid, tiers)`` for every incarnation holding the depth-1 page, sorted by wid:
        ``tiers`` has the fastest tier of each page it holds contiguously from depth 1."""
        pages = self._pages.get(namespace)
        if not pages or not keys:
            return []
        first = pages.get(keys[0])
        if first is None:
            return []
        if isinstance(first, int):  # one holder: the common case, no per-depth dict work
            wid, runs = first >> _MASK_BITS, bytearray((FASTEST[first & _MASK],))
            for key in keys[1:]:
                holders = pages.get(key)
                mask = _mask_of(holders, wid)
                if not mask:
                    break
                runs.append(FASTEST[mask])
            return [(wid, bytes(runs))]
        by_worker = {w: bytearray((FASTEST[m],)) for w, m in first.items()}
        still = list(by_worker)  # incarnations whose run has not ended yet
        for key in keys[1:]:
            holders = pages.get(key)
            if holders is None:
                break
            going = []
            for w in still:
                mask = _mask_of(holders, w)
                if mask:
                    by_worker[w].append(FASTEST[mask])
                    going.append(w)
            if not going:
                break
            still = going
        return sorted((w, bytes(r)) for w, r in by_worker.items())

    @property
    def num_entries(self) -> int:
        """(page, holder) pairs held (the controller's ``directory_mirror_entries`` gauge)."""
        return self._num_entries

    def entries(self, namespace: bytes) -> dict[bytes, dict[int, int]]:
        """Every page of ``namespace`` with its holders' masks (tests and integrity checks)."""
        return {k: _as_dict(h) for k, h in self._pages.get(namespace, {}).items()}


def _mask_of(holders: Holders | None, wid: int) -> int:
    if holders is None:
        return 0
    if isinstance(holders, int):
        return holders & _MASK if holders >> _MASK_BITS == wid else 0
    return holders.get(wid, 0)


def _as_dict(holders: Holders) -> dict[int, int]:
    return {holders >> _MASK_BITS: holders & _MASK} if isinstance(holders, int) else dict(holders)


def _with_mask(holders: Holders | None, wid: int, mask: int) -> Holders | None:
    """``holders`` with ``wid``'s mask set (0: removed); None when nobody holds the page."""
    if holders is None or isinstance(holders, int) and holders >> _MASK_BITS == wid:
        return wid << _MASK_BITS | mask if mask else None  # the usual single holder: no dict on ingest
    table = _as_dict(holders)
    if mask:
        table[wid] = mask
    else:
        table.pop(wid, None)
    if not table:
        return None
    if len(table) == 1:
        ((w, m),) = table.items()
        return w << _MASK_BITS | m
    return table
