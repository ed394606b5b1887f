"""Fused page copy + checksum: the C++ kernel against the reference definition, and its fallback."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cache.page_pool import PagePool, PoolGeometry
from kvtier.domain.errors import FailedPrecondition
from kvtier.domain.tiers import Tier
from kvtier.tiers import copy as page_copy
from kvtier.tiers.checksum import page_checksum, page_checksums
from kvtier.tiers.dram import aligned_host_tensor, make_dram_pool
from kvtier.tiers.native import NativeExtension
from kvtier.tiers.transfer import TransferReason
from kvtier.tiers.transfer_engine import TransferEngine

DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    """Builds (or loads the cached) kernel once; a build failure fails these tests."""
    page_copy.load_kernel()


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch) -> None:
    monkeypatch.delenv(page_copy.ENV_VAR, raising=False)


def random_pages(n: int, page_elems: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Pages of random bytes (every bit pattern, NaNs included: the copy is of bytes)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, page_elems * itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 6),
    page_elems=st.integers(1, 3000),
    dtype=st.sampled_from(DTYPES),
    streaming=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_copies_bytes_and_equals_the_reference_checksum(n, page_elems, dtype, streaming, seed):
    src = random_pages(n, page_elems, dtype, seed)
    dst = torch.zeros_like(src)
    got = page_copy.copy_with_checksums(src, dst, streaming=streaming)
    assert got.dtype == torch.int64 and got.shape == (n,)
    assert torch.equal(got, page_checksums(src))
    assert same_bytes(dst, src)
    assert torch.equal(page_copy.checksums(src), page_checksums(src))


@pytest.mark.parametrize("page_bytes", [1, 8, 511, 512, 513, 4096 + 24, 32768, 65536 + 8])
def test_partial_tail_blocks_are_summed_zero_padded(page_bytes):
    src = random_pages(3, page_bytes, torch.uint8, seed=page_bytes)
    dst = torch.empty_like(src)
    got = page_copy.copy_with_checksums(src, dst)
    padded = torch.nn.functional.pad(src, (0, (-page_bytes) % 512))
    expected = [page_checksum(src[i].numpy().tobytes()) for i in range(3)]
    assert [v & (2**64 - 1) for v in got.tolist()] == expected
    assert torch.equal(got, page_checksums(padded))  # the padding adds nothing
    assert torch.equal(dst, src)


def test_golden_value_from_the_kernel():
    # The same vector that pins the on-disk algorithm in tests/test_checksum.py.
    page = torch.frombuffer(bytearray(bytes(range(256)) * 4), dtype=torch.uint8)[None]
    assert int(page_copy.checksums(page)[0]) & (2**64 - 1) == 0x8281807F7E7D7C00


@pytest.mark.parametrize("streaming", [True, False, None])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_large_runs_with_streaming_stores_and_helper_threads(streaming, num_threads):
    # 40 pages of 32 KiB: several 256 KiB chunks to share; an aligned destination allows
    # streaming stores (the kernel checks alignment itself and falls back to plain stores).
    # None (the default) streams: 1.25 MiB is above STREAM_MIN_BYTES.
    assert 40 * 32768 >= page_copy.STREAM_MIN_BYTES
    src = random_pages(40, 8192, torch.float32, seed=7)
    raw = aligned_host_tensor(src.numel() * 4)
    raw.zero_()
    dst = raw.view(torch.float32).view(src.shape)
    got = page_copy.copy_with_checksums(src, dst, streaming=streaming, num_threads=num_threads)
    assert torch.equal(got, page_checksums(src)) and same_bytes(dst, src)
    # A destination off the 64-byte grid cannot take streaming stores: plain stores, same result.
    backing = torch.zeros(src.numel() * 4 + 64, dtype=torch.uint8)
    shift = 8 if backing.data_ptr() % 64 == 0 else 0
    odd = backing[shift : shift + src.numel() * 4].view(torch.float32).view(src.shape)
    assert odd.data_ptr() % 64
    got = page_copy.copy_with_checksums(src, odd, streaming=True, num_threads=num_threads)
    assert torch.equal(got, page_checksums(src)) and same_bytes(odd, src)


def test_strided_views_are_refused_by_the_op_and_handled_by_the_wrapper():
    base = random_pages(4, 1024, torch.float32, seed=3)
    strided = base[::2]  # every other page: not one block of memory
    assert not strided.is_contiguous()
    dst = torch.zeros(2, 1024)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kvtier_page.copy_checksum(strided, dst, 0, 1)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kvtier_page.checksum(strided)
    got = page_copy.copy_with_checksums(strided, dst)  # torch path
    assert torch.equal(got, page_checksums(strided)) and same_bytes(dst, strided)
    out = torch.zeros(1024, 4).t()  # a non-contiguous destination too
    assert torch.equal(page_copy.copy_with_checksums(base, out), page_checksums(base))
    assert same_bytes(out, base)
    assert torch.equal(page_copy.checksums(strided), page_checksums(strided))


def test_the_op_checks_its_contract():
    src = random_pages(4, 256, torch.float32, seed=4)
    with pytest.raises(RuntimeError, match="pages"):
        torch.ops.kvtier_page.copy_checksum(src, torch.zeros(3, 256), 0, 1)
    with pytest.raises(RuntimeError, match="bytes"):
        torch.ops.kvtier_page.copy_checksum(src, torch.zeros(4, 128), 0, 1)
    whole = torch.zeros(6, 256)
    with pytest.raises(RuntimeError, match="overlap"):
        torch.ops.kvtier_page.copy_checksum(whole[:4], whole[2:], 0, 1)
    with pytest.raises(ValueError, match="4 pages into 3"):
        page_copy.copy_with_checksums(src, torch.zeros(3, 256))


def test_a_dtype_conversion_goes_through_torch():
    src = random_pages(3, 64, torch.float32, seed=5)
    src = torch.nan_to_num(src, nan=0.0, posinf=1.0, neginf=-1.0)
    dst = torch.zeros(3, 64, dtype=torch.float64)
    got = page_copy.copy_with_checksums(src, dst)
    assert torch.equal(dst, src.double()) and torch.equal(got, page_checksums(dst))


@pytest.mark.parametrize("how", ["env", "argument"])
def test_disabled_kernel_gives_identical_results(how, monkeypatch):
    src = random_pages(5, 777, torch.bfloat16, seed=6)
    fused_dst, torch_dst = torch.zeros_like(src), torch.zeros_like(src)
    fused = page_copy.copy_with_checksums(src, fused_dst)
    if how == "env":
        monkeypatch.setenv(page_copy.ENV_VAR, "torch")
        assert not page_copy.kernel_enabled()
        fallback = page_copy.copy_with_checksums(src, torch_dst)
        assert torch.equal(page_copy.checksums(src), fused)
    else:
        fallback = page_copy.copy_with_checksums(src, torch_dst, use_kernel=False)
    assert torch.equal(fused, fallback) and same_bytes(fused_dst, torch_dst)


def test_bad_env_value_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(page_copy.ENV_VAR, "fast")
    with pytest.raises(FailedPrecondition, match=page_copy.ENV_VAR):
        page_copy.copy_with_checksums(torch.zeros(1, 8), torch.zeros(1, 8))


def test_unbuildable_kernel_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    missing = NativeExtension(
        "kvtier_page_copy_missing", tmp_path / "missing.cpp", what="page copy kernel", fallback_hint="x"
    )
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))  # leave the real cache alone
    monkeypatch.setattr(page_copy, "_EXTENSION", missing)
    monkeypatch.setattr(page_copy, "_warned", False)
    src = random_pages(2, 100, torch.float32, seed=8)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.copy"):
        for _ in range(3):
            dst = torch.zeros_like(src)
            assert torch.equal(page_copy.copy_with_checksums(src, dst), page_checksums(src))
            assert same_bytes(dst, src)
    warnings = [r for r in caplog.records if "fall back to torch" in r.getMessage()]
    assert len(warnings) == 1 and "could not be built" in warnings[0].getMessage()
    with pytest.raises(FailedPrecondition, match="could not be built"):
        page_copy.load_kernel()  # remembered: the same error, no second build


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_src=st.integers(1, 40),
    num_dst=st.integers(1, 40),
    page_elems=st.sampled_from([1, 100, 128, 1000, 8192]),
    dtype=st.sampled_from(DTYPES),
    part_pages=st.none() | st.integers(1, 7),
    num_threads=st.integers(1, 3),
    use_kernel=st.sampled_from([None, False]),
)
def test_indexed_copy_moves_the_named_pages_and_returns_their_checksums(
    data, num_src, num_dst, page_elems, dtype, part_pages, num_threads, use_kernel
):
    src = random_pages(num_src, page_elems, dtype, seed=num_src * 41 + num_dst)
    dst = random_pages(num_dst, page_elems, dtype, seed=7)
    before = dst.clone()
    n = data.draw(st.integers(0, num_dst))
    dst_ids = np.array(data.draw(st.permutations(range(num_dst)))[:n], dtype=np.int64)
    # Sources may repeat (one page copied to two places) and may run consecutively.
    src_ids = np.array(data.draw(st.lists(st.integers(0, num_src - 1), min_size=n, max_size=n)), dtype=np.int64)
    parts: list[int] = []
    sums = page_copy.copy_pages_with_checksums(
        src, dst, src_ids, dst_ids, part_pages=part_pages, before_part=parts.append,
        num_threads=num_threads, use_kernel=use_kernel,
    )
    assert sums.dtype == np.uint64 and sums.shape == (n,)
    assert sums.tolist() == page_checksums(src[src_ids]).numpy().view(np.uint64).tolist()
    assert same_bytes(dst[dst_ids], src[src_ids])
    untouched = np.setdiff1d(np.arange(num_dst), dst_ids)
    assert same_bytes(dst[untouched], before[untouched])
    assert parts == list(range(0, n, part_pages or max(n, 1)))


def test_indexed_copy_stops_between_parts_when_the_hook_raises():
    src = random_pages(10, 512, torch.float32, seed=11)
    dst = torch.zeros_like(src)
    out = np.zeros(10, dtype=np.uint64)

    def stop_at_six(num_copied: int) -> None:
        if num_copied >= 6:
            raise InterruptedError

    ids = np.arange(10)[::-1].copy()  # read-only or reversed ids are fine
    with pytest.raises(InterruptedError):
        page_copy.copy_pages_with_checksums(src, dst, ids, ids, out, part_pages=3, before_part=stop_at_six)
    assert same_bytes(dst[ids[:6]], src[ids[:6]]) and not dst[ids[6:]].any()
    assert out[:6].tolist() == page_checksums(src[ids[:6]]).numpy().view(np.uint64).tolist()
    assert not out[6:].any()


def test_the_indexed_op_checks_its_contract():
    src, dst = random_pages(4, 256, torch.float32, seed=12), torch.zeros(6, 256)
    ids = torch.tensor([0, 1, 2])
    sums = torch.zeros(3, dtype=torch.int64)
    op = torch.ops.kvtier_page.copy_checksum_pages
    with pytest.raises(RuntimeError, match=r"src_pages\[1\] = 4 is out of range \[0, 4\)"):
        op(src, dst, torch.tensor([0, 4, 1]), ids, sums, 0, 3, 0, 1)
    with pytest.raises(RuntimeError, match=r"dst_pages\[2\] = -1 is out of range"):
        op(src, dst, ids, torch.tensor([0, 1, -1]), sums, 0, 3, 0, 1)
    with pytest.raises(RuntimeError, match="differ in length"):
        op(src, dst, ids, torch.tensor([0, 1]), sums, 0, 3, 0, 1)
    with pytest.raises(RuntimeError, match=r"range \[1, 4\) is not within"):
        op(src, dst, ids, ids, sums, 1, 4, 0, 1)
    with pytest.raises(RuntimeError, match="int64"):
        op(src, dst, ids.int(), ids, sums, 0, 3, 0, 1)
    with pytest.raises(RuntimeError, match="bytes"):
        op(src, torch.zeros(6, 128), ids, ids, sums, 0, 3, 0, 1)
    whole = torch.zeros(10, 256)
    with pytest.raises(RuntimeError, match="overlap"):
        op(whole[:6], whole[4:], ids, ids, sums, 0, 3, 0, 1)  # pools sharing pages 4 and 5
    with pytest.raises(ValueError, match="3 source pages but 2"):
        page_copy.copy_pages_with_checksums(src, dst, np.arange(3), np.arange(2))
    with pytest.raises(ValueError, match="uint64"):
        page_copy.copy_pages_with_checksums(src, dst, np.arange(3), np.arange(3), np.zeros(3, dtype=np.int64))
    op(src, dst, ids, ids, sums, 1, 3, 0, 2)  # a range copies only its own pairs
    assert not dst[0].any() and same_bytes(dst[1:3], src[1:3]) and sums[0] == 0


GEOMETRY = PoolGeometry(num_layers=2, kv_heads=2, head_dim=8, page_size=4, dtype=torch.float16)


@pytest.mark.parametrize(("mode", "copy_threads"), [("auto", 1), ("auto", 2), ("torch", 1)])
def test_transfer_engine_round_trip_is_identical_with_and_without_the_kernel(mode, copy_threads, monkeypatch):
    monkeypatch.setenv(page_copy.ENV_VAR, mode)
    hbm, dram = PagePool(12, GEOMETRY), make_dram_pool(12, GEOMETRY)
    for pool in (hbm, dram):
        while pool.allocate() is not None:
            pass
    hbm.tensor.copy_(random_pages(12, GEOMETRY.page_numel, torch.float16, seed=9).view(hbm.tensor.shape))
    original = hbm.tensor.clone()
    engine = TransferEngine(hbm, dram, chunk_bytes=3 * GEOMETRY.page_bytes, copy_threads=copy_threads)
    try:
        pairs = [(0, 5), (1, 6), (2, 7), (3, 8), (9, 0), (11, 2), (10, 1)]
        engine.submit(Tier.HBM, Tier.DRAM, pairs, TransferReason.EVICTION)
        assert engine.wait_idle(timeout_s=30)
        (down,) = engine.poll_completed()
        expected = page_checksums(original[[s for s, _ in pairs]]).numpy().view(np.uint64).tolist()
        assert down.is_ok and down.checksums == expected
        hbm.tensor.zero_()
        engine.submit(Tier.DRAM, Tier.HBM, [(d, s) for s, d in pairs], TransferReason.PROMOTION_ON_HIT)
        assert engine.wait_idle(timeout_s=30)
        (up,) = engine.poll_completed()
        assert up.is_ok and up.verified == [True] * len(pairs)
        for s, _ in pairs:
            assert same_bytes(hbm.tensor[s], original[s])
        engine.check_integrity()
    finally:
        engine.close()
    hbm.check_integrity()
    dram.check_integrity()


def test_a_lock_file_left_by_a_killed_builder_does_not_block_loading():
    """torch's build lock is a plain file: a builder killed mid-build leaves it, and torch
    would wait on it forever. The flock kvtier takes first proves it stale and removes it."""
    import threading

    from kvtier.tiers.native import NativeExtension, build_directory, cpu_tag

    ext = page_copy._EXTENSION
    directory = build_directory(f"{ext.name}_{cpu_tag()}")
    page_copy.load_kernel()  # built (or loaded) once, so the directory exists
    (directory / "lock").write_text("")  # what a killed builder leaves behind
    fresh = NativeExtension(ext.name, ext.source, what="page copy kernel (again)", fallback_hint="-",
                            extra_ldflags=())
    loader = threading.Thread(target=fresh.load, daemon=True)
    loader.start()
    loader.join(60)
    assert not loader.is_alive(), "loading waited on a stale lock file"
    assert fresh.is_loaded and not (directory / "lock").exists()
