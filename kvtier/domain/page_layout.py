"""Byte layout of one KV page, and its exact size, for every KV dtype (DESIGN §5.1, §5.14).

A page holds ``page_size`` tokens' K and V for all layers and is one contiguous block in
every tier. Float pages (fp32/fp16/bf16) are the tensor ``[layers, 2, page_size, kv_heads,
head_dim]``. An FP8 page stores one byte per element followed by the scales that turn the
bytes back into values, so a tier move or a checksum still covers one block:

    FP8 page, L layers, H kv heads, P tokens, D head_dim, planes K=0 V=1
    byte 0                                                      codes_bytes            page_bytes
    ├─ codes: L × 2 × P × H × D, one byte each ─────────────────┤─ scales: L × 2 × H fp32 ─┤
    │ l0 K [P][H][D] │ l0 V [P][H][D] │ l1 K … │ … │ lL-1 V     │ l0 K [H] │ l0 V [H] │ …  │

    code of (l, c, t, h, d)   at  (((l·2 + c)·P + t)·H + h)·D + d
    scale of (l, c, h)        at  codes_bytes + 4·((l·2 + c)·H + h)       little-endian fp32
    value = decode(code) × scale                 one scale per (page, layer, plane, kv head)

The codes region is padded to a multiple of 4 bytes so the scales are fp32-aligned (a
no-op whenever ``head_dim`` is even). Scales are powers of two (see decision 0015): a page
whose scale grows as tokens arrive is re-encoded exactly, and dequantizing is exact in fp32.
This module is pure arithmetic; ``kvtier.engine.attention.fp8`` lays tensors over it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.domain.errors import InvalidArgument

SCALE_BYTES = 4  # one fp32 per (layer, plane, kv head)
_SCALE_ALIGN = 4
# Bits per element of the page's values; fp8 pages also carry scales (``scale_bytes``).
ELEMENT_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "fp4": 4}


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Where every byte of one page sits, for one model geometry and KV dtype."""

    kv_dtype: str  # canonical name, one of ELEMENT_BITS
    num_layers: int
    num_planes: int  # 2 (K and V); 1 for a latent (MLA) cache
    page_size: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.kv_dtype not in ELEMENT_BITS:
            raise InvalidArgument(
                f"kv_dtype {self.kv_dtype!r} is not one of {', '.join(ELEMENT_BITS)}", field="kv_dtype"
            )
        for name in ("num_layers", "num_planes", "page_size", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be a positive integer, got {value!r}", field=name)

    @property
    def num_elements(self) -> int:
        return self.num_layers * self.num_planes * self.page_size * self.kv_heads * self.head_dim

    @property
    def has_scales(self) -> bool:
        return self.kv_dtype == "fp8"

    @property
    def codes_bytes(self) -> int:
        """Bytes of the element region (padded so the scales that follow are aligned)."""
        raw = -(-self.num_elements * ELEMENT_BITS[self.kv_dtype] // 8)
        return -(-raw // _SCALE_ALIGN) * _SCALE_ALIGN if self.has_scales else raw

    @property
    def num_scales(self) -> int:
        return self.num_layers * self.num_planes * self.kv_heads if self.has_scales else 0

    @property
    def scale_bytes(self) -> int:
        return self.num_scales * SCALE_BYTES

    @property
    def page_bytes(self) -> int:
        """Exact size of one page in every tier, scales included."""
        return self.codes_bytes + self.scale_bytes

    def scale_offset(self, layer: int, plane: int, head: int) -> int:
        """Byte offset of the scale of (layer, plane, kv head) inside the page."""
        if not self.has_scales:
            raise InvalidArgument(f"{self.kv_dtype} pages carry no scales", field="kv_dtype")
        return self.codes_bytes + SCALE_BYTES * ((layer * self.num_planes + plane) * self.kv_heads + head)
