"""The slot table of the NVMe tier: each slot's lifecycle (free, reserved, stored, releasing),
the pages stored and what their records must say, generations, kept under one lock. No I/O:
the reader, writer and recovery change the table through its methods around their I/O.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvtier.domain.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
)
from kvtier.domain.hashing import NamespaceDigest, PageKey
from kvtier.tiers.nvme.format import (
    SLOT_FREE,
    SLOT_RELEASING,
    SLOT_RESERVED,
    SLOT_STORED,
    SlotEntry,
    SlotId,
)


class NvmeCounts(NamedTuple):
    total: int
    free: int
    reserved: int  # allocated, not written yet
    stored: int
    releasing: int = 0  # freed, header rewrite pending (allocatable: the next write replaces it)


class Expected(NamedTuple):
    """What the records of stored slots must say, per slot of a read: generation, payload
    checksum (uint64) and record crc (uint32)."""

    generations: np.ndarray
    checksums: np.ndarray
    crcs: np.ndarray


class SlotTable:
    """Allocation and bookkeeping of ``num_slots`` NVMe slots. Thread-safe: every method
    takes the table's lock; callers do their I/O between calls, never under it."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._state = [SLOT_FREE] * num_slots
        # What each stored slot's record must say (arrays, so a read checks a run of records
        # and payload checksums in a few whole-array operations): generation, payload checksum
        # and record crc, valid where _is_stored.
        self._is_stored = np.zeros(num_slots, dtype=bool)
        self._expect_generation = np.zeros(num_slots, dtype=np.uint64)
        self._expect_checksum = np.zeros(num_slots, dtype=np.uint64)
        self._expect_crc = np.zeros(num_slots, dtype=np.uint32)
        self._entries: dict[SlotId, SlotEntry] = {}
        self._by_key: dict[tuple[bytes, bytes], SlotId] = {}
        self._free: list[SlotId] = [SlotId(s) for s in range(num_slots)]  # a sorted list is a heap
        self._releasing: list[SlotId] = []
        # Reserved slots handed out while releasing: their disk header still names the
        # freed page until written; freed unwritten, they go back to releasing, not free.
        self._stale: set[SlotId] = set()
        self._next_generation = 1

    # ---- allocation -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Slots an allocation can get (releasing ones included: it flushes them)."""
        return len(self._free) + len(self._releasing)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def counts(self) -> NvmeCounts:
        with self._lock:
            stored = len(self._entries)
            free, releasing = len(self._free), len(self._releasing)
            return NvmeCounts(
                self.num_slots, free, self.num_slots - free - releasing - stored, stored, releasing
            )

    def allocate(self) -> SlotId | None:
        got = self.allocate_many(1)
        return got[0] if got else None

    def allocate_many(self, n: int) -> list[SlotId] | None:
        """``n`` reserved slots, lowest free ids first (so they tend to form runs), then
        releasing ones, or ``None`` when fewer than ``n`` are free (all or nothing).

        A releasing slot is handed out without its FREE rewrite (no I/O on the caller's
        thread): its stale COMPLETE header names the freed page, verified and under its
        own key, until the next write replaces it, which is what a crash before the
        flush would have left anyway."""
        with self._lock:
            if n > len(self._free) + len(self._releasing):
                return None
            slots = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
            short = n - len(slots)
            if short:
                self._releasing.sort()
                slots.extend(self._releasing[:short])
                self._stale.update(self._releasing[:short])
                del self._releasing[:short]
            for s in slots:
                self._state[s] = SLOT_RESERVED
            return slots

    def free(self, slot: SlotId) -> None:
        """Give back a reserved or stored slot. No I/O: a stored slot is RELEASING until
        ``flush_frees`` marks its header FREE (the transfer engine's disk lane does that
        before each NVMe job) or ``allocate_many`` hands it out again, so a free on the
        engine thread never waits for the disk. A crash before the flush brings the page
        back at the next start, verified and under its own key: never wrong bytes."""
        with self._lock:
            state = self._state[slot]
            if state in (SLOT_FREE, SLOT_RELEASING):
                raise IntegrityError(f"free of nvme slot {slot} that is already free")
            entry = self._entries.pop(slot, None)
            if entry is not None:
                del self._by_key[(entry.key, entry.namespace)]
                self._is_stored[slot] = False
            if entry is not None or slot in self._stale:
                self._stale.discard(slot)
                self._state[slot] = SLOT_RELEASING
                self._releasing.append(slot)
            else:
                self._state[slot] = SLOT_FREE
                heapq.heappush(self._free, slot)

    def take_releasing(self) -> tuple[list[SlotId], list[int]]:
        """The releasing slots, each with a fresh generation for its FREE record; they stay
        out of every list until ``finish_release``."""
        with self._lock:
            batch, self._releasing = self._releasing, []
            return batch, [self._take_generation() for _ in batch]

    def finish_release(self, slots: Sequence[SlotId]) -> None:
        """Make slots taken by ``take_releasing`` allocatable (their headers say FREE)."""
        with self._lock:
            for slot in slots:
                self._state[slot] = SLOT_FREE
                heapq.heappush(self._free, slot)

    def entry(self, slot: SlotId) -> tuple[PageKey, NamespaceDigest, int] | None:
        """``(key, namespace, checksum)`` of a stored slot, ``None`` otherwise."""
        with self._lock:
            e = self._entries.get(slot)
            return (e.key, e.namespace, e.checksum) if e else None

    def is_reserved(self, slot: SlotId) -> bool:
        """Allocated and not written yet: a valid target for ``write_pages``."""
        with self._lock:
            return self._state[slot] == SLOT_RESERVED

    def reserved_mask(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """``is_reserved`` for many slots under one lock (bool array)."""
        ids = np.asarray(slots, dtype=np.int64).tolist()
        with self._lock:
            state = self._state
            return np.fromiter((state[s] == SLOT_RESERVED for s in ids), dtype=bool, count=len(ids))

    def stored_mask(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """Whether each slot holds a page (``entry`` is not None), under one lock."""
        ids = np.asarray(slots, dtype=np.int64)
        with self._lock:
            return self._is_stored[ids]

    def lookup(self, key: PageKey, namespace: NamespaceDigest) -> SlotId | None:
        with self._lock:
            return self._by_key.get((key, namespace))

    def _take_generation(self) -> int:
        g = self._next_generation
        self._next_generation += 1
        return g

    def stored_checksums(self, slots: Sequence[SlotId] | np.ndarray) -> np.ndarray:
        """The checksums (uint64) stored with ``slots``, 0 for a slot that holds no page."""
        ids = np.asarray(slots, dtype=np.int64)
        with self._lock:
            return np.where(self._is_stored[ids], self._expect_checksum[ids], np.uint64(0))

    # ---- writes -----------------------------------------------------------------------
    def begin_write(
        self, slot_ids: np.ndarray, keys: Sequence[PageKey], namespaces: Sequence[NamespaceDigest]
    ) -> np.ndarray:
        """Check that every slot is reserved and no page is stored yet; returns a fresh
        generation (uint64) per slot."""
        n = len(slot_ids)
        with self._lock:
            for s, key, ns in zip(slot_ids.tolist(), keys, namespaces, strict=True):
                if self._state[s] != SLOT_RESERVED:
                    raise InvalidArgument(f"write_pages: nvme slot {s} is not reserved (allocate it first)")
                other = self._by_key.get((key, ns))
                if other is not None:
                    raise InvalidArgument(f"write_pages: page already stored in nvme slot {other}")
            first = self._next_generation
            self._next_generation += n
        return np.arange(first, first + n, dtype=np.uint64)

    def commit_write(
        self, slot_ids: np.ndarray, generations: np.ndarray, checksums: np.ndarray, crcs: np.ndarray,
        entries: Sequence[SlotEntry],
    ) -> None:
        """The slots of a ``begin_write`` call are stored: their entries, and what their
        records say (generation, payload checksum, record crc per slot)."""
        with self._lock:
            self._is_stored[slot_ids] = True
            self._expect_generation[slot_ids] = generations
            self._expect_checksum[slot_ids] = checksums
            self._expect_crc[slot_ids] = crcs
            for s, e in zip(slot_ids.tolist(), entries, strict=True):
                self._stale.discard(SlotId(s))
                self._state[s] = SLOT_STORED
                self._entries[SlotId(s)] = e
                self._by_key[(e.key, e.namespace)] = SlotId(s)

    def abort_write(self, slot_ids: np.ndarray) -> None:
        """A failed write's slots are free again (their headers were rewritten FREE)."""
        with self._lock:
            for s in slot_ids.tolist():
                self._state[s] = SLOT_FREE
                heapq.heappush(self._free, SlotId(s))
                self._stale.discard(SlotId(s))

    # ---- reads ------------------------------------------------------------------------
    def expected(self, slot_ids: np.ndarray) -> Expected:
        """What the records of stored ``slot_ids`` must say; raises for a slot with no page."""
        with self._lock:
            stored = self._is_stored[slot_ids]
            if not stored.all():
                raise InvalidArgument(f"read_pages: nvme slot {int(slot_ids[~stored][0])} holds no page")
            return Expected(
                self._expect_generation[slot_ids], self._expect_checksum[slot_ids], self._expect_crc[slot_ids]
            )

    def entries(self, slots: Sequence[int]) -> list[SlotEntry | None]:
        """The entries of ``slots`` under one lock (``None`` for a slot with no page)."""
        with self._lock:
            return [self._entries.get(SlotId(s)) for s in slots]

    # ---- recovery ---------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every page (recovery rebuilds the table); refused while a slot is reserved."""
        with self._lock:
            if any(s == SLOT_RESERVED for s in self._state):
                raise FailedPrecondition("recover() while slots are reserved (a write may be in flight)")
            self._state = [SLOT_FREE] * self.num_slots
            self._is_stored[:] = False
            self._entries.clear()
            self._by_key.clear()

    def restore(
        self, pages: Sequence[tuple[SlotId, SlotEntry, int]], max_generation: int, num_bad: int
    ) -> list[int]:
        """Install recovered ``(slot, entry, record crc)``s on a cleared table; every other slot
        is free. Returns ``num_bad`` fresh generations for the FREE records of discarded slots."""
        with self._lock:
            self._next_generation = max(self._next_generation, max_generation + 1)
            for slot, e, crc in pages:
                self._state[slot] = SLOT_STORED
                self._entries[slot] = e
                self._is_stored[slot] = True
                self._expect_generation[slot] = e.generation
                self._expect_checksum[slot] = e.checksum
                self._expect_crc[slot] = crc
                self._by_key[(e.key, e.namespace)] = slot
            self._free = [SlotId(s) for s in range(self.num_slots) if self._state[s] == SLOT_FREE]
            heapq.heapify(self._free)
            return [self._take_generation() for _ in range(num_bad)]

    # ---- integrity --------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise with the numbers when the slot table does not add up."""
        with self._lock:
            problems: list[str] = []
            free = set(self._free)
            if len(free) != len(self._free):
                problems.append("a slot appears twice in the free list")
            num_free = sum(1 for s in self._state if s == SLOT_FREE)
            num_reserved = sum(1 for s in self._state if s == SLOT_RESERVED)
            num_stored = sum(1 for s in self._state if s == SLOT_STORED)
            num_releasing = sum(1 for s in self._state if s == SLOT_RELEASING)
            if any(self._state[s] != SLOT_FREE for s in free) or len(free) != num_free:
                problems.append(f"free list has {len(free)} slots, table has {num_free} free")
            releasing = set(self._releasing)
            if (
                len(releasing) != len(self._releasing)
                or len(releasing) != num_releasing
                or any(self._state[s] != SLOT_RELEASING for s in releasing)
            ):
                problems.append(f"releasing list has {len(self._releasing)} slots, table has {num_releasing}")
            if set(self._entries) != {s for s in range(self.num_slots) if self._state[s] == SLOT_STORED}:
                problems.append(f"{len(self._entries)} entries for {num_stored} stored slots")
            if set(np.flatnonzero(self._is_stored).tolist()) != set(self._entries):
                problems.append(f"{int(self._is_stored.sum())} slots marked stored, {len(self._entries)} entries")
            if len(self._by_key) != len(self._entries) or any(
                self._entries.get(s) is None or (self._entries[s].key, self._entries[s].namespace) != k
                for k, s in self._by_key.items()
            ):
                problems.append("key map disagrees with the slot entries")
            if num_free + num_reserved + num_stored + num_releasing != self.num_slots:
                problems.append(
                    f"free {num_free} + reserved {num_reserved} + stored {num_stored} + releasing "
                    f"{num_releasing} != total {self.num_slots}"
                )
            if any(self._state[s] != SLOT_RESERVED for s in self._stale):
                problems.append("a slot with a stale header is tracked but not reserved")
            if any(e.generation >= self._next_generation for e in self._entries.values()):
                problems.append("an entry's generation is not below the next generation")
        if problems:
            raise IntegrityError("nvme pool integrity: " + "; ".join(problems))

