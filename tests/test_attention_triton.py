"""The Triton paged-attention backend against the reference (and the dense oracle).

On CPU (the default) the kernels run in Triton's interpreter. ``@triton.jit`` decides
between interpreter and compiler when a function is decorated, and triton's own library
functions (``tl.sum``, ``tl.cdiv``...) are decorated when triton is imported, so
``TRITON_INTERPRET=1`` is set while this module imports triton and the kernels, and again
while its tests run (a module-scoped fixture); other modules never see it. Interpretation
is still process-wide once triton is imported: nothing else in the CPU suite uses triton.
If triton was imported compiled before this module (another test), the module skips.
Shapes stay small: the interpreter runs every program in numpy.

With ``KVTIER_TEST_DEVICE=cuda`` the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

DEVICE = os.environ.get("KVTIER_TEST_DEVICE", "cpu")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("KVTIER_TEST_DEVICE=cuda but CUDA is not available", allow_module_level=True)

with pytest.MonkeyPatch.context() as _mp:
    if DEVICE == "cpu":
        _mp.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
    from kvtier.engine.attention import triton_kernels

if DEVICE == "cpu" and type(triton.language.cdiv).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported compiled before this module; run it alone", allow_module_level=True)
assert triton_kernels.INTERPRETED == (DEVICE == "cpu")

from test_attention import (  # noqa: E402
    LAYER,
    Batch,
    decode_batch,
    dense_oracle,
    make_batch,
    poisoned_outside_context,
)

from kvtier.domain.errors import FailedPrecondition, InvalidArgument  # noqa: E402
from kvtier.engine.attention import get_backend  # noqa: E402
from kvtier.engine.attention.base import AttentionMetadata, attention_reference, write_kv_reference  # noqa: E402
from kvtier.engine.attention.registry import ENV_VAR  # noqa: E402
from kvtier.engine.attention.triton_paged import TritonPagedBackend  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def interpreter_while_running():
    """The interpreter also consults TRITON_INTERPRET while kernels run."""
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        yield


def backend(num_splits: int = 0) -> TritonPagedBackend:
    return TritonPagedBackend(num_splits=num_splits)


def on_device(batch: Batch, dtype: torch.dtype | None = None):
    """(q, kv_layer, md) of ``batch`` on DEVICE; ``dtype`` casts q (the pool keeps its own)."""
    md = batch.md
    md = AttentionMetadata.build(
        batch.query_lens, md.context_lens_list, md.block_tables.tolist(), md.page_size, device=DEVICE
    )
    q = batch.q.to(DEVICE, dtype or batch.q.dtype)
    return q, batch.pool.to(DEVICE)[:, LAYER], md


# Ragged decode: single-slot, exact, partial and multi-page contexts.
DECODE_CONTEXTS = [1, 4, 5, 16, 17, 33, 70]


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("num_splits", [0, 4])
def test_decode_matches_reference(page_size: int, num_heads: int, kv_heads: int, num_splits: int) -> None:
    batch = decode_batch(DECODE_CONTEXTS, page_size, num_heads, kv_heads)
    q, kv_layer, md = on_device(batch)
    got = backend(num_splits).forward(q, kv_layer, md, 0.2)
    expected = attention_reference(q, kv_layer, md, 0.2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("head_dim", [32, 24])  # 24: not a power of two, masked lanes
def test_prefill_with_and_without_prefix_matches_reference(
    page_size: int, num_heads: int, kv_heads: int, head_dim: int
) -> None:
    # 70 and 33 new tokens span several 64-row tiles (rows = tokens x group); the 70 and 16
    # token sequences have no prefix, the others attend over a cached one; decodes ride along.
    query_lens = [70, 1, 5, 33, 16]
    context_lens = [70, 40, 21, 100, 16]
    batch = make_batch(
        query_lens,
        context_lens,
        page_size=page_size,
        num_heads=num_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
    q, kv_layer, md = on_device(batch)
    scale = head_dim**-0.5
    got = backend().forward(q, kv_layer, md, scale)
    torch.testing.assert_close(got, attention_reference(q, kv_layer, md, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.cpu(), dense_oracle(batch, scale), atol=1e-5, rtol=1e-5)


def test_split_prefill_merges_chunks_some_rows_cannot_see() -> None:
    # Early rows of a tile see none of the later chunks: their partial max is -inf.
    batch = make_batch([20, 3], [150, 3], page_size=4, num_heads=4, kv_heads=2, head_dim=16)
    q, kv_layer, md = on_device(batch)
    got = backend(num_splits=8).forward(q, kv_layer, md, 0.3)
    torch.testing.assert_close(got, attention_reference(q, kv_layer, md, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [0, 2])
def test_half_precision_pools_accumulate_in_fp32(dtype: torch.dtype, num_splits: int) -> None:
    batch = make_batch(
        [1, 9, 1], [130, 20, 17], page_size=16, num_heads=8, kv_heads=2, head_dim=32, dtype=dtype
    )
    q, kv_layer, md = on_device(batch, dtype)
    got = backend(num_splits).forward(q, kv_layer, md, 0.2)
    assert got.dtype == dtype
    expected = attention_reference(q.float(), kv_layer.float(), md, 0.2)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_output_takes_the_dtype_of_q() -> None:
    batch = make_batch([1, 4], [20, 9], page_size=4, num_heads=4, kv_heads=2, dtype=torch.bfloat16)
    q, kv_layer, md = on_device(batch)  # q stays fp32 over a bf16 pool
    got = backend().forward(q, kv_layer, md, 0.25)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, attention_reference(q, kv_layer, md, 0.25), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_splits", [0, 4])
def test_attention_reads_only_the_context_slots_of_its_layer(num_splits: int) -> None:
    batch = make_batch([2, 1, 20], [6, 9, 37], page_size=4, num_heads=4, kv_heads=2, head_dim=16)
    batch.pool = poisoned_outside_context(batch)
    q, kv_layer, md = on_device(batch)
    got = backend(num_splits).forward(q, kv_layer, md, 0.25)
    torch.testing.assert_close(got.cpu(), dense_oracle(batch, 0.25), atol=1e-5, rtol=1e-5)


def test_write_kv_then_decode_sees_the_new_token() -> None:
    batch = make_batch([1, 1], [9, 16], page_size=4, num_heads=4, kv_heads=2, head_dim=16)
    q, kv_layer, md = on_device(batch)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 16, generator=gen).to(DEVICE)
    v = torch.randn(2, 2, 16, generator=gen).to(DEVICE)
    expected_layer = kv_layer.clone()
    write_kv_reference(expected_layer, k, v, md)
    triton_backend = backend()
    triton_backend.write_kv(kv_layer, k, v, md)
    assert torch.equal(kv_layer, expected_layer)
    got = triton_backend.forward(q, kv_layer, md, 0.25)
    torch.testing.assert_close(got, attention_reference(q, expected_layer, md, 0.25), atol=1e-5, rtol=1e-5)


def test_num_splits_must_be_a_power_of_two() -> None:
    with pytest.raises(InvalidArgument, match="power of two"):
        backend(num_splits=3)


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter runs on CPU tensors by design")
def test_compiled_kernels_refuse_cpu_pools() -> None:
    batch = make_batch([1], [5])
    with pytest.raises(FailedPrecondition, match="CUDA pools"):
        backend().forward(batch.q, batch.kv_layer, batch.md, 0.25)


# ---------------------------------------------------------------- registry


def test_triton_is_refused_for_cpu_pools(monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(InvalidArgument, match="cuda pools"):
        get_backend("triton", "cpu")


@pytest.mark.parametrize(
    ("flash_attn_present", "why"),
    [(False, "flash-attn is not installed"), (True, "flash-attn needs page_size % 256 == 0")],
)
def test_auto_on_cuda_picks_triton_when_flash_attn_cannot_serve(
    flash_attn_present: bool, why: str, monkeypatch, caplog
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr("kvtier.engine.attention.registry._logged", set())
    monkeypatch.setattr("kvtier.engine.attention.cuda.flash_attn_installed", lambda: flash_attn_present)
    with caplog.at_level(logging.INFO, logger="kvtier.engine.attention"):
        assert get_backend("auto", "cuda", page_size=16).name == "triton"
    [record] = [r for r in caplog.records if "attention backend triton" in r.getMessage()]
    assert why in record.getMessage()


def test_auto_on_cuda_falls_back_to_reference_without_triton(monkeypatch, caplog) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr("kvtier.engine.attention.registry._logged", set())
    monkeypatch.setattr("kvtier.engine.attention.cuda.flash_attn_installed", lambda: False)

    def no_triton():
        raise FailedPrecondition("triton is not importable (test)")

    monkeypatch.setattr("kvtier.engine.attention.triton_paged.load_kernels", no_triton)
    with caplog.at_level(logging.INFO, logger="kvtier.engine.attention"):
        assert get_backend("auto", "cuda", page_size=16).name == "torch-reference"
    assert any("triton is not importable (test)" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- FP8 pages


@pytest.mark.parametrize(
    ("page_size", "num_heads", "kv_heads", "num_splits", "fmt"),
    [
        (1, 8, 2, 0, "e4m3"),
        (1, 4, 4, 4, "e5m2"),
        (5, 4, 4, 4, "e4m3"),
        (5, 8, 2, 0, "e4m3"),
        (16, 8, 2, 4, "e4m3"),
        (16, 8, 2, 0, "e5m2"),
    ],
)
def test_fp8_pages_equal_attention_over_the_decoded_bytes(
    page_size: int, num_heads: int, kv_heads: int, num_splits: int, fmt: str
) -> None:
    from test_attention_fp8 import fp8_case

    # Decodes next to prefill-with-prefix and a prefill from scratch.
    batch, pages, oracle = fp8_case(
        [1, 1, 6, 19], [1, 33, 17, 19], fmt, page_size=page_size, num_heads=num_heads, kv_heads=kv_heads,
        head_dim=16,
    )  # fmt: skip
    md = AttentionMetadata.build(
        batch.query_lens, batch.md.context_lens_list, batch.md.block_tables.tolist(), page_size, device=DEVICE
    )
    pages.raw = pages.raw.to(DEVICE)
    layer = type(pages)(pages.raw, pages.layout, pages.format)[:, LAYER]
    got = backend(num_splits).forward(batch.q.to(DEVICE), layer, md, 0.3)
    torch.testing.assert_close(got.cpu(), dense_oracle(oracle, 0.3), atol=1e-5, rtol=1e-5)


def test_fp8_pages_with_bf16_queries_compute_in_bf16() -> None:
    from test_attention_fp8 import fp8_case

    batch, pages, oracle = fp8_case([1, 5], [40, 9], page_size=16, num_heads=8, kv_heads=2, head_dim=32)
    md = AttentionMetadata.build(
        batch.query_lens, batch.md.context_lens_list, batch.md.block_tables.tolist(), 16, device=DEVICE
    )
    layer = type(pages)(pages.raw.to(DEVICE), pages.layout, pages.format)[:, LAYER]
    batch.q = batch.q.to(torch.bfloat16)
    got = backend().forward(batch.q.to(DEVICE), layer, md, 0.2)
    assert got.dtype == torch.bfloat16
    oracle.q = batch.q.float()  # the products see bf16 queries; p is rounded to bf16 too
    torch.testing.assert_close(got.cpu().float(), dense_oracle(oracle, 0.2), atol=3e-2, rtol=3e-2)
