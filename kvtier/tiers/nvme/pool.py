"""The NVMe tier: fixed-size page slots in preallocated files (DESIGN §6, decision record 0002).

``NvmePool`` composes parts that each own their state: the slot files and their layout
(``files.SlotFiles``), the slot table (``slots.SlotTable``), the write and read paths
(``writer.SlotWriter``, ``reader.SlotReader``) and recovery (``recovery.SlotRecovery``); the
on-disk format is ``format``. Its methods delegate.

Concurrency: ``write_pages``/``read_pages`` run in transfer worker threads while the
engine thread allocates and frees; the slot table is guarded by one lock and the I/O
runs outside it (positional I/O needs no shared file offset). A caller never frees a
slot that has a read or write in flight.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvtier.cache.page_pool import PoolGeometry
from kvtier.domain.errors import ConfigError
from kvtier.domain.hashing import NamespaceDigest, PageKey
from kvtier.tiers.nvme.buffers import Scratch
from kvtier.tiers.nvme.files import SlotFiles
from kvtier.tiers.nvme.format import (
    DEFAULT_FILE_BYTES,
    SlotId,
    SlotLocation,
    SlotVerdict,
    SyncPolicy,
    group_layout,
    slot_bytes_for,
)
from kvtier.tiers.nvme.io import Runs
from kvtier.tiers.nvme.reader import SlotReader
from kvtier.tiers.nvme.recovery import RecoveryReport, SlotRecovery
from kvtier.tiers.nvme.slots import NvmeCounts, SlotTable
from kvtier.tiers.nvme.writer import SlotWriter


class NvmePool:
    """Page slots on local disk. Slot lifecycle (in memory; the disk state follows it):

        free --allocate--> reserved --write_pages--> stored --free--> releasing
         ^ ^                 │ ^                                         │ │
         │ └─ free, DiskFull ┘ └──────── allocate (when free is short) ──┘ │
         └──────────────── flush_frees (header rewritten FREE) ────────────┘

    Contract: ``write_pages`` takes reserved slots and makes them stored; on ``DiskFull``
    or ``NvmeIOError`` every slot of that call is free again (the pool took the release).
    ``read_pages`` takes stored slots and never frees. Each allocation is freed once.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        num_slots: int,
        geometry: PoolGeometry,
        *,
        create: bool = True,
        sync: SyncPolicy = SyncPolicy.NONE,
        slots_per_file: int | None = None,
        direct_io: bool | None = None,
        verify_payload_on_recover: bool = True,
        max_io_bytes: int = 16 << 20,
    ) -> None:
        if num_slots < 1:
            raise ConfigError(f"nvme num_slots must be >= 1, got {num_slots}", field="nvme.num_slots")
        self.directory = Path(directory)
        self.geometry = geometry
        self.num_slots = num_slots
        self.sync = sync
        self.page_bytes = geometry.page_bytes
        self.layout = layout = group_layout(geometry)
        self.payload_bytes = layout.payload_bytes
        self.slots_per_group = layout.slots_per_group
        self.record_bytes = layout.record_bytes
        self.group_bytes = layout.group_bytes
        self.max_tokens_per_slot = layout.max_tokens
        self.slot_bytes = slot_bytes_for(geometry)
        self.slots_per_file = slots_per_file or max(1, min(num_slots, DEFAULT_FILE_BYTES // self.slot_bytes))
        # Whole groups per run where possible, up to max_io_bytes: one 16 MiB run of 32 KiB pages
        # is 512 slots. A run whose iovecs exceed IOV_MAX (pages scattered in memory: a payload
        # and a pad per slot) goes out in several calls (io.preadv_all, io.pwritev_all).
        per_io = max(1, max_io_bytes // self.payload_bytes)
        self.max_slots_per_io = max(1, per_io - per_io % self.slots_per_group or per_io)
        self.table = SlotTable(num_slots)
        self.files = SlotFiles(
            self.directory, num_slots, geometry, layout, self.slots_per_file, create=create, direct_io=direct_io
        )
        runs = Runs(self.files, self.max_slots_per_io)
        scratch = Scratch(self.record_bytes)
        self.writer = SlotWriter(self.files, self.table, runs, scratch, sync, layout.max_tokens)
        self.reader = SlotReader(self.files, self.table, runs, scratch)
        self._recovery = SlotRecovery(
            self.files,
            self.table,
            self.writer,
            max_slots_per_io=self.max_slots_per_io,
            verify_payload=verify_payload_on_recover,
        )
        try:
            self.recovery = self.recover()
        except BaseException:
            self.files.close()
            raise

    # ---- files ------------------------------------------------------------------------
    @property
    def is_direct(self) -> bool:
        return self.files.is_direct

    @property
    def num_files(self) -> int:
        return self.files.num_files

    def slots_in_file(self, index: int) -> int:
        return self.files.slots_in_file(index)

    def file_bytes(self, index: int) -> int:
        return self.files.file_bytes(index)

    def locate(self, slot: SlotId | int) -> SlotLocation:
        """Where ``slot``'s record and payload are on disk (for tools and fault tests)."""
        return self.files.locate(slot)

    def close(self) -> None:
        if self.files.fds:
            self.writer.flush_frees()
        self.files.close()

    def __enter__(self) -> NvmePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- slot table -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.table.num_free

    @property
    def num_used(self) -> int:
        return self.table.num_used

    def counts(self) -> NvmeCounts:
        return self.table.counts()

    def allocate(self) -> SlotId | None:
        return self.table.allocate()

    def allocate_many(self, n: int) -> list[SlotId] | None:
        return self.table.allocate_many(n)

    def free(self, slot: SlotId) -> None:
        self.table.free(slot)

    def entry(self, slot: SlotId) -> tuple[PageKey, NamespaceDigest, int] | None:
        return self.table.entry(slot)

    def is_reserved(self, slot: SlotId) -> bool:
        return self.table.is_reserved(slot)

    def reserved_mask(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.table.reserved_mask(slots)

    def stored_mask(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.table.stored_mask(slots)

    def stored_checksums(self, slots: Sequence[SlotId] | np.ndarray) -> np.ndarray:
        return self.table.stored_checksums(slots)

    def lookup(self, key: PageKey, namespace: NamespaceDigest) -> SlotId | None:
        return self.table.lookup(key, namespace)

    def check_integrity(self) -> None:
        self.table.check_integrity()

    # ---- I/O --------------------------------------------------------------------------
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
        """See ``SlotWriter.write_pages``."""
        self.writer.write_pages(
            slots, pages, keys, namespaces, checksums, parents=parents, tokens=tokens, rows=rows
        )

    def read_pages(
        self, slots: Sequence[SlotId], out: torch.Tensor | Sequence[torch.Tensor]
    ) -> list[SlotVerdict]:
        """See ``SlotReader.read_pages``."""
        return self.reader.read_pages(slots, out)

    def flush_frees(self) -> int:
        """Mark every releasing slot FREE on disk and make it allocatable; returns how many."""
        return self.writer.flush_frees()

    def recover(self) -> RecoveryReport:
        """Rebuild the slot table from disk (see ``SlotRecovery.recover``). Called by the
        constructor; calling it again needs a pool with no reserved slot."""
        return self._recovery.recover()
