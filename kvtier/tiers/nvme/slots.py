"""Slot allocation of the NVMe tier: the in-memory slot table and its lifecycle (free,
reserved, stored, releasing), kept under one lock; I/O happens outside it.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvtier.domain.errors import (
    IntegrityError,
)
from kvtier.domain.hashing import KEY_BYTES, NamespaceDigest, PageKey
from kvtier.tiers.nvme.format import (
    ALIGN,
    HEADER_BYTES,
    SLOT_FREE,
    SLOT_RELEASING,
    SLOT_RESERVED,
    SLOT_STORED,
    ZERO_HEADER,
    SlotHeader,
    SlotId,
    SlotState,
)
from kvtier.tiers.nvme.io import preadv_all


class NvmeCounts(NamedTuple):
    total: int
    free: int
    reserved: int  # allocated, not written yet
    stored: int
    releasing: int = 0  # freed, header rewrite pending (allocatable: the next write replaces it)


class SlotTable:
    """Allocation and bookkeeping of ``NvmePool`` (``kvtier.tiers.nvme.pool``), which holds the state."""

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

    def flush_frees(self) -> int:
        """Mark every releasing slot FREE on disk and make it allocatable; returns how many."""
        with self._lock:
            batch, self._releasing = self._releasing, []
            generations = [self._take_generation() for _ in batch]
        if batch:
            self._invalidate(batch, generations)
        with self._lock:
            for slot in batch:
                self._state[slot] = SLOT_FREE
                heapq.heappush(self._free, slot)
        return len(batch)

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

    def _invalidate(self, slots: Sequence[int], generations: Sequence[int]) -> None:
        """Rewrite the records of ``slots`` FREE, one read-change-write per header block."""
        by_block: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        g_size = self.slots_per_group
        for slot, generation in zip(slots, generations, strict=True):
            index, i = divmod(int(slot), self.slots_per_file)
            by_block.setdefault((index, i // g_size), []).append((int(slot), i % g_size, int(generation)))
        block = self._scratch.header_area(HEADER_BYTES)
        zero = bytes(KEY_BYTES)
        r = self.record_bytes
        for (index, group), items in sorted(by_block.items()):
            offset = ALIGN + group * self.group_bytes
            (lock,) = self._locks_for(index, [group])
            with lock:
                try:
                    if g_size > 1 and preadv_all(self._fds[index], [block], offset) < HEADER_BYTES:
                        block[:] = ZERO_HEADER
                    for slot, j, generation in items:
                        header = SlotHeader(slot, SlotState.FREE, generation, 0, 0, zero, zero)
                        header.encode_into(block[j * r : (j + 1) * r])
                    os.pwritev(self._fds[index], [block], offset)
                except OSError:
                    # Best effort: a stale COMPLETE record only brings back a verified,
                    # content-addressed page at the next start, never wrong bytes.
                    pass

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

