"""The write path of the NVMe tier: pages written to reserved slots, one ``pwritev`` per run of
consecutive slots with the run's header records encoded in one batch, and records rewritten
FREE for freed slots. Runs in transfer worker threads; the slot table is changed before and
after the I/O, never during it.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import KEY_BYTES, NamespaceDigest, PageKey
from kvtier.tiers.checksum import CHECKSUM_ALGORITHM
from kvtier.tiers.nvme import io
from kvtier.tiers.nvme.buffers import Pages, Scratch, aligned_buffer, page_views
from kvtier.tiers.nvme.files import SlotFiles, Span
from kvtier.tiers.nvme.format import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_BYTES,
    MASK64,
    NO_SPACE_ERRNOS,
    RECORD,
    SLOT_MAGIC,
    TOKENS_AT,
    ZERO_HEADER,
    DiskFull,
    NvmeIOError,
    SlotEntry,
    SlotHeader,
    SlotId,
    SlotState,
    SyncPolicy,
)
from kvtier.tiers.nvme.io import Runs
from kvtier.tiers.nvme.slots import SlotTable


class _HeaderFields(NamedTuple):
    """What the headers of one ``write_pages`` call say, indexed by position in the call."""

    slots: np.ndarray  # int64
    generations: np.ndarray  # uint64
    checksums: np.ndarray  # uint64
    keys: Sequence[bytes]
    namespaces: Sequence[bytes]
    parents: Sequence[bytes | None] | None
    tokens: Sequence[Sequence[int]] | None



class SlotWriter:
    """Writes pages and FREE records into the slot ``files``, keeping ``table`` in step."""

    def __init__(
        self, files: SlotFiles, table: SlotTable, runs: Runs, scratch: Scratch, sync: SyncPolicy, max_tokens: int
    ) -> None:
        self._files = files
        self._table = table
        self._runs = runs
        self._scratch = scratch
        self._sync = sync
        self.max_tokens_per_slot = max_tokens
        self._zero_pad = aligned_buffer(files.payload_bytes - files.page_bytes or ALIGN)

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
        generations = self._table.begin_write(slot_ids, keys, namespaces)
        source = page_views(pages, n, self._files.page_bytes, row_ids)
        fields = _HeaderFields(slot_ids, generations, sums, keys, namespaces, parents, tokens)
        written = 0
        encoded: list[bytes] = [b""] * n
        crcs = np.zeros(n, dtype=np.uint32)
        touched: set[int] = set()
        try:
            for run in self._runs.split(slot_ids):
                span = self._files.span(int(slot_ids[run[0]]), len(run))
                direct = self._runs.can_target(pages, run, row_ids)
                run_headers, run_crcs = self._run(span, fields, run, source, direct)
                crcs[run] = run_crcs
                for i, h in zip(run.tolist(), run_headers, strict=True):
                    encoded[i] = h
                written += len(run)
                touched.add(span.fd)
            if self._sync is SyncPolicy.DATA:
                for fd in touched:
                    os.fdatasync(fd)
        except OSError as exc:
            # The failing run may have landed in part (a short write): mark every slot of
            # the call FREE on disk so none of it comes back at the next start.
            self.invalidate(slot_ids.tolist(), generations.tolist())
            self._table.abort_write(slot_ids)
            where = f"{written} of {n} pages written to {self._files.directory} before the failure"
            if exc.errno in NO_SPACE_ERRNOS:
                raise DiskFull(
                    f"NVMe tier out of space ({os.strerror(exc.errno)}); {where}; the pages "
                    "were not stored, drop them or free slots"
                ) from exc
            raise NvmeIOError(f"NVMe write failed ({exc}); {where}") from exc
        columns = zip(keys, namespaces, sums.tolist(), generations.tolist(), encoded, strict=True)
        entries = [SlotEntry(key, ns, c, g, h) for key, ns, c, g, h in columns]
        self._table.commit_write(slot_ids, generations, sums, crcs, entries)

    def _run(
        self, span: Span, fields: _HeaderFields, run: np.ndarray, source: Pages, direct: bool
    ) -> tuple[list[bytes], np.ndarray]:
        """Write one run of slots (header blocks and payloads, one ``pwritev``, plus the
        header block before the run's first payload when the run starts inside a group);
        returns each record's significant bytes and crc."""
        k = len(run)
        f = self._files
        g_size, r_bytes, p_bytes = f.slots_per_group, f.record_bytes, f.payload_bytes
        table, encoded = self._encode_headers(fields, run)
        crcs = table.reshape(-1).view(f.record)["crc"].copy()
        num_groups = len(span.groups)
        blocks = self._scratch.header_area(num_groups * HEADER_BYTES)
        records = np.frombuffer(blocks, dtype=np.uint8).reshape(num_groups * g_size, r_bytes)
        base = span.groups[0] * g_size
        lead = span.first % g_size != 0  # the first group's block sits before slots not ours
        pad = memoryview(self._zero_pad)[: p_bytes - f.page_bytes]
        staging = None if direct else self._scratch.staging_area(k * p_bytes)
        positions = run.tolist()
        locks = f.locks_for(span.file_index, span.shared)
        for lock in locks:
            lock.acquire()
        try:
            for gi, g in enumerate(span.groups):
                block = blocks[gi * HEADER_BYTES : (gi + 1) * HEADER_BYTES]
                offset = ALIGN + g * f.group_bytes
                if g not in span.shared or io.preadv_all(span.fd, [block], offset) < HEADER_BYTES:
                    records[gi * g_size : (gi + 1) * g_size] = 0
            records[span.first - base : span.end - base] = table
            if staging is not None:
                for j, i in enumerate(positions):
                    area = staging[j * p_bytes : (j + 1) * p_bytes]
                    area[: f.page_bytes] = source.view(i)
                    area[f.page_bytes :] = pad
            iov = self._runs.iov(span, positions, source, blocks, staging, pad)
            start = f.payload_offset(span.first) if lead else f.header_offset(span.first)
            io.pwritev_all(span.fd, iov, start)
            if lead:
                io.pwritev_all(span.fd, [blocks[:HEADER_BYTES]], f.header_offset(span.first))
        finally:
            for lock in reversed(locks):
                lock.release()
        return encoded, crcs

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
        rec = table.reshape(-1).view(self._files.record)
        rec["magic"] = SLOT_MAGIC
        rec["version"] = FORMAT_VERSION
        rec["state"] = int(SlotState.COMPLETE)
        rec["slot"] = f.slots[run]
        rec["generation"] = f.generations[run]
        rec["payload_bytes"] = self._files.page_bytes
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
        r = self._files.record_bytes
        ends = significant.tolist()
        for j in range(k):
            base = j * r
            fixed = zlib.crc32(area[base : base + RECORD.size])
            crcs[j] = zlib.crc32(area[base + TOKENS_AT : base + ends[j]], fixed)
        rec["crc"] = crcs
        encoded = [bytes(area[j * r : j * r + ends[j]]) for j in range(k)]
        return table, encoded

    def flush_frees(self) -> int:
        """Mark every releasing slot FREE on disk and make it allocatable; returns how many."""
        batch, generations = self._table.take_releasing()
        if batch:
            self.invalidate(batch, generations)
        self._table.finish_release(batch)
        return len(batch)

    def invalidate(self, slots: Sequence[int], generations: Sequence[int]) -> None:
        """Rewrite the records of ``slots`` FREE, one read-change-write per header block."""
        f = self._files
        by_block: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        g_size = f.slots_per_group
        for slot, generation in zip(slots, generations, strict=True):
            index, i = divmod(int(slot), f.slots_per_file)
            by_block.setdefault((index, i // g_size), []).append((int(slot), i % g_size, int(generation)))
        block = self._scratch.header_area(HEADER_BYTES)
        zero = bytes(KEY_BYTES)
        r = f.record_bytes
        for (index, group), items in sorted(by_block.items()):
            offset = ALIGN + group * f.group_bytes
            (lock,) = f.locks_for(index, [group])
            with lock:
                try:
                    if g_size > 1 and io.preadv_all(f.fds[index], [block], offset) < HEADER_BYTES:
                        block[:] = ZERO_HEADER
                    for slot, j, generation in items:
                        header = SlotHeader(slot, SlotState.FREE, generation, 0, 0, zero, zero)
                        header.encode_into(block[j * r : (j + 1) * r])
                    os.pwritev(f.fds[index], [block], offset)
                except OSError:
                    # Best effort: a stale COMPLETE record only brings back a verified,
                    # content-addressed page at the next start, never wrong bytes.
                    pass
