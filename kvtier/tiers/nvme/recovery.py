"""Recovery of the NVMe tier after a restart: the slot table rebuilt from the records on disk."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvtier.domain.errors import (
    FailedPrecondition,
)
from kvtier.domain.hashing import NamespaceDigest, PageKey
from kvtier.tiers.checksum import CHECKSUM_ALGORITHM, page_checksums, to_unsigned
from kvtier.tiers.nvme.format import (
    ALIGN,
    HEADER_BYTES,
    RECORD,
    SLOT_FREE,
    SLOT_RESERVED,
    SLOT_STORED,
    SlotEntry,
    SlotHeader,
    SlotId,
    SlotState,
    SlotVerdict,
)
from kvtier.tiers.nvme.io import aligned_buffer, preadv_all


class RecoveredPage(NamedTuple):
    slot: SlotId
    key: PageKey
    namespace: NamespaceDigest
    checksum: int
    generation: int
    parent_key: PageKey | None
    tokens: tuple[int, ...]


@dataclass(slots=True)
class RecoveryReport:
    recovered: list[RecoveredPage] = field(default_factory=list)
    discarded: list[tuple[SlotId, str]] = field(default_factory=list)
    num_empty: int = 0  # never written or freed: nothing to recover, nothing lost


class SlotRecovery:
    """Recovery of ``NvmePool`` (``kvtier.tiers.nvme.pool``), which holds the state."""

    # ---- recovery ---------------------------------------------------------------------
    def recover(self) -> RecoveryReport:
        """Rebuild the slot table from disk: every slot whose header is intact, COMPLETE
        and (unless disabled) whose payload matches its checksum comes back with its key
        and namespace; torn or corrupt slots are discarded, their headers marked FREE.

        Called by the constructor; calling it again needs a pool with no reserved slot.
        """
        self.flush_frees()
        with self._lock:
            if any(s == SLOT_RESERVED for s in self._state):
                raise FailedPrecondition("recover() while slots are reserved (a write may be in flight)")
            self._state = [SLOT_FREE] * self.num_slots
            self._is_stored[:] = False
            self._entries.clear()
            self._by_key.clear()
        report = RecoveryReport()
        best: dict[tuple[bytes, bytes], tuple[SlotId, SlotHeader]] = {}
        bad: list[SlotId] = []
        max_generation = 0
        chunk = self.max_slots_per_io  # a multiple of the group size: chunks hold whole groups
        buf = aligned_buffer(self._span_bytes(chunk))  # freed with the last reference
        starts = [
            start
            for first in range(0, self.num_slots, self.slots_per_file)
            for start in range(first, min(self.num_slots, first + self.slots_per_file), chunk)
        ]
        for start in starts:
            end = min(self.num_slots, start + chunk, (start // self.slots_per_file + 1) * self.slots_per_file)
            for slot, header, reason in self._scan(list(range(start, end)), buf):
                if header is not None:
                    max_generation = max(max_generation, header.generation)
                if reason is not None:
                    report.discarded.append((SlotId(slot), reason))
                    bad.append(SlotId(slot))
                elif header is None or header.state is not SlotState.COMPLETE:
                    report.num_empty += 1
                else:
                    ident = (header.key, header.namespace)
                    prev = best.get(ident)
                    if prev is None or prev[1].generation < header.generation:
                        if prev is not None:
                            report.discarded.append((prev[0], f"duplicate of slot {slot}"))
                            bad.append(prev[0])
                        best[ident] = (SlotId(slot), header)
                    else:
                        report.discarded.append((SlotId(slot), f"duplicate of slot {prev[0]}"))
                        bad.append(SlotId(slot))
        with self._lock:
            self._next_generation = max(self._next_generation, max_generation + 1)
            for (key, ns), (slot, h) in sorted(best.items(), key=lambda kv: kv[1][0]):
                self._state[slot] = SLOT_STORED
                encoded = h.encode()
                self._entries[slot] = SlotEntry(
                    PageKey(key), NamespaceDigest(ns), h.payload_checksum, h.generation, encoded
                )
                self._is_stored[slot] = True
                self._expect_generation[slot] = h.generation
                self._expect_checksum[slot] = h.payload_checksum
                self._expect_crc[slot] = int.from_bytes(encoded[RECORD.size : RECORD.size + 4], "little")
                self._by_key[(key, ns)] = slot
                report.recovered.append(
                    RecoveredPage(
                        slot,
                        PageKey(key),
                        NamespaceDigest(ns),
                        h.payload_checksum,
                        h.generation,
                        h.parent_key,
                        h.tokens,
                    )
                )
            self._free = [SlotId(s) for s in range(self.num_slots) if self._state[s] == SLOT_FREE]
            heapq.heapify(self._free)
            generations = [self._take_generation() for _ in bad]
        if bad:
            self._invalidate(bad, generations)
        report.discarded.sort()
        return report

    def _span_bytes(self, num_slots: int) -> int:
        """Bytes from the header block of a group-aligned slot to the end of the payload
        ``num_slots`` slots later."""
        return self._payload_offset(num_slots - 1) + self.payload_bytes - ALIGN

    def _scan(self, slots: list[int], buf: memoryview) -> list[tuple[int, SlotHeader | None, str | None]]:
        """Decode and verify group-aligned consecutive ``slots`` of one file."""
        span = self._span(slots[0], len(slots))
        g_size, r_bytes, p_bytes = self.slots_per_group, self.record_bytes, self.payload_bytes
        start = self._header_offset(span.first)
        view = memoryview(buf)[: self._span_bytes(len(slots))]
        if self._verify_on_recover:
            num_read = preadv_all(span.fd, [view], start)
            complete = [
                self._payload_offset(span.first + j) + p_bytes - start <= num_read for j in range(len(slots))
            ]
        else:
            complete = []
            for g in span.groups:
                at = (g - span.groups[0]) * self.group_bytes
                got = preadv_all(span.fd, [view[at : at + HEADER_BYTES]], start + at)
                complete.extend([got == HEADER_BYTES] * min(g_size, span.end - g * g_size))
        out: list[tuple[int, SlotHeader | None, str | None]] = []
        payloads: list[int] = []
        for j, slot in enumerate(slots):
            if not complete[j]:
                out.append((slot, None, SlotVerdict.SHORT_READ.value))
                continue
            at = (j // g_size) * self.group_bytes + (j % g_size) * r_bytes
            try:
                header = SlotHeader.decode(view[at : at + r_bytes])
            except ValueError as exc:
                out.append((slot, None, f"{SlotVerdict.HEADER_CORRUPT.value}: {exc}"))
                continue
            reason = None
            if header is not None and header.state is SlotState.COMPLETE:
                if header.slot != slot:
                    reason = f"{SlotVerdict.WRONG_PAGE.value}: header names slot {header.slot}"
                elif header.payload_bytes != self.page_bytes or header.algorithm != CHECKSUM_ALGORITHM:
                    reason = f"{SlotVerdict.HEADER_CORRUPT.value}: payload size or checksum algorithm differs"
                elif self._verify_on_recover:
                    payloads.append(j)
            out.append((slot, header, reason))
        if payloads:
            whole = torch.frombuffer(buf, dtype=torch.uint8, count=len(view))
            sums: list[int] = []
            for g0 in range(0, len(slots), g_size):
                picked = [j - g0 for j in payloads if g0 <= j < g0 + g_size]
                if picked:
                    at = (g0 // g_size) * self.group_bytes + HEADER_BYTES
                    n_group = min(g_size, len(slots) - g0)
                    pages = whole[at : at + n_group * p_bytes].view(n_group, p_bytes)[:, : self.page_bytes]
                    sums.extend(page_checksums(pages[picked]).tolist())
            for j, value in zip(payloads, sums, strict=True):
                slot, header, _ = out[j]
                assert header is not None
                if to_unsigned(value) != header.payload_checksum:
                    out[j] = (slot, header, SlotVerdict.CHECKSUM_MISMATCH.value)
            del whole
        return out
