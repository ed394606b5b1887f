"""Paged-attention contract shared by the model, the engine and every backend.

Pool layout (DESIGN §5.1), one tensor per tier::

    pool[num_pages, layers, 2, page_size, kv_heads, head_dim]
    kv_layer = pool[:, layer]          -> [num_pages, 2, page_size, kv_heads, head_dim]
    kv_layer[:, 0] / kv_layer[:, 1]    -> K / V, strided views (pages are not adjacent)

A batch flattens the *new* tokens of B sequences into T rows. Sequence b owns rows
``query_start[b]:query_start[b+1]``; its new tokens sit at positions
``context_lens[b] - query_len_b … context_lens[b] - 1`` (``context_lens`` counts the
cached prefix *and* the new tokens). Token at position p of sequence b lives in page
``block_tables[b, p // page_size]`` at offset ``p % page_size``; ``slot_mapping``
holds ``page * page_size + offset`` for each new row so K/V can be written before
attention reads them.

    seq b, page_size 4, cached 6, new 3  (context_len 9)
    positions   0 1 2 3 | 4 5 6 7 | 8
    pages       [ p17  ]  [ p3   ]  [ p9 ]     block_tables[b] = [17, 3, 9]
    new rows                  ^ ^     ^        query rows see keys 0..own position

An FP8 pool (``kvtier.engine.attention.fp8.Fp8Pages``) hands each layer over as an
``Fp8KvLayer``: the same ``[num_pages, 2, page_size, kv_heads, head_dim]`` codes plus one
scale per (page, plane, kv head). Backends dequantize as they read; none makes a
full-precision copy of the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvtier.engine.attention.fp8 import Fp8KvLayer, write_kv_fp8

KvLayer = torch.Tensor | Fp8KvLayer
"""``pool[:, layer]`` of a float pool, or of an FP8 pool."""

_SDPA_ROW_BLOCK = 128  # query rows per SDPA call over a cached prefix (``attend_sequence``)


@dataclass(slots=True)
class AttentionMetadata:
    query_start: torch.Tensor  # int32 [B + 1], cumulative new-token counts
    context_lens: torch.Tensor  # int32 [B], cached + new tokens per sequence
    block_tables: torch.Tensor  # int32 [B, max_pages], padded with 0
    slot_mapping: torch.Tensor  # int64 [T], page * page_size + offset of each new token
    page_size: int
    # Host copies so backends can loop without device syncs.
    query_start_list: list[int]
    context_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.query_start_list[-1]

    @property
    def max_query_len(self) -> int:
        qs = self.query_start_list
        return max(qs[i + 1] - qs[i] for i in range(len(qs) - 1))

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one new token."""
        return self.num_tokens == self.num_seqs

    def select(self, seqs: Sequence[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata of the sequences ``seqs`` alone (in that order), and the rows of q they own."""
        qs = self.query_start_list
        query_start = [0]
        for b in seqs:
            query_start.append(query_start[-1] + qs[b + 1] - qs[b])
        device = self.block_tables.device
        rows = torch.cat([torch.arange(qs[b], qs[b + 1], device=device) for b in seqs])
        index = torch.tensor(list(seqs), dtype=torch.long, device=device)
        sub = AttentionMetadata(
            query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
            context_lens=self.context_lens[index],
            block_tables=self.block_tables[index],
            slot_mapping=self.slot_mapping[rows],
            page_size=self.page_size,
            query_start_list=query_start,
            context_lens_list=[self.context_lens_list[b] for b in seqs],
        )
        return sub, rows

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have one entry per sequence")
        query_start = [0]
        slots: list[int] = []
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            if q_len < 1 or q_len > ctx:
                raise ValueError(f"query_len {q_len} must be in [1, context_len={ctx}]")
            if len(table) * page_size < ctx:
                raise ValueError(f"block table of {len(table)} pages cannot hold {ctx} tokens")
            query_start.append(query_start[-1] + q_len)
            for pos in range(ctx - q_len, ctx):
                slots.append(table[pos // page_size] * page_size + pos % page_size)
        max_pages = max(len(t) for t in block_tables)
        padded = [list(t) + [0] * (max_pages - len(t)) for t in block_tables]
        return cls(
            query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
            context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            page_size=page_size,
            query_start_list=query_start,
            context_lens_list=list(context_lens),
        )


class AttentionBackend(Protocol):
    """A way to write new K/V into a layer's pages and attend over them.

    ``q`` is ``[T, num_heads, head_dim]``; ``k``/``v`` are ``[T, kv_heads, head_dim]``;
    ``kv_layer`` is ``pool[:, layer]`` (a tensor, or an ``Fp8KvLayer`` for FP8 pages).
    ``num_heads`` is a multiple of ``kv_heads`` (GQA).
    Attention is causal within the new tokens and full over the cached prefix.
    """

    name: str

    def write_kv(self, kv_layer: KvLayer, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None: ...

    def forward(self, q: torch.Tensor, kv_layer: KvLayer, md: AttentionMetadata, scale: float) -> torch.Tensor: ...


def write_kv_reference(kv_layer: KvLayer, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
    if isinstance(kv_layer, Fp8KvLayer):
        write_kv_fp8(kv_layer, k, v, md.slot_mapping)
        return
    page_size = kv_layer.shape[2]
    pages = md.slot_mapping // page_size
    offsets = md.slot_mapping % page_size
    kv_layer[pages, 0, offsets] = k.to(kv_layer.dtype)
    kv_layer[pages, 1, offsets] = v.to(kv_layer.dtype)


def attend_sequence(
    q: torch.Tensor,
    kv_layer: KvLayer,
    pages: torch.Tensor,
    context_len: int,
    scale: float,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention of one sequence's new rows ``q`` ``[q_len, num_heads, head_dim]`` over its pages.

    The rows sit at positions ``context_len - q_len … context_len - 1``; ``pages`` is the
    sequence's block table. K and V of the pages are gathered plane by plane (one copy of
    O(ctx) against O(q_len x ctx) work) and viewed as ``[1, heads, ctx, head_dim]``: SDPA runs
    its blocked CPU kernel on 4-D inputs (several times faster than its 3-D path), causal in
    place of a mask when every row is new. ``compute_dtype`` defaults to the pool's dtype
    (fp32 for FP8 pages); the result has ``q``'s dtype.
    """
    _, _, page_size, kv_heads, head_dim = kv_layer.shape
    q_len, num_heads = q.shape[0], q.shape[1]
    listed = pages[: -(-context_len // page_size)].long()
    if isinstance(kv_layer, Fp8KvLayer):
        gathered = kv_layer.dequantize(listed)
        k_rows, v_rows = gathered[:, 0], gathered[:, 1]
    else:
        k_rows, v_rows = kv_layer[listed, 0], kv_layer[listed, 1]
    dtype = compute_dtype or k_rows.dtype
    kb = k_rows.reshape(-1, kv_heads, head_dim)[:context_len].transpose(0, 1).to(dtype)  # [kv_heads, ctx, D]
    vb = v_rows.reshape(-1, kv_heads, head_dim)[:context_len].transpose(0, 1).to(dtype)
    if num_heads != kv_heads:
        rep = num_heads // kv_heads
        kb = kb.repeat_interleave(rep, dim=0)
        vb = vb.repeat_interleave(rep, dim=0)
    qb = q.transpose(0, 1).to(dtype)  # [H, q_len, D]
    if q_len == context_len:
        ob = F.scaled_dot_product_attention(qb[None], kb[None], vb[None], is_causal=True, scale=scale)
    else:
        # Query row i sits at position ctx - q_len + i and may see keys 0..that position. SDPA
        # scores every (row, key) pair a mask covers, so rows go in blocks that each stop at
        # their last visible key: over a cached prefix of c the work is about q_len x (c + q_len/2).
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)[:, None]
        k_pos = torch.arange(context_len, device=q.device)[None, :]
        ob = torch.empty(1, num_heads, q_len, head_dim, dtype=dtype, device=q.device)
        for r0 in range(0, q_len, _SDPA_ROW_BLOCK):
            r1 = min(q_len, r0 + _SDPA_ROW_BLOCK)
            keys = context_len - q_len + r1
            ob[:, :, r0:r1] = F.scaled_dot_product_attention(
                qb[None, :, r0:r1], kb[None, :, :keys], vb[None, :, :keys],
                attn_mask=k_pos[:, :keys] <= q_pos[r0:r1], scale=scale,
            )
    return ob[0].transpose(0, 1).to(q.dtype)


def attention_reference(q: torch.Tensor, kv_layer: KvLayer, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Readable, obviously-correct paged attention: gather each sequence's pages, then SDPA.

    This is the oracle for faster backends, not the production path (the gather copies;
    FP8 pages are dequantized in that per-sequence copy).
    """
    out = torch.empty_like(q)
    qs = md.query_start_list
    for b, ctx in enumerate(md.context_lens_list):
        start, end = qs[b], qs[b + 1]
        out[start:end] = attend_sequence(q[start:end], kv_layer, md.block_tables[b], ctx, scale)
    return out


class ReferenceBackend:
    name = "torch-reference"

    def write_kv(self, kv_layer: KvLayer, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        write_kv_reference(kv_layer, k, v, md)

    def forward(self, q: torch.Tensor, kv_layer: KvLayer, md: AttentionMetadata, scale: float) -> torch.Tensor:
        return attention_reference(q, kv_layer, md, scale)
