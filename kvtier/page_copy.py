"""Copy a run of pages and checksum it in one pass: the C++ kernel, or torch as fallback.

``copy_with_checksums(src, dst)`` leaves ``dst`` equal to ``src`` and returns each page's
wsum64/512 checksum (``kvtier.checksum``, the reference definition), bit for bit what
``page_checksums(dst)`` returns after a ``dst.copy_(src)``. The kernel
(``csrc/page_copy.cpp``) reads every word once, stores it and adds it into the page's sum
while it is in a register, instead of copying the run and reading it back out of cache.
It runs with the GIL released. Streaming (non-temporal) stores are available but off by
default: on the CI machine they were 0.93-1.05x plain stores, never a clear gain.

The kernel takes host tensors of one dtype and shape, contiguous; anything else (a CUDA
tensor, a strided view, a dtype conversion) goes through torch, as does everything when
the kernel cannot be built (one warning) or when ``KVTIER_PAGE_COPY=torch``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from kvtier.checksum import page_checksums
from kvtier.errors import FailedPrecondition
from kvtier.native import NativeExtension

logger = logging.getLogger("kvtier.page_copy")

ENV_VAR = "KVTIER_PAGE_COPY"  # "auto" (default): the kernel when it builds; "torch": never

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


def _kernel_takes(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return all(
        t.device.type == "cpu" and t.is_contiguous() and t.dtype == first.dtype and t.shape == first.shape
        for t in tensors
    ) and first.dim() >= 1


def copy_with_checksums(
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    streaming: bool = False,
    num_threads: int = 1,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """Copy the run of pages ``src [n, ...]`` into ``dst`` and return their checksums
    (int64 ``[n]``, two's complement of the unsigned values, on ``dst``'s device).

    ``streaming``: store with non-temporal stores (the kernel falls back to plain stores
    where the destination is not 64-byte aligned). ``num_threads``: threads that share a large
    run (the caller plus helpers from torch's inter-op pool, which take chunks from a
    shared counter: a helper that a busy core keeps from running delays nothing).
    ``use_kernel=False`` forces the torch path.
    """
    if src.shape[0] != dst.shape[0]:
        raise ValueError(f"copy of {src.shape[0]} pages into {dst.shape[0]}")
    if (use_kernel is None or use_kernel) and _kernel_takes(src, dst) and kernel_enabled():
        stream_min_bytes = 1 if streaming else 0
        return torch.ops.kvtier_page.copy_checksum(src, dst, stream_min_bytes, num_threads)
    dst.copy_(src)
    return page_checksums(dst)


def checksums(pages: torch.Tensor, *, use_kernel: bool | None = None) -> torch.Tensor:
    """``page_checksums(pages)`` through the kernel when it takes the tensor (one read pass)."""
    if (use_kernel is None or use_kernel) and _kernel_takes(pages) and kernel_enabled():
        return torch.ops.kvtier_page.checksum(pages)
    return page_checksums(pages)
