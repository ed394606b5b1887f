"""Recovery of the NVMe tier after a restart: the slot table rebuilt from the records on disk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvtier.domain.hashing import NamespaceDigest, PageKey
from kvtier.tiers.checksum import CHECKSUM_ALGORITHM, page_checksums, to_unsigned
from kvtier.tiers.nvme.buffers import aligned_buffer
from kvtier.tiers.nvme.files import SlotFiles
from kvtier.tiers.nvme.format import (
    HEADER_BYTES,
    RECORD,
    SlotEntry,
    SlotHeader,
    SlotId,
    SlotState,
    SlotVerdict,
)
from kvtier.tiers.nvme.io import preadv_all
from kvtier.tiers.nvme.slots import SlotTable
from kvtier.tiers.nvme.writer import SlotWriter


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
    """Rebuilds ``table`` from the records in the slot ``files`` (``writer`` marks discarded
    slots FREE). Reads ``max_slots_per_io`` slots per call, a multiple of the group size."""

    def __init__(
        self, files: SlotFiles, table: SlotTable, writer: SlotWriter, *, max_slots_per_io: int, verify_payload: bool
    ) -> None:
        self._files = files
        self._table = table
        self._writer = writer
        self._chunk = max_slots_per_io
        self._verify_payload = verify_payload

    def recover(self) -> RecoveryReport:
        """Rebuild the slot table from disk: every slot whose header is intact, COMPLETE
        and (unless disabled) whose payload matches its checksum comes back with its key
        and namespace; torn or corrupt slots are discarded, their headers marked FREE.

        Needs a table with no reserved slot.
        """
        self._writer.flush_frees()
        self._table.clear()
        f = self._files
        report = RecoveryReport()
        best: dict[tuple[bytes, bytes], tuple[SlotId, SlotHeader]] = {}
        bad: list[SlotId] = []
        max_generation = 0
        chunk = self._chunk  # a multiple of the group size: chunks hold whole groups
        buf = aligned_buffer(f.span_bytes(chunk))  # freed with the last reference
        starts = [
            start
            for first in range(0, f.num_slots, f.slots_per_file)
            for start in range(first, min(f.num_slots, first + f.slots_per_file), chunk)
        ]
        for start in starts:
            end = min(f.num_slots, start + chunk, (start // f.slots_per_file + 1) * f.slots_per_file)
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
        restored: list[tuple[SlotId, SlotEntry, int]] = []
        for (key, ns), (slot, h) in sorted(best.items(), key=lambda kv: kv[1][0]):
            encoded = h.encode()
            entry = SlotEntry(PageKey(key), NamespaceDigest(ns), h.payload_checksum, h.generation, encoded)
            crc = int.from_bytes(encoded[RECORD.size : RECORD.size + 4], "little")
            restored.append((slot, entry, crc))
            report.recovered.append(
                RecoveredPage(
                    slot, PageKey(key), NamespaceDigest(ns), h.payload_checksum, h.generation, h.parent_key, h.tokens
                )
            )
        generations = self._table.restore(restored, max_generation, len(bad))
        if bad:
            self._writer.invalidate(bad, generations)
        report.discarded.sort()
        return report

    def _scan(self, slots: list[int], buf: memoryview) -> list[tuple[int, SlotHeader | None, str | None]]:
        """Decode and verify group-aligned consecutive ``slots`` of one file."""
        f = self._files
        span = f.span(slots[0], len(slots))
        g_size, r_bytes, p_bytes = f.slots_per_group, f.record_bytes, f.payload_bytes
        start = f.header_offset(span.first)
        view = memoryview(buf)[: f.span_bytes(len(slots))]
        if self._verify_payload:
            num_read = preadv_all(span.fd, [view], start)
            complete = [
                f.payload_offset(span.first + j) + p_bytes - start <= num_read for j in range(len(slots))
            ]
        else:
            complete = []
            for g in span.groups:
                at = (g - span.groups[0]) * f.group_bytes
                got = preadv_all(span.fd, [view[at : at + HEADER_BYTES]], start + at)
                complete.extend([got == HEADER_BYTES] * min(g_size, span.end - g * g_size))
        out: list[tuple[int, SlotHeader | None, str | None]] = []
        payloads: list[int] = []
        for j, slot in enumerate(slots):
            if not complete[j]:
                out.append((slot, None, SlotVerdict.SHORT_READ.value))
                continue
            at = (j // g_size) * f.group_bytes + (j % g_size) * r_bytes
            try:
                header = SlotHeader.decode(view[at : at + r_bytes])
            except ValueError as exc:
                out.append((slot, None, f"{SlotVerdict.HEADER_CORRUPT.value}: {exc}"))
                continue
            reason = None
            if header is not None and header.state is SlotState.COMPLETE:
                if header.slot != slot:
                    reason = f"{SlotVerdict.WRONG_PAGE.value}: header names slot {header.slot}"
                elif header.payload_bytes != f.page_bytes or header.algorithm != CHECKSUM_ALGORITHM:
                    reason = f"{SlotVerdict.HEADER_CORRUPT.value}: payload size or checksum algorithm differs"
                elif self._verify_payload:
                    payloads.append(j)
            out.append((slot, header, reason))
        if payloads:
            whole = torch.frombuffer(buf, dtype=torch.uint8, count=len(view))
            sums: list[int] = []
            for g0 in range(0, len(slots), g_size):
                picked = [j - g0 for j in payloads if g0 <= j < g0 + g_size]
                if picked:
                    at = (g0 // g_size) * f.group_bytes + HEADER_BYTES
                    n_group = min(g_size, len(slots) - g0)
                    pages = whole[at : at + n_group * p_bytes].view(n_group, p_bytes)[:, : f.page_bytes]
                    sums.extend(page_checksums(pages[picked]).tolist())
            for j, value in zip(payloads, sums, strict=True):
                slot, header, _ = out[j]
                assert header is not None
                if to_unsigned(value) != header.payload_checksum:
                    out[j] = (slot, header, SlotVerdict.CHECKSUM_MISMATCH.value)
            del whole
        return out
