"""The FP8 KV cache in the engine and its tiers (decision 0015): pages stored as FP8 codes and
scales in HBM, moved and kept as those bytes in DRAM and on NVMe, checksummed as stored; a float
cache that demotes as FP8 (``lower_tier_dtype``); namespaces that keep the formats apart."""

from __future__ import annotations

import pytest
import torch

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, page_keys
from kvtier.domain.kv_dtype import parse_kv_dtype, resolve
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.attention.base import ReferenceBackend
from kvtier.engine.attention.fp8 import Fp8Pages, quantize_pages
from kvtier.tiers.manager import TierConfig

from hf_checkpoints import build_checkpoint

PS = 4
E4M3_MAX = 448.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("fp8-ckpt") / "llama", "llama", seed=7)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(ckpt, tmp_path=None, *, kv="fp8", dram=64, nvme=64, **kwargs) -> Engine:
    tiers = None
    if tmp_path is not None:
        tiers = TierConfig(dram_pages=dram, nvme_slots=nvme, nvme_dir=tmp_path / "nvme" if nvme else None)
    return Engine.from_pretrained(
        ckpt, page_size=PS, num_pages=64, kv_cache_dtype=kv, tier_config=tiers, **kwargs
    )


def page_bytes_of(e: Engine, tokens: list[int]) -> dict[bytes, torch.Tensor]:
    """The stored bytes of every full page of ``tokens``, by key (pages in HBM)."""
    out = {}
    for key in page_keys(e.digest_for(None), tokens, PS):
        node = e.index.get(key)
        assert node is not None and node.tier is Tier.HBM
        out[key] = e.pool.tensor[node.page].clone()
    return out


class FakeQuantBackend(ReferenceBackend):
    """The oracle: a float pool whose pages are replaced, after each write, by the values of
    their rows quantized to e4m3 with one power-of-two scale per (page, plane, kv head), the
    rows past the last one written zeroed. No FP8 bytes, views or kernels involved."""

    def write_kv(self, kv_layer, k, v, md) -> None:
        page_size = kv_layer.shape[2]
        pages = md.slot_mapping // page_size
        offsets = md.slot_mapping % page_size
        for page in pages.unique().tolist():
            rows = (pages == page).nonzero()[:, 0]
            first, last = int(offsets[rows].min()), int(offsets[rows].max())
            block = kv_layer[page].float()
            block[:, first:] = 0
            block[0, offsets[rows]] = k[rows].float()
            block[1, offsets[rows]] = v[rows].float()
            assert last == page_size - 1 or not block[:, last + 1 :].any()
            amax = block.abs().amax(dim=(1, 3))  # [2, kv_heads]
            scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX))), torch.ones_like(amax))
            scale = scale[:, None, :, None]
            codes = (block / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            kv_layer[page] = (codes.float() * scale).to(kv_layer.dtype)


def fake_quant_engine(ckpt, **kwargs) -> Engine:
    e = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64, **kwargs)
    e.backend = e.runner.backend = FakeQuantBackend()
    return e


# ---- names --------------------------------------------------------------------------------------
def test_the_flag_resolves_to_a_name_that_carries_format_and_granularity() -> None:
    assert resolve("fp8").name == "fp8_e4m3@page-head"
    assert resolve("fp8_e5m2").name == "fp8_e5m2@page-head"
    assert resolve("bf16", lower_tier_dtype="fp8").name == "bf16/fp8_e4m3@page-head"
    assert resolve("bf16", lower_tier_dtype="same").name == "bf16"
    assert parse_kv_dtype("bf16/fp8_e4m3@page-head").requantizes_below
    for bad, field in [
        ("fp8_e4m3", "namespace.kv_dtype"),  # a namespace names the scheme in full
        ("fp8_e4m3@token", "namespace.kv_dtype"),
        ("fp8_e6m1@page-head", "namespace.kv_dtype"),
        ("fp8_e4m3@page-head/bf16", "namespace.kv_dtype"),
    ]:
        with pytest.raises(InvalidArgument) as caught:
            NamespaceIdentity(model_id="m", kv_dtype=bad).validate()
        assert caught.value.field == field
    with pytest.raises(InvalidArgument, match="not served"):
        resolve("fp4")
    with pytest.raises(InvalidArgument) as caught:
        resolve("fp8", lower_tier_dtype="fp8_e5m2")
    assert caught.value.field == "lower_tier_dtype"


