"""Positional reads and writes of NVMe slots, run in transfer worker threads: one ``pwritev`` or
``preadv`` per run of consecutive slots, headers encoded and checked per run.
"""

from __future__ import annotations

import errno
import heapq
import mmap
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvtier.domain.errors import (
    InvalidArgument,
)
from kvtier.domain.hashing import NamespaceDigest, PageKey
from kvtier.tiers import copy as page_copy
from kvtier.tiers.checksum import CHECKSUM_ALGORITHM, to_unsigned
from kvtier.tiers.dram import (
    CAN_ADVISE_HUGE_PAGES,
    HUGE_PAGE_BYTES,
    aligned_host_tensor,
)
from kvtier.tiers.nvme.format import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_BYTES,
    HUGE_FROM_BYTES,
    IOV_MAX,
    MASK64,
    NO_SPACE_ERRNOS,
    RECORD,
    SLOT_FREE,
    SLOT_MAGIC,
    SLOT_RESERVED,
    SLOT_STORED,
    TOKENS_AT,
    DiskFull,
    NvmeIOError,
    SlotEntry,
    SlotId,
    SlotState,
    SlotVerdict,
    SyncPolicy,
    check_header,
    round_up,
)


def aligned_buffer(num_bytes: int) -> memoryview:
    """Zeroed, page-aligned memory for O_DIRECT. From 1 MiB up it is whole transparent huge
    pages (rounded up to 2 MiB): the device reads into huge pages 1.5-2.5x faster than into
    4 KiB ones on the CI VM (decision 0002)."""
    if num_bytes < HUGE_FROM_BYTES or not CAN_ADVISE_HUGE_PAGES:
        return memoryview(mmap.mmap(-1, max(ALIGN, round_up(num_bytes, ALIGN))))  # page aligned
    return memoryview(aligned_host_tensor(round_up(num_bytes, HUGE_PAGE_BYTES)).numpy())


def _byte_view(t: torch.Tensor) -> memoryview:
    if t.device.type != "cpu":
        raise InvalidArgument(f"NVMe I/O needs host tensors, got one on {t.device}; stage through DRAM")
    if not t.is_contiguous():
        raise InvalidArgument("NVMe I/O needs contiguous page tensors")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Pages(NamedTuple):
    """Byte views of the pages of one call, and where they are adjacent in memory: with
    ``whole`` (one tensor's bytes) page ``i`` is row ``rows[i]`` of it, so consecutive rows go
    out as one iovec segment."""

    views: list[memoryview]
    whole: memoryview | None
    rows: np.ndarray | None


def _page_views(
    pages: torch.Tensor | Sequence[torch.Tensor], n: int, page_bytes: int, rows: np.ndarray | None = None
) -> _Pages:
    """Zero-copy byte views of ``n`` pages: one conversion for a tensor (a run ``[n, ...]``,
    or a pool ``[N, ...]`` whose pages ``rows`` are meant), slices of it per page."""
    if isinstance(pages, torch.Tensor):
        whole = _byte_view(pages)
        if rows is None:
            if len(whole) != n * page_bytes:
                raise InvalidArgument(
                    f"{n} pages of {page_bytes} bytes expected, got a tensor of {len(whole)} bytes"
                )
            views = [whole[i * page_bytes : (i + 1) * page_bytes] for i in range(n)]
            return _Pages(views, whole, np.arange(n, dtype=np.int64))
        num_rows = pages.shape[0] if pages.dim() else 0
        if len(whole) != num_rows * page_bytes:
            raise InvalidArgument(f"a pool of {page_bytes}-byte pages expected, got {tuple(pages.shape)}")
        if len(rows) and not (0 <= int(rows.min()) and int(rows.max()) < num_rows):
            raise InvalidArgument(f"page rows out of range [0, {num_rows})", field="rows")
        views = [whole[r * page_bytes : (r + 1) * page_bytes] for r in rows.tolist()]
        return _Pages(views, whole, rows)
    if rows is not None:
        raise InvalidArgument("rows select pages of one pool tensor, got a list of pages", field="rows")
    views = [_byte_view(p) for p in pages]
    bad = [len(v) for v in views if len(v) != page_bytes]
    if bad:
        raise InvalidArgument(f"a page of {bad[0]} bytes, the pool's pages have {page_bytes}")
    return _Pages(views, None, None)


