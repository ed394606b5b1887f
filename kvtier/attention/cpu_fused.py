"""Paged attention on CPU through a small C++/OpenMP kernel that reads pages in place.

The kernel (``csrc/paged_attention_cpu.cpp``) is compiled on first use with
``torch.utils.cpp_extension`` (needs a C++ compiler and ``ninja``) and cached under
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); later processes load the
cached library in well under a second. It is built with ``-march=native``, so the
extension name carries a digest of the CPU's feature flags: hosts that share a cache
directory but differ in ISA never load each other's binary.

If the build fails, the backend logs one warning naming the cause and serves every call
with the reference implementation, so a worker without a compiler is slow, not down.
``load_kernel()`` raises instead, for callers (tests, ``get_backend("auto")``) that must
know.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch

from kvtier.attention.base import AttentionMetadata, attention_reference, write_kv_reference
from kvtier.errors import FailedPrecondition

logger = logging.getLogger("kvtier.attention")

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG", "-Wno-psabi"]
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_lock = threading.Lock()
_loaded = False
_load_error: FailedPrecondition | None = None


def _cpu_tag() -> str:
    """Digest of what ``-march=native`` depends on: architecture and CPU feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    text = f"{platform.machine()}|{flags}|{torch.__version__}"
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip ``ninja`` wheel may sit in an unactivated venv."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return  # cpp_extension reports "Ninja is required" and the caller falls back
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build_failure_summary(exc: Exception) -> str:
    """The line of a build log that names the cause (cpp_extension puts it mid-message)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        lowered = line.lower()
        if "error:" in lowered or "not found" in lowered or "is required" in lowered:
            return line[:300]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else 'no message'}"


def load_kernel() -> None:
    """Build or load the extension once per process; raise ``FailedPrecondition`` if impossible.

    Thread-safe: concurrent first callers wait for one build. A failure is remembered, so
    the compiler is not retried on every call. Across processes torch's build lock
    serialises builds of the same extension directory.
    """
    global _loaded, _load_error
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        if _load_error is not None:
            raise _load_error
        start_s = time.monotonic()
        try:
            from torch.utils import cpp_extension

            _ensure_ninja_on_path()
            cpp_extension.load(
                name=f"kvtier_paged_attention_{_cpu_tag()}",
                sources=[str(_SOURCE)],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:  # compiler missing, ninja missing, headers missing, ...
            logger.debug("cpu-fused kernel build output:\n%s", exc)
            _load_error = FailedPrecondition(
                f"the C++ paged-attention kernel could not be built or loaded ({_build_failure_summary(exc)}); "
                "install a C++ compiler and `pip install ninja`, or set KVTIER_ATTENTION_BACKEND=torch-reference"
            )
            raise _load_error from exc
        _loaded = True
        logger.info("cpu-fused attention kernel ready in %.1f s", time.monotonic() - start_s)


class CpuFusedBackend:
    """The ``AttentionBackend`` for CPU pools: decode and prefill-with-prefix in one kernel.

    Reads K/V straight from the strided ``kv_layer`` view (no gather), parallel over
    (sequence, kv head, query tile) on torch's intra-op threads, with an online softmax in
    fp32. fp16/bf16 pools are read and accumulated in fp32. Tensors it cannot handle (not on
    the CPU, another dtype, a non-contiguous head_dim) go to the reference implementation.

    ``partition_size``: 0 lets the kernel split long key ranges across threads only when
    there are too few (sequence, kv head) items to keep every thread busy; a positive value
    forces splits of that many keys; -1 never splits.
    """

    name = "cpu-fused"

    def __init__(self, partition_size: int = 0) -> None:
        self.partition_size = partition_size
        self._warned = False

    def _kernel_ready(self) -> bool:
        try:
            load_kernel()
        except FailedPrecondition as exc:
            if not self._warned:
                self._warned = True
                logger.warning("cpu-fused attention falls back to torch-reference: %s", exc)
            return False
        return True

    @staticmethod
    def _can_handle(kv_layer: torch.Tensor) -> bool:
        return (
            kv_layer.device.type == "cpu" and kv_layer.dtype in _SUPPORTED_DTYPES and kv_layer.stride(-1) == 1
        )

    def write_kv(
        self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> None:
        if self._can_handle(kv_layer) and self._kernel_ready():
            torch.ops.kvtier_attn.write_kv(kv_layer, k, v, md.slot_mapping)
        else:
            write_kv_reference(kv_layer, k, v, md)

    def forward(
        self, q: torch.Tensor, kv_layer: torch.Tensor, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if not (self._can_handle(kv_layer) and q.device.type == "cpu" and self._kernel_ready()):
            return attention_reference(q, kv_layer, md, scale)
        out = torch.ops.kvtier_attn.paged_attention(
            q, kv_layer, md.block_tables, md.query_start, md.context_lens, scale, self.partition_size
        )
        return out if out.dtype == q.dtype else out.to(q.dtype)