def test_fp8_and_float_namespaces_never_share_a_page_key() -> None:
    tokens = prompt(64, seed=3)
    names = ["bf16", "fp32", "fp8_e4m3@page-head", "fp8_e5m2@page-head", "bf16/fp8_e4m3@page-head", "fp8"]
    keys = [set(page_keys(namespace_digest(NamespaceIdentity("m", kv_dtype=n)), tokens, PS)) for n in names]
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            assert not keys[i] & keys[j], (names[i], names[j])


def test_an_fp8_engine_finds_no_cached_page_for_a_float_namespace(ckpt) -> None:
    e = engine(ckpt)
    tokens = prompt(13, seed=4)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    e.generate([tokens], params)
    assert e.generate([tokens], params)[0].num_cached_tokens == 12
    float_ns = NamespaceIdentity("m", kv_dtype="fp32", page_size=PS)
    assert e.generate([tokens], params, namespace=float_ns)[0].num_cached_tokens == 0
    with pytest.raises(InvalidArgument) as caught:
        Engine.from_pretrained(ckpt, page_size=PS, num_pages=8, kv_cache_dtype="fp8", namespace=float_ns)
    assert caught.value.field == "namespace.kv_dtype"


# ---- HBM ----------------------------------------------------------------------------------------
def test_the_hbm_pool_holds_fp8_codes_and_scales_of_the_planned_size(ckpt) -> None:
    e = engine(ckpt)
    layout = e.geometry.layout
    assert e.pool.tensor.dtype == torch.uint8 and e.pool.tensor.shape == (64, layout.page_bytes)
    assert layout.page_bytes == layout.num_elements + 4 * layout.num_layers * 2 * layout.kv_heads
    float_page = Engine.from_pretrained(ckpt, page_size=PS, num_pages=1, dtype=torch.bfloat16).geometry.page_bytes
    assert layout.page_bytes < float_page // 2 + 8 * layout.num_layers * layout.kv_heads + 4


def test_fp8_engine_output_equals_the_fake_quantized_float_oracle(ckpt) -> None:
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [prompt(13, seed=5), prompt(6, seed=6)]
    got = engine(ckpt, record_logits=True).generate(prompts, params)
    want = fake_quant_engine(ckpt, record_logits=True).generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logits, w.logits, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_full_pages_hold_a_one_shot_quantization_of_their_rows(ckpt) -> None:
    e = engine(ckpt)
    oracle = fake_quant_engine(ckpt)
    tokens = prompt(17, seed=8)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    e.generate([tokens], params)
    oracle.generate([tokens], params)
    oracle_keys = page_keys(oracle.digest_for(None), tokens, PS)
    for key, oracle_key in zip(page_keys(e.digest_for(None), tokens, PS), oracle_keys, strict=True):
        page = e.index.get(key).page
        values = Fp8Pages.over_pool(e.pool).dequantize()[page]
        want = oracle.pool.tensor[oracle.index.get(oracle_key).page]
        torch.testing.assert_close(values, want, atol=0, rtol=0)
        # Quantizing those values again changes none of them (power-of-two scales).
        assert torch.equal(quantize_pages(want[None]).dequantize()[0], want)


