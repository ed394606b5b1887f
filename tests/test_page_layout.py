"""Byte layout of one page: exact sizes and scale offsets, computed by hand."""

from __future__ import annotations

import pytest

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.geometry import geometry_from_config
from kvtier.domain.page_layout import PageLayout


def layout(kv_dtype: str, **kw: int) -> PageLayout:
    fields = {"num_layers": 3, "num_planes": 2, "page_size": 5, "kv_heads": 2, "head_dim": 6} | kw
    return PageLayout(kv_dtype=kv_dtype, **fields)


def test_float_pages_are_elements_only() -> None:
    assert layout("bf16").page_bytes == 3 * 2 * 5 * 2 * 6 * 2 == 720
    assert layout("fp32").page_bytes == 1440
    assert layout("bf16").num_scales == 0


def test_fp8_page_is_one_byte_per_element_then_one_fp32_per_layer_plane_and_head() -> None:
    page = layout("fp8")
    assert page.codes_bytes == 360
    assert page.num_scales == 3 * 2 * 2 and page.scale_bytes == 48
    assert page.page_bytes == 408
    assert page.scale_offset(0, 0, 0) == 360
    assert page.scale_offset(0, 1, 0) == 360 + 4 * 2  # V of layer 0 follows K's two heads
    assert page.scale_offset(2, 1, 1) == 408 - 4  # the last scale ends the page


def test_fp8_codes_are_padded_so_scales_stay_aligned() -> None:
    page = layout("fp8", num_layers=1, page_size=1, kv_heads=1, head_dim=3)  # 6 code bytes
    assert (page.codes_bytes, page.page_bytes) == (8, 8 + 2 * 4)


def test_geometry_gives_the_planner_the_same_page_bytes() -> None:
    geometry = geometry_from_config(
        {
            "model_type": "llama",
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "vocab_size": 49152,
        }
    )  # SmolLM2-135M
    assert geometry.page_bytes("bf16", 16) == 30 * 2 * 16 * 3 * 64 * 2 == 368_640
    assert geometry.page_bytes("fp8", 16) == 184_320 + 30 * 2 * 3 * 4 == 185_040
    assert geometry.page_bytes("float8_e4m3fn", 16) == 185_040


@pytest.mark.parametrize("field", ["num_layers", "page_size", "kv_heads", "head_dim"])
def test_non_positive_fields_are_refused_by_name(field: str) -> None:
    with pytest.raises(InvalidArgument, match=field):
        layout("fp8", **{field: 0})


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="kv_dtype"):
        layout("int8")