class _HeaderFields(NamedTuple):
    """What the headers of one ``write_pages`` call say, indexed by position in the call."""

    slots: np.ndarray  # int64
    generations: np.ndarray  # uint64
    checksums: np.ndarray  # uint64
    keys: Sequence[bytes]
    namespaces: Sequence[bytes]
    parents: Sequence[bytes | None] | None
    tokens: Sequence[Sequence[int]] | None


class Scratch(threading.local):
    """Per-thread aligned buffers for header blocks and bounce copies (grown, never shrunk)."""

    def __init__(self, record_bytes: int) -> None:
        self.record_bytes = record_bytes
        self.headers = aligned_buffer(ALIGN)
        self.staging = aligned_buffer(ALIGN)
        self.encoded = aligned_buffer(ALIGN)
        self.encoded_dirty = 0  # bytes at the start of each encoded record that may be non-zero

    def encode_area(self, num_records: int) -> tuple[memoryview, np.ndarray]:
        """Records to encode into, as bytes and as ``[num_records, record_bytes]`` uint8, zero
        beyond the first ``encoded_dirty`` bytes of each (only encoders write here)."""
        num_bytes = num_records * self.record_bytes
        if len(self.encoded) < num_bytes:
            self.encoded = aligned_buffer(num_bytes)  # anonymous maps start zeroed
            self.encoded_dirty = 0
        view = memoryview(self.encoded)[:num_bytes]
        return view, np.frombuffer(self.encoded, dtype=np.uint8, count=num_bytes).reshape(num_records, -1)

    def header_area(self, num_bytes: int) -> memoryview:
        if len(self.headers) < num_bytes:
            self.headers = aligned_buffer(num_bytes)
        return memoryview(self.headers)[:num_bytes]

    def staging_area(self, num_bytes: int) -> memoryview:
        if len(self.staging) < num_bytes:
            self.staging = aligned_buffer(num_bytes)
        return memoryview(self.staging)[:num_bytes]


class Span(NamedTuple):
    """One run's slots ``[first, end)`` of one file, by local index, and the header blocks
    they touch: ``groups`` (local group ids), which of them the run shares with other slots
    (``shared``: read, changed and written back under the group's lock)."""

    fd: int
    file_index: int
    first: int
    end: int
    groups: range
    shared: tuple[int, ...]


