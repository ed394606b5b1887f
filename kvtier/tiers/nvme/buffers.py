"""Memory the NVMe tier reads into and writes from: page-aligned (huge-page backed) buffers
for O_DIRECT, per-thread scratch areas, and zero-copy byte views of page tensors.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvtier.domain.errors import InvalidArgument
from kvtier.tiers.dram import (
    CAN_ADVISE_HUGE_PAGES,
    HUGE_PAGE_BYTES,
    aligned_host_tensor,
)
from kvtier.tiers.nvme.format import ALIGN, HUGE_FROM_BYTES, round_up


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


class Pages(NamedTuple):
    """Byte views of the pages of one call, and where they are adjacent in memory: with
    ``whole`` (one tensor's bytes) page ``i`` is row ``rows[i]`` of it, so consecutive rows go
    out as one iovec segment. ``view(i)`` slices page ``i`` on demand: a run of consecutive rows
    goes out as one segment and never needs its pages one by one."""

    listed: list[memoryview] | None  # a list of page tensors: one view each
    whole: memoryview | None
    rows: np.ndarray | None
    page_bytes: int

    def view(self, i: int) -> memoryview:
        if self.listed is not None:
            return self.listed[i]
        assert self.whole is not None and self.rows is not None
        r = int(self.rows[i])
        return self.whole[r * self.page_bytes : (r + 1) * self.page_bytes]


def page_views(
    pages: torch.Tensor | Sequence[torch.Tensor], n: int, page_bytes: int, rows: np.ndarray | None = None
) -> Pages:
    """Zero-copy byte views of ``n`` pages: one conversion for a tensor (a run ``[n, ...]``,
    or a pool ``[N, ...]`` whose pages ``rows`` are meant), one per page of a list."""
    if isinstance(pages, torch.Tensor):
        whole = _byte_view(pages)
        if rows is None:
            if len(whole) != n * page_bytes:
                raise InvalidArgument(
                    f"{n} pages of {page_bytes} bytes expected, got a tensor of {len(whole)} bytes"
                )
            return Pages(None, whole, np.arange(n, dtype=np.int64), page_bytes)
        num_rows = pages.shape[0] if pages.dim() else 0
        if len(whole) != num_rows * page_bytes:
            raise InvalidArgument(f"a pool of {page_bytes}-byte pages expected, got {tuple(pages.shape)}")
        if len(rows) and not (0 <= int(rows.min()) and int(rows.max()) < num_rows):
            raise InvalidArgument(f"page rows out of range [0, {num_rows})", field="rows")
        return Pages(None, whole, rows, page_bytes)
    if rows is not None:
        raise InvalidArgument("rows select pages of one pool tensor, got a list of pages", field="rows")
    views = [_byte_view(p) for p in pages]
    bad = [len(v) for v in views if len(v) != page_bytes]
    if bad:
        raise InvalidArgument(f"a page of {bad[0]} bytes, the pool's pages have {page_bytes}")
    return Pages(views, None, None, page_bytes)



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
