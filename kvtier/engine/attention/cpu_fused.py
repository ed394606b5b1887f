"""Paged attention on CPU: a small C++/OpenMP kernel that reads pages in place for decode and
short chunks, torch's SDPA over gathered pages for prefills (``CpuFusedBackend``).

The kernel (``csrc/paged_attention_cpu.cpp``) is compiled on first use and cached
(``kvtier.tiers.native``: ``torch.utils.cpp_extension`` + ``ninja``, ``-march=native``, one
binary per CPU feature set).

If the build fails, the backend logs one warning naming the cause and serves every call
with the reference implementation, so a worker without a compiler is slow, not down.
``load_kernel()`` raises instead, for callers (tests, ``get_backend("auto")``) that must
know.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvtier.domain.errors import FailedPrecondition
from kvtier.engine.attention.base import (
    AttentionMetadata,
    KvLayer,
    attend_sequence,
    attention_reference,
    write_kv_reference,
)
from kvtier.engine.attention.fp8 import FP8_DTYPES, Fp8KvLayer, write_kv_fp8
from kvtier.tiers.native import NativeExtension

logger = logging.getLogger("kvtier.engine.attention")

# New tokens of one sequence from which its attention runs through SDPA (``CpuFusedBackend``).
SDPA_MIN_QUERY_LEN = 64
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)
_EXTENSION = NativeExtension(
    "kvtier_paged_attention",
    Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp",
    what="paged-attention kernel",
    fallback_hint="set KVTIER_ATTENTION_BACKEND=torch-reference",
)


def load_kernel() -> None:
    """Build or load the extension once per process; raise ``FailedPrecondition`` if impossible.

    Thread-safe: concurrent first callers wait for one build. A failure is remembered, so
    the compiler is not retried on every call.
    """
    _EXTENSION.load()


class CpuFusedBackend:
    """The ``AttentionBackend`` for CPU pools: decode and prefill-with-prefix in one kernel.

    Reads K/V straight from the strided ``kv_layer`` view (no gather), parallel over
    (sequence, kv head, query tile) on torch's intra-op threads, with an online softmax in
    fp32. fp16/bf16 pools are read and accumulated in fp32; FP8 pages (``Fp8KvLayer``) are
    decoded and scaled row by row as they are read. Tensors it cannot handle (not on
    the CPU, another dtype, a non-contiguous head_dim) go to the reference implementation.

    ``partition_size``: 0 lets the kernel split long key ranges across threads only when
    there are too few (sequence, kv head) items to keep every thread busy; a positive value
    forces splits of that many keys; -1 never splits.

    ``sdpa_min_query_len``: a sequence with at least this many new tokens (a prefill) skips
    the kernel: its pages are gathered into contiguous fp32 K/V and torch's SDPA attends over
    them (``attend_sequence``). SDPA's blocked matrix products run prefill attention about
    ten times faster than the kernel's per-row dot products (1,024 tokens, 8 heads of 128:
    ~80 ms against ~800 ms on a 2-core machine), so attention stays a small share of a prefill next to the projections and
    a prefill over a cached prefix costs close to its share of new tokens; the gather costs
    O(context) against O(new tokens x context) of work. Decode rows and short chunks stay in
    the kernel, which reads pages in place.
    """

    name = "cpu-fused"

    def __init__(self, partition_size: int = 0, sdpa_min_query_len: int = SDPA_MIN_QUERY_LEN) -> None:
        self.partition_size = partition_size
        self.sdpa_min_query_len = sdpa_min_query_len
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
    def _can_handle(kv_layer: KvLayer) -> bool:
        codes = kv_layer.codes if isinstance(kv_layer, Fp8KvLayer) else kv_layer
        return codes.device.type == "cpu" and codes.dtype in _SUPPORTED_DTYPES and codes.stride(-1) == 1

    def write_kv(self, kv_layer: KvLayer, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        if isinstance(kv_layer, Fp8KvLayer):
            write_kv_fp8(kv_layer, k, v, md.slot_mapping)
        elif self._can_handle(kv_layer) and self._kernel_ready():
            torch.ops.kvtier_attn.write_kv(kv_layer, k, v, md.slot_mapping)
        else:
            write_kv_reference(kv_layer, k, v, md)

    def forward(self, q: torch.Tensor, kv_layer: KvLayer, md: AttentionMetadata, scale: float) -> torch.Tensor:
        if not (self._can_handle(kv_layer) and q.device.type == "cpu" and self._kernel_ready()):
            return attention_reference(q, kv_layer, md, scale)
        qs = md.query_start_list
        long = [b for b in range(md.num_seqs) if qs[b + 1] - qs[b] >= self.sdpa_min_query_len]
        if not long:
            return self._kernel(q, kv_layer, md, scale)
        out = torch.empty_like(q)
        for b in long:
            out[qs[b] : qs[b + 1]] = attend_sequence(
                q[qs[b] : qs[b + 1]], kv_layer, md.block_tables[b], md.context_lens_list[b], scale,
                compute_dtype=torch.float32,
            )
        short = sorted(set(range(md.num_seqs)) - set(long))
        if short:
            sub, rows = md.select(short)
            out[rows] = self._kernel(q[rows], kv_layer, sub, scale)
        return out

    def _kernel(self, q: torch.Tensor, kv_layer: KvLayer, md: AttentionMetadata, scale: float) -> torch.Tensor:
        codes, scales = (kv_layer.codes, kv_layer.scales) if isinstance(kv_layer, Fp8KvLayer) else (kv_layer, None)
        out = torch.ops.kvtier_attn.paged_attention(
            q, codes, md.block_tables, md.query_start, md.context_lens, scale, self.partition_size, scales
        )
        return out if out.dtype == q.dtype else out.to(q.dtype)
