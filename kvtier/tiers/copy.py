"""Copy a run of pages and checksum it in one pass: the C++ kernel, or torch as fallback.

``copy_with_checksums(src, dst)`` leaves ``dst`` equal to ``src`` and returns each page's
wsum64/512 checksum (``kvtier.tiers.checksum``, the reference definition), bit for bit what
``page_checksums(dst)`` returns after a ``dst.copy_(src)``. The kernel
(``csrc/page_copy.cpp``) reads every word once, stores it and adds it into the page's sum
while it is in a register, instead of copying the run and reading it back out of cache.
It runs with the GIL released. Copies of at least ``STREAM_MIN_BYTES`` store with
streaming (non-temporal) stores by default: a plain store first reads the destination line
into cache (a third memory transfer per line), and a copy that large evicts itself from
the caches anyway. On a 2-core AMD EPYC (AVX2) the one-thread kernel copied 64 MiB
at 5.5-6.3 GB/s with streaming stores, 3.6-4.6 with plain ones, memcpy 4.2-4.9
(decision 0005). Smaller copies use plain stores, so a promoted page the engine reads
next is still in cache.

``copy_pages_with_checksums(src_pool, dst_pool, src_ids, dst_ids)`` does the same for
scattered pages named by id: the kernel walks the id arrays itself, so a submission of
8192 small pages is one call with the GIL released instead of one call (and a few
microseconds of Python) per run of consecutive pages.

The kernel takes host tensors of one dtype and page shape, contiguous; anything else (a
CUDA tensor, a strided view, a dtype conversion) goes through torch, as does everything
when the kernel cannot be built (one warning) or when ``KVTIER_PAGE_COPY=torch``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvtier.domain.errors import FailedPrecondition
from kvtier.tiers.checksum import page_checksums
from kvtier.tiers.native import NativeExtension

logger = logging.getLogger("kvtier.tiers.copy")

ENV_VAR = "KVTIER_PAGE_COPY"  # "auto" (default): the kernel when it builds; "torch": never
STREAM_MIN_BYTES = 1 << 20  # copies (or parts) from this size up store with streaming stores

_EXTENSION = NativeExtension(
    "kvtier_page_copy",
    Path(__file__).parent / "csrc" / "page_copy.cpp",
    what="page copy kernel",
    fallback_hint=f"set {ENV_VAR}=torch",
    extra_ldflags=(),
)
_warned = False


def load_kernel() -> None:
    """Build or load the kernel; raise ``FailedPrecondition`` naming the cause if impossible."""
    _EXTENSION.load()


def kernel_enabled() -> bool:
    """Whether calls use the C++ kernel (built, and not disabled by ``KVTIER_PAGE_COPY``)."""
    global _warned
    mode = os.environ.get(ENV_VAR, "auto").strip().lower()
    if mode == "torch":
        return False
    if mode not in ("", "auto"):
        raise FailedPrecondition(f"{ENV_VAR} must be 'auto' or 'torch', got {mode!r}")
    try:
        load_kernel()
    except FailedPrecondition as exc:
        if not _warned:
            _warned = True
            logger.warning("page copies fall back to torch (copy, then checksum): %s", exc)
        return False
    return True


def _stream_min_bytes(streaming: bool | None) -> int:
    """The kernel's threshold: 1 always streams, 0 never, ``STREAM_MIN_BYTES`` by size."""
    if streaming is None:
        return STREAM_MIN_BYTES
    return 1 if streaming else 0


def _kernel_takes(*tensors: torch.Tensor, same_num_pages: bool = True) -> bool:
    first = tensors[0]
    shape = first.shape if same_num_pages else first.shape[1:]
    return (
        all(
            t.device.type == "cpu"
            and t.is_contiguous()
            and t.dtype == first.dtype
            and (t.shape if same_num_pages else t.shape[1:]) == shape
            for t in tensors
        )
        and first.dim() >= 1
    )


