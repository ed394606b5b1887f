"""Page allocation and reference counting for one tier (DESIGN §5 decisions 1 and 4).

One pool is one tensor ``[num_pages, layers, 2, page_size, kv_heads, head_dim]``; a
page is one contiguous block, so moving a page is one copy. A pool of FP8 pages (geometry
dtype ``float8_e4m3fn`` or ``float8_e5m2``) is the byte tensor ``uint8 [num_pages, page_bytes]``
laid out by ``kvtier.domain.page_layout`` (codes, then scales); the engine views it as
codes and scales, and every tier copies and checksums it as the bytes it is.

Every page is in exactly one state, derived from two fields (never stored as a flag):

    ref_count > 0                 in use     held by one or more sequences
    ref_count == 0 and cached     cached     content kept for prefix reuse; the radix
                                             index may evict it (then it becomes free)
    ref_count == 0, not cached    free       in the free list, content meaningless

Freed cached pages stay reusable until allocation actually needs them (lazy
eviction), and eviction order is the index's business, not the pool's. Pins are a
separate counter: a pinned page is never moved away or evicted, whatever its
ref count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NewType

import numpy as np
import torch

from kvtier.domain.errors import IntegrityError
from kvtier.domain.page_layout import PageLayout

PageId = NewType("PageId", int)


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.float32

    @property
    def page_numel(self) -> int:
        return self.num_layers * 2 * self.page_size * self.kv_heads * self.head_dim

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_TORCH_DTYPES

    @property
    def fp8_format(self) -> str:
        """``e4m3`` or ``e5m2`` for an FP8 pool; empty for a float pool."""
        return FP8_TORCH_DTYPES.get(self.dtype, "")

    @property
    def layout(self) -> PageLayout:
        """Where the bytes of one page sit (codes and scales for FP8)."""
        kv_dtype = "fp8" if self.is_fp8 else _FLOAT_NAMES.get(self.dtype, "fp32")
        return PageLayout(kv_dtype, self.num_layers, 2, self.page_size, self.kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Exact bytes of one page in every tier; an FP8 page includes its scales."""
        if self.is_fp8:
            return self.layout.page_bytes
        return self.page_numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def storage_dtype(self) -> torch.dtype:
        """Element type of the pool tensor: the KV dtype, or bytes for FP8 pages."""
        return torch.uint8 if self.is_fp8 else self.dtype

    def tensor_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of a pool tensor of ``num_pages`` pages (page-major in both cases)."""
        if self.is_fp8:
            return (num_pages, self.page_bytes)
        return (num_pages, self.num_layers, 2, self.page_size, self.kv_heads, self.head_dim)

    @property
    def dtype_name(self) -> str:
        """The element type as NVMe superblocks record it (``float8_e4m3fn``, ``bfloat16``, ...)."""
        return str(self.dtype).removeprefix("torch.")

    def pages_for_bytes(self, num_bytes: int) -> int:
        return num_bytes // self.page_bytes


FP8_TORCH_DTYPES: dict[torch.dtype, str] = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_FLOAT_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True, slots=True)
class PoolCounts:
    total: int
    free: int
    cached: int
    in_use: int
    pinned: int


class PagePool:
    """Allocates pages of one tier and counts who holds them.

    Contract: every ``acquire``/``allocate`` is matched by exactly one ``release``.
    ``release`` of a page whose count is already 0 raises (a double release is a bug
    that would otherwise hand one page to two sequences).
    """

    def __init__(
        self,
        num_pages: int,
        geometry: PoolGeometry,
        device: torch.device | str = "cpu",
        *,
        pin_memory: bool = False,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.geometry = geometry
        self.num_pages = num_pages
        g = geometry
        self.tensor = torch.zeros(
            g.tensor_shape(num_pages), dtype=g.storage_dtype, device=device, pin_memory=pin_memory
        )
        self._ref = [0] * num_pages
        self._pins = [0] * num_pages
        self._cached = [False] * num_pages
        self._free: deque[PageId] = deque(PageId(i) for i in range(num_pages))
        # A mirror of free-list membership, not a state of its own (check_integrity holds the
        # two equal): a bytearray, as cheap to set as a list item, that numpy reads without
        # a copy, so a transfer of thousands of pages checks them in one gather
        # (``free_mask``) instead of one Python call per page.
        self._is_free = bytearray(b"\x01") * num_pages
        self._is_free_view = np.frombuffer(self._is_free, dtype=np.bool_)
        self._num_in_use = 0
        self._num_cached_idle = 0
        # Called when a cached page drops to ref 0 (the index may now evict it).
        self.on_idle: Callable[[PageId], None] | None = None
        # Called when an idle cached page is taken again (ref 0 -> 1).
        self.on_held: Callable[[PageId], None] | None = None

    # ---- counts -------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_idle(self) -> int:
        return self._num_cached_idle

    @property
    def num_in_use(self) -> int:
        return self._num_in_use

    def counts(self) -> PoolCounts:
        return PoolCounts(
            total=self.num_pages,
            free=self.num_free,
            cached=self._num_cached_idle,
            in_use=self._num_in_use,
            pinned=sum(1 for p in self._pins if p > 0),
        )

    def ref_count(self, page: PageId) -> int:
        return self._ref[page]

    def is_cached(self, page: PageId) -> bool:
        return self._cached[page]

    def is_pinned(self, page: PageId) -> bool:
        return self._pins[page] > 0

    def free_mask(self, pages: np.ndarray) -> np.ndarray:
        """Whether each of ``pages`` (an int array of valid ids) is free, in one gather."""
        mask: np.ndarray = self._is_free_view[pages]
        return mask

    def is_shared(self, page: PageId) -> bool:
        """Another holder (a sequence or the index) could observe a write to this page."""
        return self._ref[page] > 1 or self._cached[page]

    # ---- allocation ---------------------------------------------------------------
    def allocate(self) -> PageId | None:
        """A free page with ref count 1, or None when the free list is empty.

        None is pressure, not an error: the caller evicts from the index or preempts.
        """
        if not self._free:
            return None
        page = self._free.popleft()
        self._is_free[page] = 0
        self._ref[page] = 1
        self._num_in_use += 1
        return page

    def acquire(self, page: PageId) -> None:
        """Take one more reference on a page that is in use or cached."""
        if self._ref[page] == 0:
            if not self._cached[page]:
                raise IntegrityError(f"acquire of free page {page}")
            self._num_cached_idle -= 1
            self._num_in_use += 1
            self._ref[page] = 1
            if self.on_held is not None:
                self.on_held(page)
            return
        self._ref[page] += 1

    def release(self, page: PageId) -> None:
        if self._ref[page] <= 0:
            raise IntegrityError(f"release of page {page} whose ref count is {self._ref[page]}")
        self._ref[page] -= 1
        if self._ref[page] == 0:
            self._num_in_use -= 1
            if self._cached[page]:
                self._num_cached_idle += 1
                if self.on_idle is not None:
                    self.on_idle(page)
            else:
                self._free.append(page)
                self._is_free[page] = 1

    # ---- cache membership (called by the radix index only) ------------------------
    def mark_cached(self, page: PageId) -> None:
        if self._cached[page]:
            raise IntegrityError(f"page {page} is already cached")
        if self._ref[page] == 0:
            raise IntegrityError(f"only a page in use can become cached (page {page} is free)")
        self._cached[page] = True

    def unmark_cached(self, page: PageId) -> None:
        """Forget the page's content; a page nobody holds goes back to the free list."""
        if not self._cached[page]:
            raise IntegrityError(f"page {page} is not cached")
        if self._pins[page] > 0:
            raise IntegrityError(f"page {page} is pinned and cannot leave the cache")
        self._cached[page] = False
        if self._ref[page] == 0:
            self._num_cached_idle -= 1
            self._free.append(page)
            self._is_free[page] = 1

    # ---- pins ---------------------------------------------------------------------
    def pin(self, page: PageId) -> None:
        if self._ref[page] == 0 and not self._cached[page]:
            raise IntegrityError(f"cannot pin free page {page}")
        self._pins[page] += 1

    def unpin(self, page: PageId) -> None:
        if self._pins[page] <= 0:
            raise IntegrityError(f"unpin of page {page} that is not pinned")
        self._pins[page] -= 1

    # ---- data ---------------------------------------------------------------------
    def copy_on_write(self, page: PageId) -> PageId | None:
        """Give the caller a private copy of a shared page it holds one reference on.

        Returns the page itself when nobody else can see writes to it, a fresh copy
        (the caller's reference moves to it) otherwise, or None when no page is free.
        """
        if not self.is_shared(page):
            return page
        copy = self.allocate()
        if copy is None:
            return None
        self.tensor[copy].copy_(self.tensor[page])
        self.release(page)
        return copy

    def check_integrity(self) -> None:
        """Raise with the numbers when the page accounting does not add up."""
        free = set(self._free)
        problems: list[str] = []
        if len(free) != len(self._free):
            problems.append("a page appears twice in the free list")
        in_use = sum(1 for r in self._ref if r > 0)
        cached_idle = sum(1 for r, c in zip(self._ref, self._cached, strict=True) if r == 0 and c)
        if any(r < 0 for r in self._ref):
            problems.append("negative ref count")
        if any(p < 0 for p in self._pins):
            problems.append("negative pin count")
        for page in free:
            if self._ref[page] != 0 or self._cached[page]:
                problems.append(f"free page {page} has ref {self._ref[page]} cached={self._cached[page]}")
                break
        flagged = np.flatnonzero(self._is_free_view)
        if len(flagged) != len(free) or not free.issuperset(flagged.tolist()):
            problems.append(f"{len(flagged)} pages flagged free, {len(free)} in the free list")
        if in_use != self._num_in_use or cached_idle != self._num_cached_idle:
            problems.append(
                f"counters drifted: in_use {self._num_in_use} (actual {in_use}), "
                f"cached {self._num_cached_idle} (actual {cached_idle})"
            )
        if len(free) + cached_idle + in_use != self.num_pages:
            problems.append(
                f"free {len(free)} + cached {cached_idle} + in_use {in_use} != total {self.num_pages}"
            )
        if problems:
            raise IntegrityError("page pool integrity: " + "; ".join(problems))
