"""Paged attention: the reference against a dense oracle, the fused CPU kernel against the
reference, K/V writes, and backend selection.

The oracle never touches the pool's paging: each sequence's K/V is generated contiguous,
written into scattered pages slot by slot, and attention is computed on the contiguous copy.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvtier.domain.errors import FailedPrecondition, InvalidArgument
from kvtier.engine.attention import cpu_fused, get_backend
from kvtier.engine.attention.base import (
    AttentionMetadata,
    ReferenceBackend,
    attention_reference,
    write_kv_reference,
)
from kvtier.engine.attention.cpu_fused import SDPA_MIN_QUERY_LEN, CpuFusedBackend
from kvtier.engine.attention.cuda import flash_attn_installed
from kvtier.engine.attention.registry import ENV_VAR

NUM_LAYERS = 3
LAYER = 1  # a middle layer, so kv_layer's page stride spans other layers


@dataclass
class Batch:
    pool: torch.Tensor  # [num_pages, layers, 2, page_size, kv_heads, head_dim]
    md: AttentionMetadata
    q: torch.Tensor  # [T, num_heads, head_dim]
    keys: list[torch.Tensor]  # per sequence [ctx, kv_heads, head_dim], contiguous
    values: list[torch.Tensor]
    query_lens: list[int]

    @property
    def kv_layer(self) -> torch.Tensor:
        return self.pool[:, LAYER]


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    page_size: int = 4,
    num_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    spare_pages: int = 7,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """Sequences over randomly scattered pages of a pool with spare (never read) pages."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    pages_needed = [-(-ctx // page_size) for ctx in context_lens]
    num_pages = sum(pages_needed) + spare_pages
    pool = torch.randn(num_pages, NUM_LAYERS, 2, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    ids = rng.sample(range(num_pages), sum(pages_needed))
    tables, keys, values = [], [], []
    for ctx, n in zip(context_lens, pages_needed, strict=True):
        table, ids = ids[:n], ids[n:]
        tables.append(table)
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(ctx):
            page, offset = table[pos // page_size], pos % page_size
            pool[page, LAYER, 0, offset] = k[pos]
            pool[page, LAYER, 1, offset] = v[pos]
        keys.append(k)
        values.append(v)
    md = AttentionMetadata.build(query_lens, context_lens, tables, page_size)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    return Batch(pool, md, q, keys, values, list(query_lens))


def dense_oracle(batch: Batch, scale: float) -> torch.Tensor:
    """Causal SDPA on each sequence's contiguous K/V; row i sees keys 0..ctx - q_len + i."""
    outs = []
    start = 0
    for q_len, k, v in zip(batch.query_lens, batch.keys, batch.values, strict=True):
        ctx = k.shape[0]
        q = batch.q[start : start + q_len].transpose(0, 1)[None]  # [1, H, q_len, D]
        group = q.shape[1] // k.shape[1]
        kd = k.float().transpose(0, 1).repeat_interleave(group, dim=0)[None]
        vd = v.float().transpose(0, 1).repeat_interleave(group, dim=0)[None]
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
        outs.append(F.scaled_dot_product_attention(q, kd, vd, attn_mask=mask, scale=scale)[0].transpose(0, 1))
        start += q_len
    return torch.cat(outs)


@pytest.fixture(scope="module")
def fused() -> CpuFusedBackend:
    """Builds (or loads the cached) C++ kernel once per module. A build failure fails the tests."""
    cpu_fused.load_kernel()
    return CpuFusedBackend()


# (query_lens, context_lens): decode, prefill, prefix + new tokens crossing page boundaries.
SHAPES = {
    "single_decode": ([1], [1]),
    "single_prefill": ([7], [7]),
    "prefix_then_new": ([3], [9]),
    "batched_decode": ([1, 1, 1, 1], [1, 4, 5, 23]),
    "mixed": ([1, 6, 2, 11], [13, 6, 17, 30]),
}


# ---------------------------------------------------------------- reference vs dense oracle


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(2, 2), (4, 2), (4, 1)])
def test_reference_matches_dense_oracle(page_size: int, shape: str, num_heads: int, kv_heads: int) -> None:
    query_lens, context_lens = SHAPES[shape]
    batch = make_batch(query_lens, context_lens, page_size=page_size, num_heads=num_heads, kv_heads=kv_heads)
    scale = 0.3
    got = ReferenceBackend().forward(batch.q, batch.kv_layer, batch.md, scale)
    torch.testing.assert_close(got, dense_oracle(batch, scale), atol=1e-5, rtol=1e-5)