def copy_with_checksums(
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    streaming: bool | None = None,
    num_threads: int = 1,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """Copy the run of pages ``src [n, ...]`` into ``dst`` and return their checksums
    (int64 ``[n]``, two's complement of the unsigned values, on ``dst``'s device).

    ``streaming``: store with non-temporal stores (``True``), plain stores (``False``), or
    streaming stores for runs of at least ``STREAM_MIN_BYTES`` (``None``, the default); the
    kernel falls back to plain stores where the destination is not 64-byte aligned. ``num_threads``: threads that share a large
    run (the caller plus helpers from torch's inter-op pool, which take chunks from a
    shared counter: a helper that a busy core keeps from running delays nothing).
    ``use_kernel=False`` forces the torch path.
    """
    if src.shape[0] != dst.shape[0]:
        raise ValueError(f"copy of {src.shape[0]} pages into {dst.shape[0]}")
    if (use_kernel is None or use_kernel) and _kernel_takes(src, dst) and kernel_enabled():
        stream_min_bytes = _stream_min_bytes(streaming)
        return torch.ops.kvtier_page.copy_checksum(src, dst, stream_min_bytes, num_threads)
    dst.copy_(src)
    return page_checksums(dst)


def checksums(pages: torch.Tensor, *, use_kernel: bool | None = None) -> torch.Tensor:
    """``page_checksums(pages)`` through the kernel when it takes the tensor (one read pass)."""
    if (use_kernel is None or use_kernel) and _kernel_takes(pages) and kernel_enabled():
        return torch.ops.kvtier_page.checksum(pages)
    return page_checksums(pages)


def copy_pages_with_checksums(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    out: np.ndarray | None = None,
    *,
    part_pages: int | None = None,
    before_part: Callable[[int], None] | None = None,
    streaming: bool | None = None,
    num_threads: int = 1,
    use_kernel: bool | None = None,
) -> np.ndarray:
    """Copy page ``src[src_ids[i]]`` into ``dst[dst_ids[i]]`` for every i (pools
    ``[num_pages, ...]``, ids int64, no destination twice) and return each copied page's
    checksum as uint64, written into ``out`` when given (a uint64 array of the same length).

    The pairs go in parts of ``part_pages`` (all at once by default); ``before_part(i)``
    runs before the part that starts at pair i (pairs before i are copied), so a caller can
    stop between parts by raising. The ids are checked and converted once; each part is
    one kernel call with the GIL released. The torch fallback copies each run of pages that
    are consecutive on both sides with ``copy_with_checksums``. ``streaming`` and
    ``num_threads`` as for ``copy_with_checksums``.
    """
    n = len(src_ids)
    if len(dst_ids) != n:
        raise ValueError(f"{n} source pages but {len(dst_ids)} destination pages")
    if out is None:
        out = np.empty(n, dtype=np.uint64)
    elif out.dtype != np.uint64 or out.shape != (n,) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint64 array of {n} checksums")
    step = max(1, part_pages or n)
    if (
        (use_kernel is None or use_kernel)
        and _kernel_takes(src, dst, same_num_pages=False)
        and kernel_enabled()
    ):
        # Writable copies: torch warns about (and does not promise to respect) read-only
        # arrays, such as a transfer's pairs.
        src_t = torch.from_numpy(np.require(src_ids, np.int64, ["C", "W"]))
        dst_t = torch.from_numpy(np.require(dst_ids, np.int64, ["C", "W"]))
        out_t = torch.from_numpy(out.view(np.int64))
        stream_min_bytes = _stream_min_bytes(streaming)
        op = torch.ops.kvtier_page.copy_checksum_pages
        for a in range(0, n, step):
            if before_part is not None:
                before_part(a)
            op(src, dst, src_t, dst_t, out_t, a, min(n, a + step), stream_min_bytes, num_threads)
        return out
    src_ids = np.asarray(src_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_ids, dtype=np.int64)
    for a in range(0, n, step):
        if before_part is not None:
            before_part(a)
        b = min(n, a + step)
        # Runs where both ids advance by one: one slice copy each.
        breaks = a + 1 + np.flatnonzero((np.diff(src_ids[a:b]) != 1) | (np.diff(dst_ids[a:b]) != 1))
        for lo, hi in zip([a, *breaks.tolist()], [*breaks.tolist(), b], strict=True):
            s0, d0 = int(src_ids[lo]), int(dst_ids[lo])
            sums = copy_with_checksums(
                src[s0 : s0 + hi - lo], dst[d0 : d0 + hi - lo], use_kernel=use_kernel, streaming=streaming
            )
            out[lo:hi] = sums.cpu().numpy().view(np.uint64)
    return out
