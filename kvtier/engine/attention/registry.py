"""Attention backends by name, and the start-up choice among them.

    name               device  needs
    torch-reference    any     nothing (gather + SDPA; the oracle)
    cpu-fused          cpu     a C++ compiler and ninja (built on first use, cached)
    flash-attn         cuda    flash-attn >= 2.6, fp16/bf16 pool, page_size % 256 == 0
    triton             cuda    triton (any page size; fp32/fp16/bf16 pool)

``auto`` takes the fastest one that works here: on CUDA, flash-attn when importable (and the
page size fits, if given), else triton when importable, else torch-reference; on CPU,
cpu-fused when its kernel builds, else torch-reference.
``KVTIER_ATTENTION_BACKEND`` replaces ``auto`` (an explicit name passed by the caller wins,
since it already is a configured choice). The resolved choice is logged once per process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

from kvtier.domain.errors import FailedPrecondition, InvalidArgument
from kvtier.engine.attention.base import AttentionBackend, ReferenceBackend

logger = logging.getLogger("kvtier.engine.attention")

ENV_VAR = "KVTIER_ATTENTION_BACKEND"
AUTO = "auto"


def _cpu_fused() -> AttentionBackend:
    from kvtier.engine.attention.cpu_fused import CpuFusedBackend

    return CpuFusedBackend()


def _flash_attn() -> AttentionBackend:
    from kvtier.engine.attention.cuda import FlashAttnBackend

    return FlashAttnBackend()


def _triton() -> AttentionBackend:
    from kvtier.engine.attention.triton_paged import TritonPagedBackend

    return TritonPagedBackend()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch-reference": ReferenceBackend,
    "cpu-fused": _cpu_fused,
    "flash-attn": _flash_attn,
    "triton": _triton,
}
_DEVICE_TYPES = {"cpu-fused": "cpu", "flash-attn": "cuda", "triton": "cuda"}

_logged: set[tuple[str, str, str]] = set()
_log_lock = threading.Lock()


def known_backends() -> list[str]:
    return [AUTO, *sorted(BACKENDS)]


def _auto(device: torch.device, page_size: int | None) -> tuple[str, str]:
    """Return (backend name, why) for ``auto`` on ``device``."""
    if device.type == "cuda":
        from kvtier.engine.attention.cuda import FlashAttnBackend, flash_attn_installed
        from kvtier.engine.attention.triton_paged import load_kernels

        if not flash_attn_installed():
            no_flash = "flash-attn is not installed"
        elif page_size is not None and not FlashAttnBackend.supports(page_size):
            no_flash = f"flash-attn needs page_size % 256 == 0, pool has {page_size}"
        else:
            return "flash-attn", "CUDA device with flash-attn"
        try:
            load_kernels()
        except FailedPrecondition as exc:
            return "torch-reference", f"{no_flash}; {exc}"
        return "triton", f"{no_flash}; triton kernels importable"
    if device.type == "cpu":
        from kvtier.engine.attention.cpu_fused import load_kernel

        try:
            load_kernel()
        except FailedPrecondition as exc:
            return "torch-reference", str(exc)
        return "cpu-fused", "C++ kernel built"
    return "torch-reference", f"no fused backend for device type {device.type!r}"


def get_backend(
    name: str = AUTO, device: torch.device | str = "cpu", *, page_size: int | None = None
) -> AttentionBackend:
    """Build the attention backend called ``name`` for pools on ``device``.

    Raises ``InvalidArgument`` for an unknown name or a backend that cannot serve the
    device, ``FailedPrecondition`` when an explicitly named backend is not installed.
    """
    device = torch.device(device)
    requested = name
    if name == AUTO:
        requested = os.environ.get(ENV_VAR, "").strip() or AUTO
    if requested != AUTO and requested not in BACKENDS:
        source = f"{ENV_VAR}={requested!r}" if requested != name else repr(requested)
        raise InvalidArgument(
            f"unknown attention backend {source}; known: {', '.join(known_backends())}",
            field="attention_backend",
        )
    if requested == AUTO:
        chosen, why = _auto(device, page_size)
    else:
        chosen, why = requested, "explicit" if requested == name else f"from {ENV_VAR}"
        wanted = _DEVICE_TYPES.get(chosen)
        if wanted is not None and wanted != device.type:
            raise InvalidArgument(
                f"attention backend {chosen!r} runs on {wanted} pools, not {device.type}; "
                f"use 'auto' or one of {', '.join(known_backends())}",
                field="attention_backend",
            )
    backend = BACKENDS[chosen]()
    key = (requested, chosen, device.type)
    with _log_lock:
        if key not in _logged:
            _logged.add(key)
            logger.info("attention backend %s on %s (%s)", chosen, device.type, why)
    return backend