class SlotIO:
    """Page reads and writes of ``NvmePool`` (``kvtier.tiers.nvme.pool``), which holds the state."""

    # ---- I/O --------------------------------------------------------------------------
    def _runs(self, slots: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Positions into ``slots``, grouped into runs of consecutive slots in one file (at
        most ``max_slots_per_io`` each), in slot order."""
        ids = np.asarray(slots, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        ordered = ids[order]
        # Cut at file boundaries and at multiples of max_slots_per_io (a multiple of the
        # group size, so the calls of one long run share no header block).
        local = ordered[1:] % self.slots_per_file
        breaks = (np.diff(ordered) != 1) | (local == 0) | (local % self.max_slots_per_io == 0)
        return np.split(order, np.flatnonzero(breaks) + 1)

    def _can_target(
        self, pages: torch.Tensor | Sequence[torch.Tensor], run: Sequence[int], rows: np.ndarray | None
    ) -> bool:
        """Whether I/O can go straight to the memory of the run's pages. O_DIRECT wants
        aligned addresses and lengths; otherwise the run bounces through an aligned buffer."""
        if not self.is_direct:
            return True
        if self.page_bytes % 512:
            return False
        if isinstance(pages, torch.Tensor):  # a run [n, ...] or a pool: every page aligned alike
            return pages.data_ptr() % ALIGN == 0 and self.page_bytes % ALIGN == 0
        return all(pages[i].data_ptr() % ALIGN == 0 for i in run)

    def write_pages(
        self,
        slots: Sequence[SlotId],
        pages: torch.Tensor | Sequence[torch.Tensor],
        keys: Sequence[PageKey],
        namespaces: Sequence[NamespaceDigest],
        checksums: Sequence[int] | np.ndarray,
        *,
        parents: Sequence[PageKey | None] | None = None,
        tokens: Sequence[Sequence[int]] | None = None,
        rows: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Store page i (host memory) in reserved ``slots[i]``. Page i is ``pages[i]`` of a
        run tensor ``[n, ...]`` or a list, or, with ``rows``, ``pages[rows[i]]`` of a pool
        tensor (no per-page tensor is made).

        Consecutive slots go out in one ``pwritev`` each, headers encoded per run in one
        batch. ``checksums`` are the values taken when the pages left HBM; they are stored,
        not recomputed, so corruption in between is caught at promotion rather than
        laundered here. Raises ``DiskFull``/``NvmeIOError`` with every slot of the call
        free again.
        """
        n = len(slots)
        row_ids = None if rows is None else np.asarray(rows, dtype=np.int64)
        for name, seq in (
            ("pages" if row_ids is None else "rows", pages if row_ids is None else row_ids),
            ("keys", keys),
            ("namespaces", namespaces),
            ("checksums", checksums),
            ("parents", parents if parents is not None else slots),
            ("tokens", tokens if tokens is not None else slots),
        ):
            if len(seq) != n:
                raise InvalidArgument(f"write_pages: {n} slots but {len(seq)} {name}", field=name)
        if tokens is not None:
            longest = max((len(t) for t in tokens), default=0)
            if longest > self.max_tokens_per_slot:
                raise InvalidArgument(
                    f"a slot record of this geometry holds at most {self.max_tokens_per_slot} tokens, "
                    f"got {longest}",
                    field="tokens",
                )
        if isinstance(checksums, np.ndarray) and checksums.dtype in (np.uint64, np.int64):
            sums = checksums.astype(np.int64, copy=False).view(np.uint64)
        else:
            sums = np.array([int(c) & MASK64 for c in checksums], dtype=np.uint64)
        slot_ids = np.asarray(slots, dtype=np.int64)
        with self._lock:
            for s, key, ns in zip(slot_ids.tolist(), keys, namespaces, strict=True):
                if self._state[s] != SLOT_RESERVED:
                    raise InvalidArgument(f"write_pages: nvme slot {s} is not reserved (allocate it first)")
                other = self._by_key.get((key, ns))
                if other is not None:
                    raise InvalidArgument(f"write_pages: page already stored in nvme slot {other}")
            first_generation = self._next_generation
            self._next_generation += n
        generations = np.arange(first_generation, first_generation + n, dtype=np.uint64)
        source = _page_views(pages, n, self.page_bytes, row_ids)
        fields = _HeaderFields(slot_ids, generations, sums, keys, namespaces, parents, tokens)
        written = 0
        encoded: list[bytes] = [b""] * n
        crcs = np.zeros(n, dtype=np.uint32)
        touched: set[int] = set()
        try:
            for run in self._runs(slot_ids):
                span = self._span(int(slot_ids[run[0]]), len(run))
                direct = self._can_target(pages, run, row_ids)
                run_headers, run_crcs = self._write_run(span, fields, run, source, direct)
                crcs[run] = run_crcs
                for i, h in zip(run.tolist(), run_headers, strict=True):
                    encoded[i] = h
                written += len(run)
                touched.add(span.fd)
            if self.sync is SyncPolicy.DATA:
                for fd in touched:
                    os.fdatasync(fd)
        except OSError as exc:
            # The failing run may have landed in part (a short write): mark every slot of
            # the call FREE on disk so none of it comes back at the next start.
            self._invalidate(slot_ids.tolist(), generations.tolist())
            with self._lock:
                for s in slot_ids.tolist():
                    self._state[s] = SLOT_FREE
                    heapq.heappush(self._free, SlotId(s))
                    self._stale.discard(SlotId(s))
            where = f"{written} of {n} pages written to {self.directory} before the failure"
            if exc.errno in NO_SPACE_ERRNOS:
                raise DiskFull(
                    f"NVMe tier out of space ({os.strerror(exc.errno)}); {where}; the pages "
                    "were not stored, drop them or free slots"
                ) from exc
            raise NvmeIOError(f"NVMe write failed ({exc}); {where}") from exc
        with self._lock:
            self._is_stored[slot_ids] = True
            self._expect_generation[slot_ids] = generations
            self._expect_checksum[slot_ids] = sums
            self._expect_crc[slot_ids] = crcs
            columns = zip(slot_ids.tolist(), generations.tolist(), sums.tolist(), strict=True)
            for i, (s, g, c) in enumerate(columns):
                self._stale.discard(SlotId(s))
                self._state[s] = SLOT_STORED
                self._entries[SlotId(s)] = SlotEntry(keys[i], namespaces[i], c, g, encoded[i])
                self._by_key[(keys[i], namespaces[i])] = SlotId(s)

    def _write_run(
        self, span: Span, fields: _HeaderFields, run: np.ndarray, source: _Pages, direct: bool
    ) -> tuple[list[bytes], np.ndarray]:
        """Write one run of slots (header blocks and payloads, one ``pwritev``, plus the
        header block before the run's first payload when the run starts inside a group);
        returns each record's significant bytes and crc."""
        k = len(run)
        g_size, r_bytes, p_bytes = self.slots_per_group, self.record_bytes, self.payload_bytes
        table, encoded = self._encode_headers(fields, run)
        crcs = table.reshape(-1).view(self._record)["crc"].copy()
        num_groups = len(span.groups)
        blocks = self._scratch.header_area(num_groups * HEADER_BYTES)
        records = np.frombuffer(blocks, dtype=np.uint8).reshape(num_groups * g_size, r_bytes)
        base = span.groups[0] * g_size
        lead = span.first % g_size != 0  # the first group's block sits before slots not ours
        pad = memoryview(self._zero_pad)[: p_bytes - self.page_bytes]
        staging = None if direct else self._scratch.staging_area(k * p_bytes)
        positions = run.tolist()
        locks = self._locks_for(span.file_index, span.shared)
        for lock in locks:
            lock.acquire()
        try:
            for gi, g in enumerate(span.groups):
                block = blocks[gi * HEADER_BYTES : (gi + 1) * HEADER_BYTES]
                offset = ALIGN + g * self.group_bytes
                if g not in span.shared or preadv_all(span.fd, [block], offset) < HEADER_BYTES:
                    records[gi * g_size : (gi + 1) * g_size] = 0
            records[span.first - base : span.end - base] = table
            if staging is not None:
                for j, i in enumerate(positions):
                    area = staging[j * p_bytes : (j + 1) * p_bytes]
                    area[: self.page_bytes] = source.views[i]
                    area[self.page_bytes :] = pad
            iov = self._run_iov(span, positions, source, blocks, staging, pad)
            start = self._payload_offset(span.first) if lead else self._header_offset(span.first)
            pwritev_all(span.fd, iov, start)
            if lead:
                pwritev_all(span.fd, [blocks[:HEADER_BYTES]], self._header_offset(span.first))
        finally:
            for lock in reversed(locks):
                lock.release()
        return encoded, crcs

    def _run_iov(
        self,
        span: Span,
        positions: list[int],
        source: _Pages,
        blocks: memoryview,
        staging: memoryview | None,
        pad: memoryview,
    ) -> list[memoryview]:
        """The iovecs of one run from its first header block (or, when the run starts inside a
        group, its first payload) on: each group's block, then its payloads, merged into
        one segment where the pages are consecutive rows of one tensor (``pad`` after each
        page whose size is not a multiple of 4096; ``staging`` instead of the pages when
        the run bounces)."""
        g_size, p_bytes, page_bytes = self.slots_per_group, self.payload_bytes, self.page_bytes
        first, k = span.first, len(positions)
        local = np.arange(first, first + k)
        # Segments start at every group start (a header block goes before them) and, for
        # pages taken from a tensor, wherever the rows stop being consecutive.
        starts_group = local % g_size == 0
        if staging is None and not len(pad) and source.rows is not None:
            rows = source.rows[positions]
            breaks = starts_group[1:] | (np.diff(rows) != 1)
        else:
            rows = None
            breaks = starts_group[1:] if staging is not None else np.ones(k - 1, dtype=bool)
        cuts = [0, *(np.flatnonzero(breaks) + 1).tolist(), k]
        group_starts = starts_group[cuts[:-1]].tolist()
        base_group = span.groups[0]
        iov: list[memoryview] = []
        for a, b, at_group in zip(cuts[:-1], cuts[1:], group_starts, strict=True):
            if at_group:
                gi = (first + a) // g_size - base_group
                iov.append(blocks[gi * HEADER_BYTES : (gi + 1) * HEADER_BYTES])
            if staging is not None:
                iov.append(staging[a * p_bytes : b * p_bytes])
            elif rows is not None:
                assert source.whole is not None
                r0 = int(rows[a])
                iov.append(source.whole[r0 * page_bytes : (r0 + b - a) * page_bytes])
            else:
                iov.append(source.views[positions[a]])
                if len(pad):
                    iov.append(pad)
        return iov

    def _encode_headers(self, f: _HeaderFields, run: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
        """COMPLETE records for the slots at positions ``run``, byte for byte what
        ``SlotHeader.encode_into`` writes, in the thread's encode area; returns the area as
        ``[k, record_bytes]`` uint8 and each record's significant bytes."""
        k = len(run)
        scratch = self._scratch
        area, table = scratch.encode_area(k)
        positions = run.tolist()
        counts = np.zeros(k, dtype=np.int64)
        token_rows: list[Sequence[int]] = []
        if f.tokens is not None:
            token_rows = [f.tokens[i] for i in positions]
            counts = np.fromiter((len(t) for t in token_rows), dtype=np.int64, count=k)
        significant = TOKENS_AT + 4 * counts
        dirty = max(scratch.encoded_dirty, int(significant.max()))
        table[:, :dirty] = 0
        scratch.encoded_dirty = dirty
        rec = table.reshape(-1).view(self._record)
        rec["magic"] = SLOT_MAGIC
        rec["version"] = FORMAT_VERSION
        rec["state"] = int(SlotState.COMPLETE)
        rec["slot"] = f.slots[run]
        rec["generation"] = f.generations[run]
        rec["payload_bytes"] = self.page_bytes
        rec["checksum"] = f.checksums[run]
        rec["algorithm"] = CHECKSUM_ALGORITHM
        rec["num_tokens"] = counts
        rec["key"] = [f.keys[i] for i in positions]
        rec["namespace"] = [f.namespaces[i] for i in positions]
        if f.parents is not None:
            parents = [f.parents[i] for i in positions]
            rec["flags"] = [p is not None for p in parents]
            rec["parent"] = [p or b"" for p in parents]
        if token_rows:
            ints = table.view("<i4")
            first = TOKENS_AT // 4
            if counts.min() == counts.max():
                ints[:, first : first + int(counts[0])] = np.asarray(token_rows, dtype="<i4").reshape(k, -1)
            else:
                for j, t in enumerate(token_rows):
                    ints[j, first : first + len(t)] = np.asarray(t, dtype="<i4")
        crcs = np.empty(k, dtype=np.uint32)
        r = self.record_bytes
        ends = significant.tolist()
        for j in range(k):
            base = j * r
            fixed = zlib.crc32(area[base : base + RECORD.size])
            crcs[j] = zlib.crc32(area[base + TOKENS_AT : base + ends[j]], fixed)
        rec["crc"] = crcs
        encoded = [bytes(area[j * r : j * r + ends[j]]) for j in range(k)]
        return table, encoded

    def stored_checksums(self, slots: Sequence[SlotId] | np.ndarray) -> np.ndarray:
        """The checksums (uint64) stored with ``slots``, 0 for a slot that holds no page."""
        ids = np.asarray(slots, dtype=np.int64)
        with self._lock:
            return np.where(self._is_stored[ids], self._expect_checksum[ids], np.uint64(0))

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
        with self._lock:
            stored = self._is_stored[slot_ids]
            if not stored.all():
                raise InvalidArgument(f"read_pages: nvme slot {int(slot_ids[~stored][0])} holds no page")
            generations = self._expect_generation[slot_ids]
            checksums = self._expect_checksum[slot_ids]
            crcs = self._expect_crc[slot_ids]
        source = _page_views(out, n, self.page_bytes)
        header_ok = np.zeros(n, dtype=bool)
        sums = np.zeros(n, dtype=np.uint64)
        suspects: list[tuple[int, memoryview | None]] = []  # (position, record) to look at closely
        for run in self._runs(slot_ids):
            positions = run.tolist()
            span = self._span(int(slot_ids[positions[0]]), len(positions))
            direct = self._can_target(out, positions, None)
            records, complete = self._read_run(span, positions, source, direct)
            # Verify the bytes where they landed (after any bounce copy): end to end.
            sums[run] = _payload_checksums(out, run)
            # The fast path: the record is the one this pool wrote (same slot, generation,
            # checksum and crc over all its significant bytes).
            rec = records.reshape(-1).view(self._record)
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
        with self._lock:
            entries = {i: self._entries.get(SlotId(int(slot_ids[i]))) for i, _ in suspects}
        for i, raw in suspects:
            entry = entries[i]
            verdict = (
                SlotVerdict.WRONG_PAGE
                if entry is None
                else check_header(raw, int(slot_ids[i]), entry, self.page_bytes)
            )
            if verdict is not SlotVerdict.OK:
                result[i] = verdict
        return result

    def _read_run(
        self, span: Span, positions: list[int], source: _Pages, direct: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Read one run (its header blocks and payloads in one ``preadv``, plus the block
        before the first payload when the run starts inside a group); returns the run's
        records (``[k, record_bytes]`` uint8, a copy) and which slots were read in full (the
        file may end early)."""
        k = len(positions)
        g_size, r_bytes, p_bytes = self.slots_per_group, self.record_bytes, self.payload_bytes
        blocks = self._scratch.header_area(len(span.groups) * HEADER_BYTES)
        lead = span.first % g_size != 0
        staging = None if direct else self._scratch.staging_area(k * p_bytes)
        sink = self._scratch.staging_area(p_bytes) if staging is None else None
        pad = (sink or memoryview(b""))[: p_bytes - self.page_bytes]
        iov = self._run_iov(span, positions, source, blocks, staging, pad)
        start = self._payload_offset(span.first) if lead else self._header_offset(span.first)
        num_read = preadv_all(span.fd, iov, start)
        lead_ok = True
        if lead:
            got = preadv_all(span.fd, [blocks[:HEADER_BYTES]], self._header_offset(span.first))
            lead_ok = got == HEADER_BYTES
        local = np.arange(span.first, span.end)
        ends = ALIGN + (local // g_size) * self.group_bytes + HEADER_BYTES + (local % g_size + 1) * p_bytes
        complete = (ends - start <= num_read) & lead_ok
        if staging is not None:
            for j in np.flatnonzero(complete).tolist():
                source.views[positions[j]][:] = staging[j * p_bytes : j * p_bytes + self.page_bytes]
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


def _advance(iov: list[memoryview], done: int) -> list[memoryview]:
    """The buffers still to transfer after ``done`` bytes of ``iov`` went through."""
    rest: list[memoryview] = []
    for b in iov:
        if done >= len(b):
            done -= len(b)
            continue
        rest.append(b[done:])
        done = 0
    return rest


def pwritev_all(fd: int, iov: list[memoryview], offset: int) -> None:
    if _vectored_all(os.pwritev, fd, iov, offset) < sum(len(b) for b in iov):
        raise OSError(errno.EIO, "pwritev wrote nothing")


def preadv_all(fd: int, iov: list[memoryview], offset: int) -> int:
    """Bytes read; fewer than asked only at end of file."""
    return _vectored_all(os.preadv, fd, iov, offset)


def _vectored_all(call: Callable[[int, list[memoryview], int], int], fd: int, iov: list[memoryview], offset: int) -> int:
    """Repeat a positional vectored ``call`` until ``iov`` is through or it moves no byte; bytes
    moved. Each call takes at most ``IOV_MAX`` buffers (the kernel refuses more)."""
    total = sum(len(b) for b in iov)
    done = 0
    while done < total:
        rest = _advance(iov, done) if done else iov
        n = call(fd, rest[:IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
    return done
