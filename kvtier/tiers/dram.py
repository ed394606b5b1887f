"""The DRAM tier: a host page pool (pinned when CUDA is present) whose pages carry checksums.

A DRAM page is an ordinary ``PagePool`` page (same layout, ref counts, cache flags), plus
the checksum of its bytes taken when the page left HBM (or read from the NVMe slot it
came back from). The checksum array is aligned to page ids:

    checksums[p]   valid only while has_checksum[p]
    has_checksum   cleared when the page returns to the free list

The pool tensor starts on a 4096-byte boundary and every page of a pool whose page size
is a multiple of 4096 bytes does too, so the NVMe tier reads and writes pages straight
into it with O_DIRECT (no bounce buffer). Unpinned pools are backed by transparent huge
pages where the kernel offers them (``MADV_HUGEPAGE``; Linux's default THP mode is
"madvise"): an O_DIRECT read must pin every destination page, and into 2 MiB pages it
ran at 3.3-3.9 GB/s on the CI VM against 1.3-1.4 GB/s into 4 KiB pages (decision 0002).
The pool's memory is faulted in when the pool is made, not under the first transfers.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.cache.page_pool import PageId, PagePool, PoolGeometry
from kvtier.domain.errors import IntegrityError
from kvtier.tiers.checksum import to_unsigned

IO_ALIGN_BYTES = 4096
HUGE_PAGE_BYTES = 2 << 20
CAN_ADVISE_HUGE_PAGES = all(hasattr(mmap, name) for name in ("MADV_HUGEPAGE", "MAP_PRIVATE", "MAP_ANONYMOUS"))


def aligned_host_tensor(
    num_bytes: int, *, pin_memory: bool = False, align: int = IO_ALIGN_BYTES
) -> torch.Tensor:
    """An uninitialised uint8 host tensor of ``num_bytes`` whose first byte is ``align``-aligned.

    Unpinned tensors of at least one huge page come from a private anonymous mapping
    advised ``MADV_HUGEPAGE`` and start on a huge-page boundary (zero-filled on first
    touch, like any fresh allocation)."""
    if not pin_memory and CAN_ADVISE_HUGE_PAGES and num_bytes >= HUGE_PAGE_BYTES:
        return _huge_page_tensor(num_bytes, max(align, HUGE_PAGE_BYTES))
    backing = torch.empty(num_bytes + align, dtype=torch.uint8, pin_memory=pin_memory)
    start = (-backing.data_ptr()) % align
    return backing[start : start + num_bytes]  # the view keeps ``backing`` alive


def _huge_page_tensor(num_bytes: int, align: int) -> torch.Tensor:
    region = mmap.mmap(-1, num_bytes + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    backing = torch.frombuffer(region, dtype=torch.uint8)  # holds ``region`` for its lifetime
    start = (-backing.data_ptr()) % align
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, num_bytes - num_bytes % HUGE_PAGE_BYTES)
    except OSError:
        pass  # THP disabled ("never") or unsupported: 4 KiB pages, correct and slower
    return backing[start : start + num_bytes]


class DramPool(PagePool):
    """Host tier. Contract on checksums: a page holds data only after a transfer put it
    there, and that transfer records the page's checksum (``set_checksums``) before it is
    acknowledged; ``checksum`` of a page without one returns ``None``.
    """

    def __init__(self, num_pages: int, geometry: PoolGeometry, *, pin_memory: bool | None = None) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        # The base class allocates nothing on the meta device; the aligned host tensor
        # replaces it (PagePool only ever reads ``self.tensor``).
        super().__init__(num_pages, geometry, device="meta")
        g = geometry
        raw = aligned_host_tensor(num_pages * g.page_bytes, pin_memory=pin_memory)
        if not pin_memory:
            # Fault every page in now, once: faulting huge pages in lazily, under a
            # demotion, slowed the decode steps running beside it 2-4x on the CI VM
            # (pinned memory is resident from the start anyway).
            raw.zero_()
        self.tensor = raw.view(g.storage_dtype).view(g.tensor_shape(num_pages))
        self.is_pinned_memory = pin_memory
        self._checksums = np.zeros(num_pages, dtype=np.uint64)
        self._has_checksum = np.zeros(num_pages, dtype=bool)

    @property
    def is_io_aligned(self) -> bool:
        """Every page starts on a 4096-byte boundary (O_DIRECT can target it directly)."""
        return self.tensor.data_ptr() % IO_ALIGN_BYTES == 0 and self.geometry.page_bytes % IO_ALIGN_BYTES == 0

    # ---- checksums ------------------------------------------------------------------
    def set_checksums(
        self, pages: Sequence[PageId] | np.ndarray, checksums: Sequence[int] | np.ndarray
    ) -> None:
        """Record checksums (unsigned ints, or a uint64/int64 array as ``page_checksums`` gives)."""
        if len(pages) != len(checksums):
            raise ValueError(f"{len(pages)} pages but {len(checksums)} checksums")
        idx = np.asarray(pages, dtype=np.int64)
        if isinstance(checksums, np.ndarray) and checksums.dtype in (np.uint64, np.int64):
            values = checksums.view(np.uint64)
        else:
            values = np.asarray([to_unsigned(int(c)) for c in checksums], dtype=np.uint64)
        self._checksums[idx] = values
        self._has_checksum[idx] = True

    def checksum(self, page: PageId) -> int | None:
        return int(self._checksums[page]) if self._has_checksum[page] else None

    def checksum_array(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(checksums uint64, present bool)`` for an array of page ids, in one gather."""
        return self._checksums[pages], self._has_checksum[pages]

    def checksums_of(self, pages: Sequence[PageId]) -> list[int | None]:
        return [self.checksum(p) for p in pages]

    def clear_checksum(self, page: PageId) -> None:
        self._has_checksum[page] = False

    # A page that goes back to the free list forgets its checksum, so a stale value can
    # never vouch for the next content of that page.
    def release(self, page: PageId) -> None:
        super().release(page)
        if self.ref_count(page) == 0 and not self.is_cached(page):
            self._has_checksum[page] = False

    def unmark_cached(self, page: PageId) -> None:
        super().unmark_cached(page)
        if self.ref_count(page) == 0:
            self._has_checksum[page] = False

    def check_integrity(self) -> None:
        super().check_integrity()
        stale = [
            p
            for p in np.flatnonzero(self._has_checksum).tolist()
            if self.ref_count(PageId(p)) == 0 and not self.is_cached(PageId(p))
        ]
        if stale:
            raise IntegrityError(
                f"dram pool integrity: {len(stale)} free pages keep a checksum (first {stale[0]})"
            )


def make_dram_pool(num_pages: int, geometry: PoolGeometry, *, pin_memory: bool | None = None) -> DramPool:
    return DramPool(num_pages, geometry, pin_memory=pin_memory)


def dram_pool_for_bytes(
    capacity_bytes: int, geometry: PoolGeometry, *, pin_memory: bool | None = None
) -> DramPool:
    """A DRAM tier holding as many whole pages as ``capacity_bytes`` allows."""
    num_pages = geometry.pages_for_bytes(capacity_bytes)
    if num_pages < 1:
        raise ValueError(
            f"dram capacity {capacity_bytes} bytes is smaller than one page ({geometry.page_bytes} bytes)"
        )
    return DramPool(num_pages, geometry, pin_memory=pin_memory)