def poisoned_outside_context(batch: Batch) -> torch.Tensor:
    """A copy of the pool that is NaN except the slots holding each sequence's context on
    LAYER: other layers, spare pages, padding of block tables and the tail of each last page."""
    poisoned = torch.full_like(batch.pool, float("nan"))
    page_size = batch.md.page_size
    for b, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        for pos in range(k.shape[0]):
            page = int(batch.md.block_tables[b, pos // page_size])
            poisoned[page, LAYER, 0, pos % page_size] = k[pos]
            poisoned[page, LAYER, 1, pos % page_size] = v[pos]
    return poisoned


@pytest.mark.parametrize("use_fused", [False, True])
def test_attention_reads_only_the_context_slots_of_its_layer(use_fused: bool, request) -> None:
    backend = request.getfixturevalue("fused") if use_fused else ReferenceBackend()
    batch = make_batch([2, 1, 20], [6, 9, 37], page_size=4, num_heads=4, kv_heads=2, head_dim=16)
    poisoned = poisoned_outside_context(batch)
    got = backend.forward(batch.q, poisoned[:, LAYER], batch.md, 0.25)
    torch.testing.assert_close(got, dense_oracle(batch, 0.25), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- write_kv


def _write_kv_case(dtype: torch.dtype = torch.float32):
    batch = make_batch([3, 1, 5], [3, 8, 14], page_size=4, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(batch.md.num_tokens, 2, 16, generator=gen)
    v = torch.randn(batch.md.num_tokens, 2, 16, generator=gen)
    return batch, k, v


@pytest.mark.parametrize("use_fused", [False, True])
def test_write_kv_places_rows_at_their_slots_and_nothing_else(use_fused: bool, request) -> None:
    backend = request.getfixturevalue("fused") if use_fused else ReferenceBackend()
    batch, k, v = _write_kv_case()
    before = batch.pool.clone()
    backend.write_kv(batch.kv_layer, k, v, batch.md)

    expected = before.clone()
    page_size = batch.md.page_size
    for row, slot in enumerate(batch.md.slot_mapping.tolist()):
        expected[slot // page_size, LAYER, 0, slot % page_size] = k[row]
        expected[slot // page_size, LAYER, 1, slot % page_size] = v[row]
    assert torch.equal(batch.pool, expected)


def test_fused_write_kv_casts_to_the_pool_dtype(fused: CpuFusedBackend) -> None:
    batch, k, v = _write_kv_case(torch.bfloat16)
    reference_pool = batch.pool.clone()
    write_kv_reference(reference_pool[:, LAYER], k, v, batch.md)
    fused.write_kv(batch.kv_layer, k, v, batch.md)
    assert torch.equal(batch.pool, reference_pool)


def test_fused_write_kv_rejects_a_slot_outside_the_pool(fused: CpuFusedBackend) -> None:
    batch, k, v = _write_kv_case()
    batch.md.slot_mapping[1] = batch.pool.shape[0] * batch.md.page_size
    before = batch.pool.clone()
    with pytest.raises(RuntimeError, match="slot_mapping"):
        fused.write_kv(batch.kv_layer, k, v, batch.md)
    assert torch.equal(batch.pool, before)


# ---------------------------------------------------------------- cpu-fused vs reference

DECODE_CONTEXTS = [1, 15, 16, 17, 300, 33, 2, 64]


def decode_batch(contexts: list[int], page_size: int, num_heads: int, kv_heads: int) -> Batch:
    """One new token for each of ``contexts`` (head_dim 32)."""
    return make_batch([1] * len(contexts), contexts, page_size=page_size, num_heads=num_heads,
                      kv_heads=kv_heads, head_dim=32)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(8, 8), (16, 8), (8, 2), (4, 1)])
@pytest.mark.parametrize("partition_size", [0, -1, 256])
def test_fused_decode_matches_reference(
    fused: CpuFusedBackend, page_size: int, num_heads: int, kv_heads: int, partition_size: int
) -> None:
    batch = decode_batch(DECODE_CONTEXTS, page_size, num_heads, kv_heads)
    backend = CpuFusedBackend(partition_size=partition_size)
    got = backend.forward(batch.q, batch.kv_layer, batch.md, 0.2)
    expected = attention_reference(batch.q, batch.kv_layer, batch.md, 0.2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: not a multiple of 16, the unblocked loops
@pytest.mark.parametrize("partition_size", [0, 64])
@pytest.mark.parametrize("sdpa_min_query_len", [SDPA_MIN_QUERY_LEN, 1 << 30])  # 1 << 30: all in the kernel
def test_fused_prefill_with_prefix_matches_reference(
    fused: CpuFusedBackend,
    page_size: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    partition_size: int,
    sdpa_min_query_len: int,
) -> None:
    # Query tiles of 32 rows: 70 new tokens span three tiles; 1-row decodes ride along. With
    # the default threshold the 70-row sequence and the 80 rows after a 70-token prefix go
    # through SDPA and the rest through the kernel, each writing its own rows of the output.
    query_lens = [70, 1, 5, 33, 1, 16, 80]
    context_lens = [70, 40, 21, 100, 1, 47, 150]
    batch = make_batch(
        query_lens,
        context_lens,
        page_size=page_size,
        num_heads=num_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
    backend = CpuFusedBackend(partition_size=partition_size, sdpa_min_query_len=sdpa_min_query_len)
    got = backend.forward(batch.q, batch.kv_layer, batch.md, head_dim**-0.5)
    torch.testing.assert_close(got, dense_oracle(batch, head_dim**-0.5), atol=1e-5, rtol=1e-5)
    expected = attention_reference(batch.q, batch.kv_layer, batch.md, head_dim**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_heads", "kv_heads"), [(4, 4), (4, 1)])
def test_rows_after_a_cached_prefix_match_the_dense_oracle(num_heads: int, kv_heads: int) -> None:
    # 300 and 129 new rows: several SDPA row blocks, the last one partial.
    batch = make_batch([300, 129], [1000, 140], page_size=16, num_heads=num_heads, kv_heads=kv_heads, head_dim=32)
    got = attention_reference(batch.q, batch.kv_layer, batch.md, 0.2)
    torch.testing.assert_close(got, dense_oracle(batch, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_reads_half_precision_pools_in_fp32(fused: CpuFusedBackend, dtype: torch.dtype) -> None:
    batch = make_batch(
        [1, 9, 1], [300, 20, 17], page_size=16, num_heads=8, kv_heads=2, head_dim=32, dtype=dtype
    )
    q = batch.q.to(dtype)
    got = fused.forward(q, batch.kv_layer, batch.md, 0.2)
    assert got.dtype == dtype
    expected = attention_reference(q.float(), batch.kv_layer.float(), batch.md, 0.2)
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2)
    # Before the final cast the kernel is fp32 throughout: compare in fp32 exactly.
    got32 = fused.forward(q.float(), batch.kv_layer, batch.md, 0.2)
    torch.testing.assert_close(got32, expected, atol=1e-5, rtol=1e-5)


def test_fused_result_does_not_depend_on_thread_count(fused: CpuFusedBackend) -> None:
    batch = make_batch([1, 1, 40], [500, 30, 90], page_size=16, num_heads=8, kv_heads=2, head_dim=32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused.forward(batch.q, batch.kv_layer, batch.md, 0.2)
    finally:
        torch.set_num_threads(threads)
    many = fused.forward(batch.q, batch.kv_layer, batch.md, 0.2)
    torch.testing.assert_close(one, many, atol=1e-6, rtol=1e-6)


def test_fused_rejects_a_page_id_outside_the_pool(fused: CpuFusedBackend) -> None:
    batch = make_batch([1, 1], [5, 9], page_size=4)
    batch.md.block_tables[1, 2] = batch.pool.shape[0]
    with pytest.raises(RuntimeError, match="page id"):
        fused.forward(batch.q, batch.kv_layer, batch.md, 0.2)


def test_fused_falls_back_to_reference_with_one_warning(monkeypatch, caplog) -> None:
    def no_compiler() -> None:
        raise FailedPrecondition("no C++ compiler (test)")

    monkeypatch.setattr(cpu_fused, "load_kernel", no_compiler)
    backend = CpuFusedBackend()
    batch = make_batch([2, 1], [6, 9])
    expected = attention_reference(batch.q, batch.kv_layer, batch.md, 0.25)
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.attention"):
        got = backend.forward(batch.q, batch.kv_layer, batch.md, 0.25)
        backend.write_kv(batch.kv_layer, batch.q[:, :2], batch.q[:, :2], batch.md)
    torch.testing.assert_close(got, expected)
    warnings = [r for r in caplog.records if "falls back to torch-reference" in r.getMessage()]
    assert len(warnings) == 1


# ---------------------------------------------------------------- registry


def test_unknown_backend_lists_the_known_ones(monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(InvalidArgument, match="cpu-fused, flash-attn, torch-reference") as err:
        get_backend("flash-attention", "cpu")
    assert err.value.field == "attention_backend"


def test_env_var_replaces_auto_and_is_validated(monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, "torch-reference")
    assert get_backend("auto", "cpu").name == "torch-reference"
    assert get_backend("cpu-fused", "cpu").name == "cpu-fused"  # an explicit name wins
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(InvalidArgument, match=ENV_VAR):
        get_backend("auto", "cpu")


def test_auto_picks_cpu_fused_on_cpu_and_logs_once(fused, monkeypatch, caplog) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr("kvtier.engine.attention.registry._logged", set())
    with caplog.at_level(logging.INFO, logger="kvtier.engine.attention"):
        assert get_backend("auto", "cpu").name == "cpu-fused"
        assert get_backend(device="cpu").name == "cpu-fused"
    assert sum("attention backend cpu-fused" in r.getMessage() for r in caplog.records) == 1


def test_auto_falls_back_to_reference_without_a_kernel(monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)

    def no_compiler() -> None:
        raise FailedPrecondition("no C++ compiler (test)")

    monkeypatch.setattr(cpu_fused, "load_kernel", no_compiler)
    assert get_backend("auto", "cpu").name == "torch-reference"
    assert get_backend("auto", "meta").name == "torch-reference"


def test_backend_on_the_wrong_device_is_refused(monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(InvalidArgument, match="cpu pools"):
        get_backend("cpu-fused", "cuda")
    with pytest.raises(InvalidArgument, match="cuda pools"):
        get_backend("flash-attn", "cpu")


@pytest.mark.skipif(flash_attn_installed(), reason="flash-attn is installed")
def test_flash_attn_without_the_package_says_how_to_get_it(monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(FailedPrecondition, match="install flash-attn"):
        get_backend("flash-attn", "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attn_matches_reference_on_cuda() -> None:
    pytest.importorskip("flash_attn")
    batch = make_batch([1, 7, 1], [300, 260, 17], page_size=256, num_heads=8, kv_heads=2, head_dim=64)
    kv_layer = batch.kv_layer.to("cuda", torch.bfloat16)
    md = AttentionMetadata.build(
        batch.query_lens, batch.md.context_lens_list, batch.md.block_tables.tolist(), 256, device="cuda"
    )
    q = batch.q.to("cuda", torch.bfloat16)
    got = get_backend("flash-attn", "cuda").forward(q, kv_layer, md, 0.125)
    expected = attention_reference(q.float(), kv_layer.float(), md, 0.125)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
