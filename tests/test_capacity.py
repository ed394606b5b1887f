"""Capacity plans and the page-size study, checked against hand-computed and brute-force numbers."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.geometry import ModelGeometry, geometry_from_config, load_geometry
from kvtier.policy.capacity import page_size_study, plan, read_lengths_csv

REPO = Path(__file__).parents[1]
EXAMPLE = REPO / "kvtier" / "examples" / "llama-3.1-8b.json"
AZURE_TRACE = REPO.parent / "shared" / "traces" / "azure_llm_inference_2023_code.csv"
GIB = 1 << 30


def make_geometry(**changes: object) -> ModelGeometry:
    """A tiny Llama: 2 layers, 2 query heads, 1 KV head of 4 dims -> 16 KV elements per token.

    Params: embed + lm_head 2*16*8 = 256, final norm 8, per layer attention 8*4*(2*2 + 2*1) = 192,
    MLP 3*8*16 = 384, norms 16 -> 2*592 + 264 = 1448 parameters, 2896 bytes in bf16.
    """
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size": 8,
        "intermediate_size": 16,
        "vocab_size": 16,
        "max_position_embeddings": 64,
    }
    config.update(changes)
    return geometry_from_config(config)


def test_tiny_plan_matches_hand_computation() -> None:
    geometry = make_geometry()
    assert geometry.param_count == 1448 and geometry.weights_bytes == 2896
    result = plan(
        geometry, "bf16", 4, hbm_bytes=2896 + 1000, dram_bytes=1000, context_lengths=[4, 5], headroom=0.2
    )
    assert result.bytes_per_token == 32  # 16 elements x 2 bytes
    assert result.bytes_per_page == 128
    hbm = result.tier("hbm")
    assert hbm.kv_bytes == 800  # (3896 - 2896) x 0.8
    assert hbm.reserved_bytes == 3096  # weights + headroom
    assert (hbm.num_pages, hbm.num_tokens) == (6, 24)
    assert dict(hbm.sessions) == {4: 6, 5: 3}  # 5 tokens need 2 pages: the tail page is private
    dram = result.tier("dram")
    assert (dram.kv_bytes, dram.num_pages, dict(dram.sessions)) == (1000, 7, {4: 7, 5: 3})
    assert result.tier("nvme").num_pages == 0
    assert result.pages == {"hbm": 6, "dram": 7, "nvme": 0}


def test_llama_31_8b_on_an_80_gib_gpu() -> None:
    geometry = load_geometry(EXAMPLE)
    result = plan(geometry, "bf16", 16, 80 * GIB, 256 * GIB, 2000 * GIB, [8192, 32768])
    assert result.bytes_per_token == 131_072 and result.bytes_per_page == 2 * 1024 * 1024
    hbm_kv = math.floor((80 * GIB - geometry.param_count * 2) * Fraction(85, 100))
    assert result.tier("hbm").kv_bytes == hbm_kv
    assert result.tier("hbm").num_pages == hbm_kv // (2 * 1024 * 1024)
    assert dict(result.tier("dram").sessions) == {8192: 256, 32768: 64}  # a 32k context is 4 GiB
    assert result.tier("nvme").num_pages == 2000 * GIB // (2 * 1024 * 1024)
    assert result.latent_note is None and result.notes == ()


def test_fp8_halves_element_bytes_and_adds_its_scales_to_each_page() -> None:
    geometry = load_geometry(EXAMPLE)  # Llama-3.1-8B: 32 layers, 8 kv heads x 128
    bf16 = plan(geometry, "bf16", 16, 80 * GIB, 64 * GIB)
    fp8 = plan(geometry, "fp8", 16, 80 * GIB, 64 * GIB)
    assert fp8.bytes_per_token * 2 == bf16.bytes_per_token
    scales = 32 * 2 * 8 * 4  # one fp32 per (layer, plane, kv head)
    assert fp8.bytes_per_page == bf16.bytes_per_page // 2 + scales == 1024 * 1024 + 2048
    assert fp8.tier("dram").num_pages == 64 * GIB // (1024 * 1024 + 2048)
    assert 1.99 < fp8.tier("dram").num_pages / bf16.tier("dram").num_pages < 2
    # The namespace's full scheme names are counted as the element type they store.
    assert plan(geometry, "fp8_e5m2@page-head", 16, 80 * GIB).bytes_per_page == fp8.bytes_per_page


def test_a_float_cache_that_demotes_as_fp8_counts_fp8_pages_below_hbm() -> None:
    geometry = load_geometry(EXAMPLE)
    bf16 = plan(geometry, "bf16", 16, 80 * GIB, 64 * GIB, 100 * GIB)
    mixed = plan(geometry, "bf16/fp8", 16, 80 * GIB, 64 * GIB, 100 * GIB)
    fp8_page = 1024 * 1024 + 32 * 2 * 8 * 4
    assert mixed.kv_dtype == "bf16/fp8" and mixed.bytes_per_token == bf16.bytes_per_token
    assert mixed.bytes_per_page == bf16.bytes_per_page == 2 * 1024 * 1024
    assert mixed.lower_bytes_per_page == fp8_page and bf16.lower_bytes_per_page == bf16.bytes_per_page
    assert mixed.tier("hbm").num_pages == bf16.tier("hbm").num_pages
    assert mixed.tier("dram").num_pages == 64 * GIB // fp8_page
    assert mixed.tier("nvme").num_pages == 100 * GIB // fp8_page
    with pytest.raises(InvalidArgument) as caught:
        plan(geometry, "bf16/int3", 16, 80 * GIB)
    assert caught.value.field == "kv_dtype"


def test_fp4_fractional_bytes_stay_exact() -> None:
    # 1 layer, latent of 1 + 2 elements -> 3 elements x 4 bits = 1.5 bytes per token.
    geometry = geometry_from_config(
        {
            "model_type": "deepseek_v2",
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "hidden_size": 8,
            "vocab_size": 16,
            "kv_lora_rank": 1,
            "qk_rope_head_dim": 2,
            "qk_nope_head_dim": 2,
            "v_head_dim": 2,
            "intermediate_size": 8,
        }
    )
    result = plan(geometry, "fp4", 16, hbm_bytes=geometry.weights_bytes + 240, headroom=0.0)
    assert result.bytes_per_token == Fraction(3, 2)
    assert result.bytes_per_page == 24
    assert result.tier("hbm").num_pages == 10
    assert plan(geometry, "fp4", 1, hbm_bytes=10**6).bytes_per_page == 2  # a page rounds up to whole bytes
    assert any("block scales" in note for note in result.notes)


def test_weights_larger_than_hbm_clamp_to_zero_with_a_note() -> None:
    geometry = load_geometry(EXAMPLE)
    result = plan(geometry, "bf16", 16, hbm_bytes=8 * GIB, dram_bytes=GIB, context_lengths=[4096])
    hbm = result.tier("hbm")
    assert (hbm.kv_bytes, hbm.num_pages, dict(hbm.sessions)) == (0, 0, {4096: 0})
    assert hbm.reserved_bytes == 8 * GIB
    assert any("do not fit the HBM budget" in note for note in result.notes)
    assert result.tier("dram").num_pages == 512


def test_latent_and_context_notes() -> None:
    deepseek = geometry_from_config(
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "hidden_size": 7168,
            "vocab_size": 129280,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "intermediate_size": 18432,
            "max_position_embeddings": 163840,
        }
    )
    result = plan(deepseek, "bf16", 64, hbm_bytes=10**15, context_lengths=[4096, 200_000])
    assert result.bytes_per_token == 70_272
    assert result.latent_note is not None and "576" in result.latent_note
    assert any("exceed the model's max_position_embeddings (163840)" in note for note in result.notes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"page_size": 12}, "page_size must be a power of two in [1, 1024], got 12"),
        ({"page_size": 2048}, "page_size must be a power of two in [1, 1024], got 2048"),
        ({"page_size": 0}, "page_size must be a power of two"),
        ({"headroom": 1.0}, "headroom must be in [0, 1), got 1.0"),
        ({"headroom": -0.1}, "headroom must be in [0, 1)"),
        ({"hbm_bytes": 0}, "hbm_bytes must be > 0, got 0"),
        ({"dram_bytes": -1}, "dram_bytes must be >= 0, got -1"),
        ({"nvme_bytes": -5}, "nvme_bytes must be >= 0"),
        ({"context_lengths": [0]}, "context lengths must be >= 1"),
        ({"kv_dtype": "int8"}, "kv_dtype 'int8' is not one of"),
    ],
)
def test_plan_validation_names_the_argument(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"kv_dtype": "bf16", "page_size": 16, "hbm_bytes": 80 * GIB}
    args.update(kwargs)
    with pytest.raises(InvalidArgument) as info:
        plan(make_geometry(), **args)  # type: ignore[arg-type]
    assert message in str(info.value)


def brute_force_slots(lengths: list[int], page_size: int) -> tuple[int, int]:
    """Allocate token by token, opening a page when the current one is full: (pages, slots)."""
    num_pages = 0
    for length in lengths:
        free_in_page = 0
        for _ in range(length):
            if free_in_page == 0:
                num_pages += 1
                free_in_page = page_size
            free_in_page -= 1
    return num_pages, num_pages * page_size


def test_study_on_a_hand_made_distribution() -> None:
    lengths = [1, 15, 16, 17, 100]  # 149 tokens
    study = page_size_study(lengths, page_sizes=(8, 16, 32), budget_tokens=20)
    by_size = {row.page_size: row for row in study.rows}
    # page 8:  1+2+2+3+13 = 21 pages, 168 slots, 19 unused
    # page 16: 1+1+1+2+7  = 12 pages, 192 slots, 43 unused
    # page 32: 1+1+1+1+4  =  8 pages, 256 slots, 107 unused
    assert [by_size[p].num_page_table_entries for p in (8, 16, 32)] == [21, 12, 8]
    assert by_size[8].fragmentation_pct == pytest.approx(100 * 19 / 168)
    assert by_size[16].fragmentation_pct == pytest.approx(100 * 43 / 192)
    assert by_size[32].fragmentation_pct == pytest.approx(100 * 107 / 256)
    assert by_size[16].mean_entries_per_request == pytest.approx(12 / 5)
    # budget 20 tokens: allocations 8,16,16,24,104 | 16,16,16,32,112 | 32,32,32,32,128
    assert [by_size[p].fit_budget_pct for p in (8, 16, 32)] == [60.0, 60.0, 0.0]
    assert (study.num_requests, study.num_tokens, study.max_length) == (5, 149, 100)
    for row in study.rows:
        pages, slots = brute_force_slots(lengths, row.page_size)
        assert (row.num_page_table_entries, row.num_slots) == (pages, slots)
        assert row.num_unused_slots == slots - sum(lengths)


def test_study_without_budget_and_with_empty_requests() -> None:
    study = page_size_study([0, 0, 16], page_sizes=(16,))
    (row,) = study.rows
    assert row.fit_budget_pct is None
    assert (row.num_page_table_entries, row.fragmentation_pct) == (1, 0.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([],), "at least one request length"),
        (([5, -1],), "request lengths must be >= 0"),
        (([5], (0,)), "page sizes must be >= 1"),
        (([5], (16,), 0), "budget_tokens must be >= 1"),
    ],
)
def test_study_rejects_bad_input(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        page_size_study(*args)  # type: ignore[arg-type]


@pytest.mark.skipif(
    not AZURE_TRACE.is_file(), reason="shared/traces/azure_llm_inference_2023_code.csv is absent"
)
def test_study_on_the_azure_code_trace_is_monotonic() -> None:
    lengths = read_lengths_csv(AZURE_TRACE, "ContextTokens")
    assert len(lengths) == 8819
    study = page_size_study(lengths, budget_tokens=4000)
    rows = study.rows
    assert [r.page_size for r in rows] == [8, 16, 32, 64, 128, 256]
    for smaller, larger in zip(rows, rows[1:], strict=False):
        assert larger.fragmentation_pct > smaller.fragmentation_pct
        assert larger.num_page_table_entries < smaller.num_page_table_entries
        assert larger.mean_entries_per_request < smaller.mean_entries_per_request
        # Each page size divides the next, so allocations only grow and fewer requests fit.
        assert larger.fit_budget_pct <= smaller.fit_budget_pct  # type: ignore[operator]
    assert rows[0].fragmentation_pct < 1.0 < rows[-1].fragmentation_pct


def test_read_lengths_csv(tmp_path: Path) -> None:
    path = tmp_path / "lengths.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nt0,10,3\nt1, 20 ,4\n")
    assert read_lengths_csv(path, "ContextTokens") == [10, 20]
    with pytest.raises(InvalidArgument) as info:
        read_lengths_csv(path, "InputTokens")
    assert "column 'InputTokens'" in str(info.value)
    assert "available columns: TIMESTAMP, ContextTokens, GeneratedTokens" in str(info.value)
    assert info.value.field == "column"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("n\n5\nx\n", "line 3: column 'n' must be an integer >= 0, got 'x'"),
        ("n\n-2\n", "must be an integer >= 0, got '-2'"),
        ("n\n", "has a header but no rows"),
        ("", "available columns: none"),
    ],
)
def test_read_lengths_csv_bad_content(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(InvalidArgument, match=message):
        read_lengths_csv(path, "n")


def test_read_lengths_csv_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read lengths CSV"):
        read_lengths_csv(tmp_path / "absent.csv", "n")