# ---- tiers --------------------------------------------------------------------------------------
def test_fp8_pages_round_trip_hbm_dram_nvme_hbm_bit_exactly(ckpt, tmp_path) -> None:
    e = engine(ckpt, tmp_path, record_logits=True)
    tokens = prompt(14, seed=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    e.generate([tokens], params)
    before = page_bytes_of(e, tokens)
    assert e.tiers.demote_all(Tier.DRAM) >= 3
    assert e.index.count_by_tier()[Tier.DRAM] >= 3
    assert e.tiers.demote_all(Tier.NVME) >= 3
    assert e.index.count_by_tier()[Tier.HBM] == e.index.count_by_tier()[Tier.DRAM] == 0
    follow = tokens[:12] + [5, 6, 7]
    r = e.generate([follow], params)[0]
    assert r.num_promoted_tokens == 12 and e.tiers.counters.checksum_failures == 0
    after = page_bytes_of(e, tokens)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The stored bytes moved, scales included: an FP8 page each way.
    page_bytes = e.geometry.page_bytes
    moved = e.tiers.transfers.stats().bytes_moved
    assert moved[(Tier.NVME, Tier.HBM)] == 3 * page_bytes
    assert moved[(Tier.HBM, Tier.DRAM)] % page_bytes == 0 and moved[(Tier.DRAM, Tier.NVME)] % page_bytes == 0
    # Pages that came back bit-exactly give what an engine that never moved them gives.
    unmoved = engine(ckpt, record_logits=True).generate([follow], params)[0]
    assert r.token_ids == unmoved.token_ids
    for a, b in zip(r.logits, unmoved.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    e.check_integrity()
    e.close()


def test_a_flipped_byte_of_an_fp8_page_on_nvme_is_caught_and_recomputed(ckpt, tmp_path) -> None:
    e = engine(ckpt, tmp_path, dram=0)
    tokens = prompt(14, seed=2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    follow = tokens[:12] + [9]
    reference = engine(ckpt).generate([follow], params)[0]
    e.generate([tokens], params)
    e.tiers.demote_all(Tier.NVME)
    second = e.index.get(page_keys(e.digest_for(None), tokens, PS)[1])
    assert second is not None and second.tier is Tier.NVME
    where = e.tiers.nvme.locate(second.page)
    # A byte among the scales: a wrong scale would scale a whole head of the page.
    offset = where.payload_offset + e.geometry.layout.scale_offset(1, 0, 1) + 2
    with open(where.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    r = e.generate([follow], params)[0]
    assert e.tiers.counters.checksum_failures == 1
    assert r.num_promoted_tokens == PS and r.num_cached_tokens == PS
    assert r.token_ids == reference.token_ids
    e.check_integrity()
    e.close()


def test_a_float_cache_demotes_as_fp8_and_comes_back_with_the_values_of_those_pages(ckpt, tmp_path) -> None:
    e = engine(ckpt, tmp_path, kv="fp32/fp8_e4m3@page-head")
    assert e.namespace.kv_dtype == "fp32/fp8_e4m3@page-head"
    assert e.pool.tensor.dtype == torch.float32
    assert e.tiers.dram.tensor.dtype == torch.uint8
    tokens = prompt(14, seed=9)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    e.generate([tokens], params)
    before = page_bytes_of(e, tokens)
    e.tiers.demote_all(Tier.DRAM)
    # DRAM holds the FP8 encoding of each page, checksummed as stored.
    fp8_page_bytes = e.tiers.dram.geometry.page_bytes
    assert e.tiers.page_bytes == fp8_page_bytes < e.geometry.page_bytes // 3
    e.tiers.demote_all(Tier.NVME)
    r = e.generate([tokens[:12] + [1, 2]], params)[0]
    assert r.num_promoted_tokens == 12 and e.tiers.counters.checksum_failures == 0
    after = page_bytes_of(e, tokens)
    for key, page in before.items():
        assert torch.equal(after[key], quantize_pages(page[None]).dequantize()[0])
    moved = e.tiers.transfers.stats().bytes_moved
    assert moved[(Tier.NVME, Tier.HBM)] == 3 * fp8_page_bytes
    # A second trip leaves the values as the first one made them (power-of-two scales).
    e.tiers.demote_all(Tier.DRAM)
    e.generate([tokens[:12] + [1, 2]], params)
    again = page_bytes_of(e, tokens)
    assert all(torch.equal(again[k], after[k]) for k in after)
    e.check_integrity()
    e.close()


def test_a_flipped_byte_of_a_requantized_page_in_dram_is_caught(ckpt, tmp_path) -> None:
    e = engine(ckpt, tmp_path, kv="fp32/fp8_e4m3@page-head", nvme=0)
    tokens = prompt(14, seed=10)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    e.generate([tokens], params)
    e.tiers.demote_all(Tier.DRAM)
    first = e.index.get(page_keys(e.digest_for(None), tokens, PS)[0])
    e.tiers.dram.tensor[first.page, 7] ^= 0x01
    r = e.generate([tokens[:12] + [3]], params)[0]
    assert e.tiers.counters.checksum_failures == 1 and r.num_promoted_tokens == 0
    e.check_integrity()
    e.close()
