"""FP8 pages in torch: tensor views over the byte layout, and quantizing K/V into them.

The bytes follow ``kvtier.domain.page_layout`` (codes, then one fp32 scale per layer, plane
and kv head; diagram there). ``Fp8Pages`` owns one ``uint8 [num_pages, page_bytes]`` tensor
and exposes two strided views of it, so a page stays one contiguous block:

    codes   float8 [num_pages, layers, 2, page_size, kv_heads, head_dim]   same shape as a float pool
    scales  fp32   [num_pages, layers, 2, kv_heads]

``pages[:, layer]`` gives an ``Fp8KvLayer`` (the codes and scales of one layer), which every
attention backend accepts where it takes a float ``kv_layer``; ``shape`` and ``dim()`` answer
as the float pool would, so the model checks and indexes either kind of pool the same way.

Writing tokens (``write_kv_fp8``): positions fill a page in order from offset 0, so a write
that starts at offset 0 begins the page afresh, and one that starts at offset t > 0 keeps
rows 0..t-1. For each (page, plane, kv head) the scale is the smallest power of two with
``amax / scale <= fmt.max_value`` over the rows the page holds after the write. When a new
token raises a page's scale, its existing codes are re-encoded with the new scale: with
power-of-two scales that only shifts exponents, exact unless a value falls below the
format's normal range, where it rounds as it would have with that scale from the start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.cache.page_pool import FP8_TORCH_DTYPES, PagePool, PoolGeometry
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.page_layout import PageLayout


@dataclass(frozen=True, slots=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max_value: float  # largest finite value; larger inputs saturate to it


FORMATS: dict[str, Fp8Format] = {
    "e4m3": Fp8Format("e4m3", torch.float8_e4m3fn, 448.0),
    "e5m2": Fp8Format("e5m2", torch.float8_e5m2, 57344.0),
}
FP8_DTYPES = tuple(f.dtype for f in FORMATS.values())


def get_format(name: str) -> Fp8Format:
    fmt = FORMATS.get(name)
    if fmt is None:
        raise InvalidArgument(f"fp8 format {name!r} is not one of {', '.join(FORMATS)}", field="fp8_format")
    return fmt


def _format_of(dtype: torch.dtype) -> Fp8Format:
    for fmt in FORMATS.values():
        if fmt.dtype == dtype:
            return fmt
    raise InvalidArgument(f"{dtype} is not an fp8 dtype", field="dtype")


@dataclass(frozen=True, slots=True)
class Fp8KvLayer:
    """One layer of FP8 pages: views into the page bytes, valid while the pool lives.

    ``codes`` is ``[num_pages, 2, page_size, kv_heads, head_dim]`` (K = plane 0, V = 1) and
    ``scales`` is ``[num_pages, 2, kv_heads]``; value = ``codes.float() * scales`` per head.
    """

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype

    @property
    def format(self) -> Fp8Format:
        return _format_of(self.codes.dtype)

    def dequantize(self, pages: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values of ``pages`` (all pages when None) as ``[n, 2, page_size, kv_heads, head_dim]``."""
        codes = self.codes if pages is None else self.codes[pages]
        scales = self.scales if pages is None else self.scales[pages]
        return (codes.to(torch.float32) * scales[:, :, None, :, None]).to(dtype)


