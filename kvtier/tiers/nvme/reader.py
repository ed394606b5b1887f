"""The read path of the NVMe tier: stored slots read back, one ``preadv`` per run of
consecutive slots, and every page verified (its record against what the slot table expects,
its payload against its checksum) before the caller may use it. Runs in transfer worker
threads; it takes the slot table's lock only to look up what to expect.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtier.domain.errors import InvalidArgument
from kvtier.tiers import copy as page_copy
from kvtier.tiers.checksum import to_unsigned
from kvtier.tiers.nvme import io
from kvtier.tiers.nvme.buffers import Pages, Scratch, page_views
from kvtier.tiers.nvme.files import SlotFiles, Span
from kvtier.tiers.nvme.format import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_BYTES,
    SLOT_MAGIC,
    SlotId,
    SlotState,
    SlotVerdict,
    check_header,
)
from kvtier.tiers.nvme.io import Runs
from kvtier.tiers.nvme.slots import SlotTable


class SlotReader:
    """Reads stored slots of the slot ``files`` and verifies them against ``table``."""

    def __init__(self, files: SlotFiles, table: SlotTable, runs: Runs, scratch: Scratch) -> None:
        self._files = files
        self._table = table
        self._runs = runs
        self._scratch = scratch

    def read_pages(
        self, slots: Sequence[SlotId], out: torch.Tensor | Sequence[torch.Tensor]
    ) -> list[SlotVerdict]:
        """Read stored ``slots[i]`` into ``out[i]`` and verify each one.

        Returns one verdict per slot; bytes of a slot whose verdict is not OK are
        garbage and must not be used (the caller frees the slot and recomputes). Each run's
        pages are checksummed (``kvtier.tiers.copy``) as soon as that run's read returns,
        while its bytes are still in the CPU's cache, and while another disk thread's read
        proceeds; summing them after every run of the call read them back from memory.
        """
        n = len(slots)
        if len(out) != n:
            raise InvalidArgument(f"read_pages: {n} slots but {len(out)} output pages", field="out")
        slot_ids = np.asarray(slots, dtype=np.int64)
        generations, checksums, crcs = self._table.expected(slot_ids)
        source = page_views(out, n, self._files.page_bytes)
        header_ok = np.zeros(n, dtype=bool)
        sums = np.zeros(n, dtype=np.uint64)
        suspects: list[tuple[int, memoryview | None]] = []  # (position, record) to look at closely
        for run in self._runs.split(slot_ids):
            positions = run.tolist()
            span = self._files.span(int(slot_ids[positions[0]]), len(positions))
            direct = self._runs.can_target(out, positions, None)
            records, complete = self._run(span, positions, source, direct)
            # Verify the bytes where they landed (after any bounce copy): end to end.
            sums[run] = _payload_checksums(out, run)
            # The fast path: the record is the one this pool wrote (same slot, generation,
            # checksum and crc over all its significant bytes).
            rec = records.reshape(-1).view(self._files.record)
            ok = (
                complete
                & (rec["magic"] == SLOT_MAGIC)
                & (rec["version"] == FORMAT_VERSION)
                & (rec["state"] == int(SlotState.COMPLETE))
                & (rec["slot"] == slot_ids[run])
                & (rec["generation"] == generations[run])
                & (rec["checksum"] == checksums[run])
                & (rec["crc"] == crcs[run])
            )
            header_ok[run] = ok
            for j in np.flatnonzero(~ok).tolist():
                suspects.append((positions[j], memoryview(records[j]) if complete[j] else None))
        payload_ok = sums == checksums
        if header_ok.all() and payload_ok.all():
            return [SlotVerdict.OK] * n
        result = [SlotVerdict.OK if p else SlotVerdict.CHECKSUM_MISMATCH for p in payload_ok.tolist()]
        entries = self._table.entries([int(slot_ids[i]) for i, _ in suspects])
        for (i, raw), entry in zip(suspects, entries, strict=True):
            verdict = (
                SlotVerdict.WRONG_PAGE
                if entry is None
                else check_header(raw, int(slot_ids[i]), entry, self._files.page_bytes)
            )
            if verdict is not SlotVerdict.OK:
                result[i] = verdict
        return result

    def _run(
        self, span: Span, positions: list[int], source: Pages, direct: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Read one run (its header blocks and payloads in one ``preadv``, plus the block
        before the first payload when the run starts inside a group); returns the run's
        records (``[k, record_bytes]`` uint8, a copy) and which slots were read in full (the
        file may end early)."""
        k = len(positions)
        f = self._files
        g_size, r_bytes, p_bytes = f.slots_per_group, f.record_bytes, f.payload_bytes
        blocks = self._scratch.header_area(len(span.groups) * HEADER_BYTES)
        lead = span.first % g_size != 0
        staging = None if direct else self._scratch.staging_area(k * p_bytes)
        sink = self._scratch.staging_area(p_bytes) if staging is None else None
        pad = (sink or memoryview(b""))[: p_bytes - f.page_bytes]
        iov = self._runs.iov(span, positions, source, blocks, staging, pad)
        start = f.payload_offset(span.first) if lead else f.header_offset(span.first)
        num_read = io.preadv_all(span.fd, iov, start)
        lead_ok = True
        if lead:
            got = io.preadv_all(span.fd, [blocks[:HEADER_BYTES]], f.header_offset(span.first))
            lead_ok = got == HEADER_BYTES
        local = np.arange(span.first, span.end)
        ends = ALIGN + (local // g_size) * f.group_bytes + HEADER_BYTES + (local % g_size + 1) * p_bytes
        complete = (ends - start <= num_read) & lead_ok
        if staging is not None:
            for j in np.flatnonzero(complete).tolist():
                source.view(positions[j])[:] = staging[j * p_bytes : j * p_bytes + f.page_bytes]
        base = span.groups[0] * g_size
        records = np.frombuffer(blocks, dtype=np.uint8).reshape(-1, r_bytes)[local - base]  # a copy
        return records, complete



def _payload_checksums(out: torch.Tensor | Sequence[torch.Tensor], positions: np.ndarray) -> np.ndarray:
    """Checksums (uint64) of pages ``out[positions]``: one kernel call per stretch of
    consecutive positions of a run tensor, one per page of a list."""
    if not isinstance(out, torch.Tensor):
        pages = [out[i].reshape(1, -1) for i in positions.tolist()]
        return np.array([to_unsigned(int(page_copy.checksums(p)[0])) for p in pages], dtype=np.uint64)
    sums = np.empty(len(positions), dtype=np.uint64)
    cuts = [0, *(np.flatnonzero(np.diff(positions) != 1) + 1).tolist(), len(positions)]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        first = int(positions[a])
        sums[a:b] = page_copy.checksums(out[first : first + b - a]).numpy().view(np.uint64)
    return sums
