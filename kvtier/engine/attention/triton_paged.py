"""Paged attention on CUDA through Triton kernels that read pages in place (any page size).

Why not flash-attn everywhere: upstream flash-attn needs ``page_size % 256 == 0`` and our
pools use 16-token pages, so on CUDA the only other path was the gather + SDPA reference.
This backend works with any page size, fp32/fp16/bf16 pools, GQA, decode and
prefill-with-prefix, and FP8 pages (``Fp8KvLayer``, decoded in the kernel), in one kernel
(``triton_kernels.paged_attention_kernel``):

* one program per (sequence, kv head, tile of ``BLOCK_M`` rows), a row being one (new
  token, query head of the group) pair, so each kv head's pages are read once per group;
* keys walked in tiles through the block table, straight from the strided
  ``kv_layer[:, 0]`` / ``kv_layer[:, 1]`` views (strides taken from the tensor, no copy);
* online softmax in fp32, causal within the new tokens and full over the cached prefix
  (bottom-right aligned); the output has ``q``'s dtype;
* decode on CUDA splits long key ranges (split-K) when (sequence, kv head) programs alone
  would leave most SMs idle; ``num_splits`` forces a split count (tests use it).

``write_kv`` stays the reference scatter (two index_put kernels).

Triton is imported on first construction. The kernels also run in Triton's CPU interpreter
(``TRITON_INTERPRET=1`` set before ``kvtier.engine.attention.triton_kernels`` is first imported);
that is how CI checks them, on CPU tensors. Outside the interpreter, CPU tensors are
refused with ``FailedPrecondition``.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from types import ModuleType

import torch

from kvtier.domain.errors import FailedPrecondition, InvalidArgument
from kvtier.engine.attention.base import AttentionMetadata, KvLayer, write_kv_reference
from kvtier.engine.attention.fp8 import FP8_DTYPES, Fp8KvLayer

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2_E = 1.4426950408889634
# Split-K only when each chunk keeps at least this many keys (fewer: the merge costs more
# than the parallelism buys), and never into more than this many chunks.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 16


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def load_kernels() -> ModuleType:
    """Import the kernels module; raise ``FailedPrecondition`` when it cannot serve here.

    Compiled kernels need a CUDA device; interpreted ones run anywhere.
    """
    try:
        from kvtier.engine.attention import triton_kernels
    except ImportError as exc:
        raise FailedPrecondition(
            f"triton is not importable ({exc}); install triton (pip install triton, Linux x86_64) "
            "or choose the torch-reference backend (KVTIER_ATTENTION_BACKEND=torch-reference)"
        ) from exc
    if not triton_kernels.INTERPRETED and not torch.cuda.is_available():
        raise FailedPrecondition(
            "the triton attention backend needs a CUDA device and none is available; choose "
            "torch-reference or cpu-fused for CPU pools (TRITON_INTERPRET=1 runs it on CPU, slowly, for tests)"
        )
    return triton_kernels


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class TritonPagedBackend:
    """``AttentionBackend`` over Triton kernels for CUDA pools of any page size.

    ``num_splits``: 0 chooses split-K for decode from the SM count and the longest
    context; a positive power of two forces that many key chunks for every batch.
    """

    name = "triton"

    def __init__(self, num_splits: int = 0) -> None:
        if num_splits < 0 or (num_splits and num_splits & (num_splits - 1)):
            raise InvalidArgument(
                f"num_splits must be 0 (auto) or a power of two, got {num_splits}", field="num_splits"
            )
        self.num_splits = num_splits
        self._kernels = load_kernels()

    def write_kv(self, kv_layer: KvLayer, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        write_kv_reference(kv_layer, k, v, md)

    def _check(self, q: torch.Tensor, kv_layer: KvLayer) -> None:
        if isinstance(kv_layer, Fp8KvLayer):
            if q.dtype not in _SUPPORTED_DTYPES:
                raise InvalidArgument(f"q must be fp32/fp16/bf16 over FP8 pages, got {q.dtype}", field="q")
            kv_layer = kv_layer.codes
        if kv_layer.device.type != "cuda" and not self._kernels.INTERPRETED:
            raise FailedPrecondition(
                f"the triton attention backend runs on CUDA pools, this one is on {kv_layer.device}; "
                "use torch-reference or cpu-fused for CPU pools"
            )
        if q.device != kv_layer.device:
            raise InvalidArgument(f"q is on {q.device}, the pool on {kv_layer.device}", field="q")
        if kv_layer.dtype not in (*_SUPPORTED_DTYPES, *FP8_DTYPES):
            raise InvalidArgument(
                f"the triton attention backend reads fp32/fp16/bf16 pools and FP8 pages, got {kv_layer.dtype}",
                field="dtype",
            )
        num_heads, kv_heads = q.shape[1], kv_layer.shape[3]
        if num_heads % kv_heads:
            raise InvalidArgument(
                f"num_heads={num_heads} is not a multiple of kv_heads={kv_heads}", field="num_heads"
            )

    def _splits(self, md: AttentionMetadata, kv_heads: int, device: torch.device) -> int:
        if self.num_splits:
            return self.num_splits
        if device.type != "cuda" or not md.is_decode:
            return 1
        programs = md.num_seqs * kv_heads
        target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        max_ctx = max(md.context_lens_list)
        splits = 1
        while (
            splits < _MAX_SPLITS
            and programs * splits < target
            and max_ctx >= 2 * splits * _MIN_KEYS_PER_SPLIT
        ):
            splits *= 2
        return splits

    def forward(self, q: torch.Tensor, kv_layer: KvLayer, md: AttentionMetadata, scale: float) -> torch.Tensor:
        self._check(q, kv_layer)
        scales: torch.Tensor | None = None
        if isinstance(kv_layer, Fp8KvLayer):
            scales, codes = kv_layer.scales, kv_layer.codes
        else:
            codes = kv_layer
        is_fp8 = scales is not None
        # The dtype of the products: the pool's, or q's over FP8 codes.
        compute_dtype = q.dtype if is_fp8 else codes.dtype
        num_tokens, num_heads, head_dim = q.shape
        page_size, kv_heads = codes.shape[2], codes.shape[3]
        group = num_heads // kv_heads
        out = torch.empty_like(q)
        if num_tokens == 0:
            return out
        kernels = self._kernels
        triton = kernels.triton

        block_d = max(16, triton.next_power_of_2(head_dim))
        # tl.dot needs every dimension >= 16; a decode row tile holds one token's group.
        block_m = max(16, min(64, triton.next_power_of_2(md.max_query_len * group)))
        block_n = 64 if block_d <= 128 else 32
        splits = self._splits(md, kv_heads, codes.device)
        num_tiles = math.ceil(md.max_query_len * group / block_m)

        k_cache, v_cache = codes[:, 0], codes[:, 1]
        block_tables = md.block_tables
        if splits > 1:
            part_acc = torch.empty(
                num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device
            )
            part_max = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
            part_sum = torch.empty_like(part_max)
        else:
            part_acc = part_max = part_sum = out  # never read or written
        kernels.paged_attention_kernel[(md.num_seqs, kv_heads, num_tiles * splits)](
            out,
            q,
            k_cache,
            v_cache,
            block_tables,
            md.query_start,
            md.context_lens,
            part_acc,
            part_max,
            part_sum,
            out if scales is None else scales,  # never read for float pools
            scale * _LOG2_E,
            *q.stride(),
            *out.stride(),
            *k_cache.stride(),
            block_tables.stride(0),
            *((0, 0, 0) if scales is None else scales.stride()),
            num_heads,
            GROUP=group,
            PAGE_SIZE=page_size,
            HEAD_DIM=head_dim,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            # fp32 pools: exact fp32 products, not TF32 (the oracle comparison is at 1e-5).
            DOT_PRECISION="ieee" if compute_dtype == torch.float32 else "tf32",
            IS_FP8=is_fp8,
            num_warps=4,
        )
        if splits > 1:
            kernels.combine_splits_kernel[(num_tokens, num_heads)](
                out,
                part_acc,
                part_max,
                part_sum,
                *out.stride(),
                num_heads,
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                NUM_SPLITS=splits,
            )
        return out
