"""Paged attention on CUDA through flash-attn's varlen kernel with a block table.

UNTESTED IN CI: CI has no GPU. This module is written against flash-attn 2.6+
(``flash_attn_varlen_func(..., block_table=...)``, Dao-AILab upstream) and checked by
reading its ``flash_api.cpp``; ``tests/test_attention.py`` runs it against the reference
only when CUDA and flash-attn are both present (marked ``cuda``).

Why the pool needs no copy: flash-attn reads the paged cache as
``[num_blocks, page_block_size, kv_heads, head_dim]`` and only requires a contiguous last
dimension (``stride(-1) == 1``); it takes the block, token and head strides from the
tensor. ``kv_layer[:, 0]`` and ``kv_layer[:, 1]`` are exactly that shape with
``stride(0) = layers * 2 * page_size * kv_heads * head_dim``, so they are passed as views.

Limits of upstream flash-attn that decide when this backend can be chosen:

* ``page_size`` must be a multiple of 256 (``Paged KV cache block size must be divisible
  by 256``); smaller pages need vLLM's fork or FlashInfer (not wired yet).
* fp16 / bf16 only; Ampere or newer.

Causal masking is aligned to the bottom-right corner when ``seqlen_q < seqlen_k``: query i
of a sequence sees keys up to ``context_len - query_len + i``, the contract of
``AttentionBackend``. Decode and prefill-with-prefix go through the same call.
"""

from __future__ import annotations

import importlib.util

import torch

from kvtier.domain.errors import FailedPrecondition, InvalidArgument
from kvtier.engine.attention.base import AttentionMetadata, KvLayer, write_kv_reference
from kvtier.engine.attention.fp8 import Fp8KvLayer

FLASH_ATTN_PAGE_MULTIPLE = 256
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


class FlashAttnBackend:
    """``AttentionBackend`` over flash-attn for CUDA pools (fp16/bf16, page_size % 256 == 0)."""

    name = "flash-attn"

    def __init__(self) -> None:
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as exc:
            raise FailedPrecondition(
                f"flash-attn is not importable ({exc}); install flash-attn>=2.6 or choose the "
                "torch-reference backend (KVTIER_ATTENTION_BACKEND=torch-reference)"
            ) from exc
        self._varlen = flash_attn_varlen_func

    @staticmethod
    def supports(page_size: int, dtype: torch.dtype | None = None) -> bool:
        return page_size % FLASH_ATTN_PAGE_MULTIPLE == 0 and (dtype is None or dtype in _SUPPORTED_DTYPES)

    def write_kv(
        self, kv_layer: KvLayer, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> None:
        # Two index_put kernels; flash-attn's in-kernel append only exists for the
        # non-varlen kvcache entry point.
        write_kv_reference(kv_layer, k, v, md)

    def forward(
        self, q: torch.Tensor, kv_layer: KvLayer, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if isinstance(kv_layer, Fp8KvLayer):
            raise InvalidArgument(
                "flash-attn reads fp16/bf16 pages, not FP8 codes; use torch-reference for this pool",
                field="kv_dtype",
            )
        page_size = kv_layer.shape[2]
        if not self.supports(page_size, kv_layer.dtype):
            raise InvalidArgument(
                f"flash-attn needs page_size % {FLASH_ATTN_PAGE_MULTIPLE} == 0 and an fp16/bf16 pool, "
                f"got page_size={page_size}, dtype={kv_layer.dtype}; use torch-reference for this pool",
                field="page_size",
            )
        lens = md.context_lens
        cu_seqlens_k = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
        torch.cumsum(lens, dim=0, out=cu_seqlens_k[1:])
        out = self._varlen(
            q.to(kv_layer.dtype),
            kv_layer[:, 0],
            kv_layer[:, 1],
            cu_seqlens_q=md.query_start,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=md.max_query_len,
            max_seqlen_k=max(md.context_lens_list),
            softmax_scale=scale,
            causal=True,
            block_table=md.block_tables,
        )
        return out.to(q.dtype)