class Fp8Pages:
    """A pool of FP8 pages over one ``uint8 [num_pages, page_bytes]`` tensor (``raw``)."""

    def __init__(self, raw: torch.Tensor, layout: PageLayout, fmt: Fp8Format) -> None:
        if layout.kv_dtype != "fp8" or layout.num_planes != 2:
            raise InvalidArgument(
                f"Fp8Pages needs an fp8 K/V layout, got {layout.kv_dtype} with {layout.num_planes} planes",
                field="layout",
            )
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != layout.page_bytes:
            raise InvalidArgument(
                f"page bytes must be uint8 [num_pages, {layout.page_bytes}], got {raw.dtype} {tuple(raw.shape)}",
                field="raw",
            )
        self.raw = raw
        self.layout = layout
        self.format = fmt
        n, lay = raw.shape[0], layout
        element_bytes = lay.num_elements  # one byte each; the rest of codes_bytes is padding
        self.codes = (
            raw[:, :element_bytes]
            .view(fmt.dtype)
            .view(n, lay.num_layers, 2, lay.page_size, lay.kv_heads, lay.head_dim)
        )
        self.scales = raw[:, lay.codes_bytes :].view(torch.float32).view(n, lay.num_layers, 2, lay.kv_heads)

    @classmethod
    def allocate(
        cls,
        num_pages: int,
        *,
        num_layers: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        fmt: str | Fp8Format = "e4m3",
        device: torch.device | str = "cpu",
    ) -> Fp8Pages:
        """Zeroed pages (codes 0, scales 0: every page reads as zeros until written)."""
        fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        layout = PageLayout("fp8", num_layers, 2, page_size, kv_heads, head_dim)
        return cls(torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8, device=device), layout, fmt)

    @classmethod
    def over_pool(cls, pool: PagePool) -> Fp8Pages:
        """Codes and scales over the bytes of an FP8 ``PagePool`` (its tensor, no copy)."""
        g = pool.geometry
        if not g.is_fp8:
            raise InvalidArgument(f"pool of {g.dtype} pages is not an FP8 pool", field="pool")
        return cls(pool.tensor, g.layout, get_format(g.fp8_format))

    @property
    def num_pages(self) -> int:
        return self.raw.shape[0]

    @property
    def shape(self) -> torch.Size:
        """The shape of the equivalent float pool: ``[num_pages, layers, 2, page_size, kv_heads, head_dim]``."""
        return self.codes.shape

    def dim(self) -> int:
        return self.codes.dim()

    def __getitem__(self, index: tuple[slice, int]) -> Fp8KvLayer:
        """``pages[:, layer]``, the only indexing a pool gets from the model."""
        whole, layer = index if isinstance(index, tuple) and len(index) == 2 else (None, None)
        if whole != slice(None) or not isinstance(layer, int):
            raise InvalidArgument(f"Fp8Pages supports pages[:, layer] only, got {index!r}", field="index")
        return Fp8KvLayer(self.codes[:, layer], self.scales[:, layer])

    def layer(self, layer: int) -> Fp8KvLayer:
        return self[:, layer]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every page as a float pool tensor (tests and oracles; attention never does this)."""
        return (self.codes.to(torch.float32) * self.scales[:, :, :, None, :, None]).to(dtype)


def pow2_scales(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Smallest power of two ``s`` with ``amax / s <= fmt.max_value``; 1 where ``amax`` is 0."""
    amax = amax.to(torch.float32)
    exponent = torch.ceil(torch.log2(amax / fmt.max_value))
    scale = torch.exp2(exponent)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def encode(values: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """``values / scales`` as fp8 codes, saturating at the format's largest finite value."""
    return (values.to(torch.float32) / scales).clamp(-fmt.max_value, fmt.max_value).to(fmt.dtype)


def write_kv_fp8(layer: Fp8KvLayer, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize the new rows ``k``/``v`` ``[T, kv_heads, head_dim]`` into their slots.

    A page that keeps rows (its first written offset is past 0) and whose scales already
    cover the new rows gets only the new rows' codes, under its scales: the common decode
    step. Every other touched page is decoded into a small fp32 staging block with its kept
    rows, the new rows are placed, and the whole block is re-encoded under the scale its
    rows now need. Both give the codes and scales a one-shot quantization of the page's rows
    gives (module doc).
    """
    if k.numel() == 0:
        return
    fmt = layer.format
    page_size = layer.codes.shape[2]
    pages = slot_mapping // page_size
    offsets = slot_mapping % page_size
    touched, which = torch.unique(pages, return_inverse=True)
    first = torch.full((touched.numel(),), page_size, dtype=offsets.dtype, device=offsets.device)
    first.scatter_reduce_(0, which, offsets, reduce="amin")
    rows = torch.stack([k, v], dim=1).to(torch.float32)  # [T, 2, kv_heads, head_dim]
    row_amax = rows.abs().amax(dim=3)
    amax = torch.zeros((touched.numel(), *row_amax.shape[1:]), dtype=torch.float32, device=rows.device)
    # A materialised index: scatter_reduce_ with an expanded (stride 0) one is ~10^4 times slower on the CPU.
    amax.scatter_reduce_(0, which[:, None, None].expand_as(row_amax).contiguous(), row_amax, reduce="amax")
    needed, held = pow2_scales(amax, fmt), layer.scales[touched]
    # A held scale of 1 may be the mark of rows that are all zero (pow2_scales), which any
    # smaller scale would replace: such pages take the full path.
    fits = (needed <= held) & ((held != 1) | (needed == 1))
    in_place = (first > 0) & fits.all(dim=2).all(dim=1)
    fast = in_place[which]
    if bool(fast.any()):
        scale = held[which[fast]][:, :, :, None]  # [t, 2, kv_heads, 1]
        codes = encode(rows[fast], scale, fmt)
        layer.codes[pages[fast], 0, offsets[fast]] = codes[:, 0]
        layer.codes[pages[fast], 1, offsets[fast]] = codes[:, 1]
    if bool(fast.all()):
        return
    slow = ~fast
    _rewrite_pages(layer, rows[slow], pages[slow], offsets[slow], fmt)


def _rewrite_pages(
    layer: Fp8KvLayer, rows: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, fmt: Fp8Format
) -> None:
    """Re-encode each page of ``pages`` from its kept rows and its new ``rows`` [T, 2, H, D]."""
    page_size = layer.codes.shape[2]
    touched, which = torch.unique(pages, return_inverse=True)
    first = torch.full((touched.numel(),), page_size, dtype=offsets.dtype, device=offsets.device)
    first.scatter_reduce_(0, which, offsets, reduce="amin")
    # Rows before the first written offset are kept; the rest are stale (or about to be written).
    row_ids = torch.arange(page_size, device=offsets.device)
    keep = (row_ids[None, :] < first[:, None])[:, None, :, None, None]
    staged = torch.where(keep, layer.dequantize(touched), 0.0)
    staged[which, 0, offsets] = rows[:, 0]
    staged[which, 1, offsets] = rows[:, 1]
    amax = staged.abs().amax(dim=(2, 4))  # [pages, 2, kv_heads]
    scales = pow2_scales(amax, fmt)
    layer.codes[touched] = encode(staged, scales[:, :, None, :, None], fmt)
    layer.scales[touched] = scales


def quantize_pages(values: torch.Tensor, fmt: str | Fp8Format = "e4m3") -> Fp8Pages:
    """Whole float pages ``[num_pages, layers, 2, page_size, kv_heads, head_dim]`` as FP8 pages."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    num_pages, num_layers, planes, page_size, kv_heads, head_dim = values.shape
    if planes != 2:
        raise InvalidArgument(f"values must have 2 planes (K, V), got {planes}", field="values")
    pages = Fp8Pages.allocate(
        num_pages, num_layers=num_layers, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim,
        fmt=fmt, device=values.device,
    )  # fmt: skip
    scales = pow2_scales(values.abs().amax(dim=(3, 5)), fmt)
    pages.codes.copy_(encode(values, scales[:, :, :, None, :, None], fmt))
    pages.scales.copy_(scales)
    return pages


class Fp8PageCodec:
    """Float HBM pages to FP8 pages below HBM and back (``kvtier.tiers.page_codec.PageCodec``).

    Encoding quantizes each whole page at once, as ``quantize_pages`` does; decoding gives
    the values attention would read from those FP8 pages, in the HBM pool's dtype.
    """

    def __init__(self, hbm: PoolGeometry, fmt: str | Fp8Format = "e4m3") -> None:
        if hbm.is_fp8:
            raise InvalidArgument("an FP8 HBM pool demotes its pages as they are, without a codec", field="geometry")
        self.format = get_format(fmt) if isinstance(fmt, str) else fmt
        self.hbm = hbm
        dtype = next(d for d, name in FP8_TORCH_DTYPES.items() if name == self.format.name)
        self._lower = PoolGeometry(hbm.num_layers, hbm.kv_heads, hbm.head_dim, hbm.page_size, dtype)

    @property
    def lower_geometry(self) -> PoolGeometry:
        return self._lower

    def encode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        pages = quantize_pages(src.to(torch.float32), self.format)
        dst.copy_(pages.raw)

    def decode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        pages = Fp8Pages(src.contiguous(), self._lower.layout, self.format)
        dst.copy_(pages.dequantize(dst.dtype))
