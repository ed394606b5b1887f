"""FP8 pages: the byte layout, writes, and attention over FP8 pages in the reference and
the fused CPU kernel (the Triton kernel's FP8 tests live in test_attention_triton.py).

The oracle decodes the page bytes on its own: codes through torch's float8 casts, scales
read at the offsets ``kvtier.domain.page_layout`` gives, then each sequence's K/V are laid
out contiguously and attended with dense SDPA. It never uses ``Fp8Pages``' views or a kernel.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import LAYER, Batch, dense_oracle, make_batch

from kvtier.domain.errors import InvalidArgument
from kvtier.engine.attention import cpu_fused
from kvtier.engine.attention.base import AttentionMetadata, ReferenceBackend, attention_reference
from kvtier.engine.attention.cpu_fused import CpuFusedBackend
from kvtier.engine.attention.fp8 import FORMATS, Fp8Pages, pow2_scales, quantize_pages, write_kv_fp8


def decode_bytes(pages: Fp8Pages) -> torch.Tensor:
    """The float pool the page bytes stand for, decoded from ``raw`` and the domain layout."""
    lay = pages.layout
    n = pages.raw.shape[0]
    codes = pages.raw[:, : lay.num_elements].contiguous().view(pages.format.dtype).to(torch.float32)
    codes = codes.reshape(n, lay.num_layers, 2, lay.page_size, lay.kv_heads, lay.head_dim)
    out = torch.empty_like(codes)
    for layer in range(lay.num_layers):
        for plane in range(2):
            for head in range(lay.kv_heads):
                at = lay.scale_offset(layer, plane, head)
                scale = pages.raw[:, at : at + 4].contiguous().view(torch.float32)  # [n, 1]
                out[:, layer, plane, :, head] = codes[:, layer, plane, :, head] * scale[:, :, None]
    return out


def dequantized_batch(batch: Batch, pages: Fp8Pages) -> Batch:
    """``batch`` with its pool and each sequence's contiguous K/V replaced by what the bytes hold."""
    pool = decode_bytes(pages)
    keys, values = [], []
    page_size = batch.md.page_size
    for b, ctx in enumerate(batch.md.context_lens_list):
        table = batch.md.block_tables[b].tolist()
        rows = [(table[p // page_size], p % page_size) for p in range(ctx)]
        keys.append(torch.stack([pool[page, LAYER, 0, off] for page, off in rows]))
        values.append(torch.stack([pool[page, LAYER, 1, off] for page, off in rows]))
    return Batch(pool, batch.md, batch.q, keys, values, batch.query_lens)


def fp8_case(query_lens, context_lens, fmt: str = "e4m3", **kw) -> tuple[Batch, Fp8Pages, Batch]:
    batch = make_batch(query_lens, context_lens, **kw)
    # Spread magnitudes across kv heads so scales differ by head as well as by page.
    per_head = torch.logspace(-2, 0.5, batch.pool.shape[4])
    batch.pool *= per_head[:, None]
    batch.keys = [k * per_head[:, None] for k in batch.keys]
    batch.values = [v * per_head[:, None] for v in batch.values]
    pages = quantize_pages(batch.pool, fmt)
    return batch, pages, dequantized_batch(batch, pages)


@pytest.fixture(scope="module")
def fused() -> CpuFusedBackend:
    cpu_fused.load_kernel()
    return CpuFusedBackend()


SHAPES = {
    "batched_decode": ([1, 1, 1, 1], [1, 5, 16, 41]),
    "prefill": ([23], [23]),
    "prefix_then_new": ([1, 6, 2, 11], [13, 6, 17, 30]),
}


@pytest.mark.parametrize("use_fused", [False, True])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(4, 4), (8, 2), (4, 1)])
def test_attention_over_fp8_pages_equals_attention_over_the_decoded_bytes(
    use_fused: bool, page_size: int, shape: str, num_heads: int, kv_heads: int, request
) -> None:
    backend = request.getfixturevalue("fused") if use_fused else ReferenceBackend()
    query_lens, context_lens = SHAPES[shape]
    head_dim = 32 if use_fused else 16  # 32: the fused kernel's blocked (SIMD) loops
    batch, pages, oracle = fp8_case(
        query_lens, context_lens, page_size=page_size, num_heads=num_heads, kv_heads=kv_heads, head_dim=head_dim
    )
    got = backend.forward(batch.q, pages[:, LAYER], batch.md, 0.3)
    torch.testing.assert_close(got, dense_oracle(oracle, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: the fused kernel's unblocked loops
def test_fused_kernel_decodes_every_finite_code_exactly(fused: CpuFusedBackend, fmt: str, head_dim: int) -> None:
    # One key per sequence: attention returns that key's V row, i.e. the decoded codes x scale.
    fmt_ = FORMATS[fmt]
    codes = torch.arange(256, dtype=torch.uint8)
    decoded = codes.view(fmt_.dtype).to(torch.float32)
    codes[~torch.isfinite(decoded)] = 0  # NaN/inf codes are never written (writes saturate)
    num_seqs = -(-256 // head_dim)
    codes = torch.cat([codes, torch.zeros(num_seqs * head_dim - 256, dtype=torch.uint8)])
    pages = Fp8Pages.allocate(num_seqs, num_layers=1, page_size=1, kv_heads=1, head_dim=head_dim, fmt=fmt)
    pages.codes[:, 0, 1, 0, 0] = codes.view(fmt_.dtype).reshape(num_seqs, head_dim)
    pages.scales[:, 0, 1, 0] = 0.5
    md = AttentionMetadata.build([1] * num_seqs, [1] * num_seqs, [[i] for i in range(num_seqs)], 1)
    out = fused.forward(torch.randn(num_seqs, 1, head_dim), pages[:, 0], md, 1.0)
    expected = codes.view(fmt_.dtype).to(torch.float32).reshape(num_seqs, 1, head_dim) * 0.5
    assert torch.equal(out, expected)


@pytest.mark.parametrize("use_fused", [False, True])
def test_fp8_attention_stays_close_to_full_precision(use_fused: bool, request) -> None:
    backend = request.getfixturevalue("fused") if use_fused else ReferenceBackend()
    batch, pages, _ = fp8_case([1, 6, 2], [40, 6, 17], page_size=16, num_heads=8, kv_heads=2, head_dim=32)
    exact = dense_oracle(batch, 0.2)
    got = backend.forward(batch.q, pages[:, LAYER], batch.md, 0.2)
    assert ((got - exact).norm() / exact.norm()).item() < 0.05  # e4m3: 3 mantissa bits, <= 6 % per element


def test_fused_fp8_result_does_not_depend_on_partitioning() -> None:
    cpu_fused.load_kernel()
    batch, pages, oracle = fp8_case([1, 1], [700, 300], page_size=16, num_heads=8, kv_heads=2, head_dim=32)
    for partition_size in (-1, 256):
        got = CpuFusedBackend(partition_size).forward(batch.q, pages[:, LAYER], batch.md, 0.2)
        torch.testing.assert_close(got, dense_oracle(oracle, 0.2), atol=1e-5, rtol=1e-5)


def test_fused_kernel_refuses_fp8_codes_without_scales(fused: CpuFusedBackend) -> None:
    batch, pages, _ = fp8_case([1], [5], page_size=4)
    with pytest.raises(RuntimeError, match="kv_scales"):
        torch.ops.kvtier_attn.paged_attention(
            batch.q, pages[:, LAYER].codes, batch.md.block_tables, batch.md.query_start, batch.md.context_lens,
            0.2, 0, None,
        )  # fmt: skip


# ---------------------------------------------------------------- layout and writes


def test_pages_are_one_block_of_exact_bytes_with_views_over_it() -> None:
    pages = Fp8Pages.allocate(3, num_layers=2, page_size=5, kv_heads=2, head_dim=8)
    assert pages.raw.shape == (3, 2 * 2 * 5 * 2 * 8 + 2 * 2 * 2 * 4)
    assert pages.shape == (3, 2, 2, 5, 2, 8) and pages.dim() == 6
    pages.scales[1, 1, 0, 1] = 2.0
    at = pages.layout.scale_offset(1, 0, 1)
    assert pages.raw[1, at : at + 4].view(torch.float32).item() == 2.0
    layer = pages[:, 1]
    assert layer.codes.data_ptr() == pages.raw.data_ptr() + 2 * 5 * 2 * 8
    with pytest.raises(InvalidArgument, match="pages\\[:, layer\\]"):
        pages[0]


def test_scales_are_powers_of_two_that_keep_amax_in_range() -> None:
    fmt = FORMATS["e4m3"]
    amax = torch.tensor([0.0, 448.0, 449.0, 1.0, 3e-3, 1e6])
    scales = pow2_scales(amax, fmt)
    assert torch.equal(torch.log2(scales), torch.round(torch.log2(scales)))
    assert (amax / scales <= 448).all() and (amax[1:] / scales[1:] > 224).all()
    assert scales[0] == 1.0


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_writing_token_by_token_gives_the_values_of_quantizing_whole_pages(page_size: int) -> None:
    # Magnitudes grow along the sequence, so a page's scale rises while it fills.
    gen = torch.Generator().manual_seed(4)
    ctx, kv_heads, head_dim = 3 * page_size + 2, 2, 8
    k = torch.randn(ctx, kv_heads, head_dim, generator=gen) * torch.logspace(-2, 2, ctx)[:, None, None]
    v = torch.randn(ctx, kv_heads, head_dim, generator=gen)
    num_pages = -(-ctx // page_size)
    pages = Fp8Pages.allocate(num_pages, num_layers=1, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim)
    pages.raw.fill_(0x7F)  # stale bytes (NaN codes and scales) must not leak into a fresh page
    for pos in range(ctx):
        write_kv_fp8(pages[:, 0], k[pos : pos + 1], v[pos : pos + 1], torch.tensor([pos]))
    whole = torch.zeros(num_pages * page_size, 2, kv_heads, head_dim)
    whole[:ctx, 0], whole[:ctx, 1] = k, v
    whole = whole.reshape(num_pages, page_size, 2, kv_heads, head_dim).transpose(1, 2)[:, None]
    expected = quantize_pages(whole)
    # Values, not bytes: a page whose rounded amax fell to the lower half of the range is held
    # under half the scale with doubled codes, the same numbers.
    full = ctx // page_size  # the tail page's unwritten slots differ (stale there, zero here)
    got, want = pages[:, 0].dequantize(), expected[:, 0].dequantize()
    assert torch.equal(got[:full], want[:full])
    assert torch.equal(got[full:, :, : ctx % page_size], want[full:, :, : ctx % page_size])


@pytest.mark.parametrize("pattern", ["falling", "zeros-then-small", "mixed"])
def test_rows_written_under_a_page_s_held_scale_match_quantizing_the_whole_page(pattern: str) -> None:
    # Falling magnitudes: every row after a page's first fits its scale (codes written in place).
    # Zero rows first: the held scale of 1 marks nothing held, so small rows later take the full path.
    gen = torch.Generator().manual_seed(5)
    page_size, kv_heads, head_dim, ctx = 8, 2, 8, 30
    magnitude = {
        "falling": torch.logspace(2, -2, ctx),
        "zeros-then-small": torch.cat([torch.zeros(4), torch.full((ctx - 4,), 1e-3)]),
        "mixed": torch.logspace(-1, 1, ctx)[torch.randperm(ctx, generator=gen)],
    }[pattern]
    k = torch.randn(ctx, kv_heads, head_dim, generator=gen) * magnitude[:, None, None]
    v = torch.randn(ctx, kv_heads, head_dim, generator=gen) * magnitude.flip(0)[:, None, None]
    num_pages = -(-ctx // page_size)
    pages = Fp8Pages.allocate(num_pages, num_layers=1, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim)
    for start in range(0, ctx, 3):  # three rows per write, so some writes span two pages
        slots = torch.arange(start, min(ctx, start + 3))
        write_kv_fp8(pages[:, 0], k[slots], v[slots], slots)
    whole = torch.zeros(num_pages * page_size, 2, kv_heads, head_dim)
    whole[:ctx, 0], whole[:ctx, 1] = k, v
    whole = whole.reshape(num_pages, page_size, 2, kv_heads, head_dim).transpose(1, 2)[:, None]
    full = ctx // page_size
    got, want = pages[:, 0].dequantize(), quantize_pages(whole)[:, 0].dequantize()
    assert torch.equal(got[:full], want[:full])
    assert torch.equal(got[full:, :, : ctx % page_size], want[full:, :, : ctx % page_size])


def test_a_write_keeps_earlier_rows_of_its_pages_and_leaves_other_pages_alone() -> None:
    batch = make_batch([9, 1], [9, 14], page_size=4, kv_heads=2, head_dim=16)
    pages = quantize_pages(batch.pool)
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(10, 2, 16, generator=gen)
    v = torch.randn(10, 2, 16, generator=gen)
    raw_before, before = pages.raw.clone(), pages[:, LAYER].dequantize()
    ReferenceBackend().write_kv(pages[:, LAYER], k, v, batch.md)
    after = pages[:, LAYER].dequantize()
    slots = batch.md.slot_mapping
    for row, slot in enumerate(slots.tolist()):
        got = after[slot // 4, :, slot % 4]
        want = torch.stack([k[row], v[row]])
        assert ((got - want).abs() <= want.abs() / 16 + 2**-9).all()  # half an e4m3 step
    touched = set((slots // 4).tolist())
    for page in range(pages.num_pages):
        if page not in touched:
            assert torch.equal(pages.raw[page], raw_before[page])
    # Sequence 1 appends position 13 at offset 1 of its last page: offset 0 (position 12) stays.
    last_page = batch.md.block_tables[1, 3].item()
    torch.testing.assert_close(after[last_page, :, 0], before[last_page, :, 0], atol=2**-9, rtol=0)


def test_reference_and_fused_fp8_decode_agree_after_a_decode_write(fused: CpuFusedBackend) -> None:
    batch, pages, _ = fp8_case([1, 1], [9, 16], page_size=4, num_heads=4, kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    fused.write_kv(pages[:, LAYER], k, v, batch.md)
    got = fused.forward(batch.q, pages[:, LAYER], batch.md, 0.25)
    expected = attention_reference(batch.q, pages[:, LAYER], batch.md, 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    dense = dequantized_batch(batch, pages)
    torch.testing.assert_close(got, dense_oracle(dense, 0.25), atol=1e-5, rtol=1e-5)

