"""The Triton kernels behind ``triton_paged``; importing this module imports triton.

Kept apart from the backend so ``kvtier.engine.attention`` never imports triton until a Triton
backend is built. Whether the kernels run compiled (CUDA) or in Triton's CPU interpreter is
fixed when this module is first imported: ``@triton.jit`` reads ``TRITON_INTERPRET`` at
decoration time. ``INTERPRETED`` records which.

One kernel serves decode and prefill-with-prefix. A program owns one (sequence, kv head,
row tile[, key split]). Its rows are (new token, query head of the kv head's group) pairs,
so the K/V of a kv head is read once for the whole GQA group:

    row r of tile t:  token = (t * BLOCK_M + r) // GROUP      head = kv_head * GROUP + r % GROUP

    seq with cached 5, new 3 (context 8), GROUP 2, keys in pages of 4 via the block table:
      key pos   0 1 2 3 | 4 5 6 7
      token 0   x x x x   x x . .      query token i sits at ctx - q_len + i and
      token 1   x x x x   x x x .      sees keys 0..that position (bottom-right causal)
      token 2   x x x x   x x x x

Keys are walked in tiles of ``BLOCK_N`` positions; each key's page comes from the block
table (``pos // PAGE_SIZE``), so any page size works, including pages smaller than a
tile. Scores and the running softmax are fp32; ``p`` is cast to the pool dtype for the
second product, as flash-attention does.

FP8 pages (``IS_FP8``): codes are loaded as fp8 and converted to ``q``'s dtype (exact for
e4m3 and e5m2 in fp16, bf16 and fp32), and each key's (page, kv head) scale is applied
outside the products: K's to the scores of its column, V's to ``p`` before the second
product, so no dequantized tile of K or V is ever formed.

Split-K (``NUM_SPLITS > 1``): the key range of a tile is cut into ``NUM_SPLITS`` chunks,
each program writes its unnormalised accumulator, running max and sum (fp32) to a
workspace, and ``combine_splits_kernel`` merges them. A chunk a row cannot see (a short
sequence next to long ones) leaves max = -inf and sum = 0, which the merge weighs to 0.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)

_INTERPRET = tl.constexpr(INTERPRETED)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    if _INTERPRET:
        # Triton 3.6's interpreter multiplies bf16 operands as their raw uint16 bits; fp32
        # holds bf16/fp16 values exactly, and accumulation is fp32 either way.
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _attend_key_tile(
    start,
    kv_hi,
    q,
    acc,
    m_i,
    l_i,
    q_pos,
    row_valid,
    offs_d,
    d_valid,
    table,
    k_ptr,
    v_ptr,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_kd,
    kv_head,
    qk_scale,
    scales_ptr,
    stride_sp,
    stride_sk,
    stride_sh,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    """Fold keys ``start .. start + BLOCK_N`` (clipped to ``kv_hi``) into the online softmax."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_valid = offs_n < kv_hi
    page = tl.load(table + offs_n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
    kv_off = page * stride_kp + (offs_n % PAGE_SIZE) * stride_ks + kv_head * stride_kh
    k = tl.load(
        k_ptr + kv_off[None, :] + offs_d[:, None] * stride_kd,
        mask=n_valid[None, :] & d_valid[:, None],
        other=0.0,
    )
    if IS_FP8:
        scale_off = page * stride_sp + kv_head * stride_sh
        k_scale = tl.load(scales_ptr + scale_off, mask=n_valid, other=0.0)
        v_scale = tl.load(scales_ptr + scale_off + stride_sk, mask=n_valid, other=0.0)
        s = _dot(q, k.to(q.dtype), DOT_PRECISION) * (k_scale * qk_scale)[None, :]
    else:
        s = _dot(q, k, DOT_PRECISION) * qk_scale
    visible = row_valid[:, None] & n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; exp2 against 0 keeps p and alpha 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_ptr + kv_off[:, None] + offs_d[None, :] * stride_kd,
        mask=n_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if IS_FP8:
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + _dot((p * v_scale[None, :]).to(v.dtype), v, DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    scales_ptr,  # fp32 [num_pages, 2, kv_heads] for FP8 pools (strides below); unused otherwise
    qk_scale,  # softmax scale * log2(e): the kernel uses exp2
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_bt,
    stride_sp,
    stride_sk,
    stride_sh,
    num_heads,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    if tile * BLOCK_M >= q_len * GROUP:
        return  # this sequence has fewer rows than the longest one in the batch

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len * GROUP
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_pos = ctx - q_len + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if not IS_FP8:
        q = q.to(k_ptr.dtype.element_ty)

    # The last row of the tile sees the most keys; no row sees past it.
    last_tok = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // GROUP)
    kv_end = ctx - q_len + last_tok + 1
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_end, kv_lo + chunk)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if _INTERPRET:
        # Triton 3.6's interpreter cannot take loaded values as range() bounds under
        # numpy >= 2.4 (triton-lang/triton#9171); compiled code keeps the pipelined for loop.
        start = kv_lo
        while start < kv_hi:
            acc, m_i, l_i = _attend_key_tile(
                start, kv_hi, q, acc, m_i, l_i, q_pos, row_valid, offs_d, d_valid, table,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_kd, kv_head, qk_scale,
                scales_ptr, stride_sp, stride_sk, stride_sh, PAGE_SIZE, BLOCK_N, DOT_PRECISION, IS_FP8,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(kv_lo, kv_hi, BLOCK_N):
            acc, m_i, l_i = _attend_key_tile(
                start, kv_hi, q, acc, m_i, l_i, q_pos, row_valid, offs_d, d_valid, table,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_kd, kv_head, qk_scale,
                scales_ptr, stride_sp, stride_sk, stride_sh, PAGE_SIZE, BLOCK_N, DOT_PRECISION, IS_FP8,
            )  # fmt: skip

    if NUM_SPLITS == 1:
        # Rows past this sequence's end have l = 0; they are not stored, but keep them finite.
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )
    else:
        # Workspace [T, num_heads, NUM_SPLITS(, HEAD_DIM)], contiguous fp32.
        part = (q_rows * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=row_valid[:, None] & d_valid[None, :],
        )


@triton.jit
def combine_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One program per (token, head): merge the splits' partial softmaxes."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    m = tl.load(part_max_ptr + part)
    l_part = tl.load(part_sum_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=d_valid[None, :], other=0.0)
    # Split 0 starts at key 0, which every row sees, so m_max is finite.
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - m_max)
    total = tl.sum(l_part * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )
