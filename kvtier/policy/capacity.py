"""Capacity planning: how many pages, tokens and sessions each tier holds (DESIGN §1).

    HBM   kv = (budget − weights) × (1 − headroom)     headroom: activations, CUDA graphs, allocator slack
    DRAM  kv = budget                                   the operator gives kvtier only what it may take
    NVMe  kv = budget
    pages = kv // bytes_per_page        tokens = pages × page_size
    bytes_per_page = ceil(bits/token × page_size / 8), plus fp8's per-(layer, plane, kv head) scales
    kv_dtype "bf16/fp8": HBM pages in bf16, DRAM and NVMe pages in fp8 (``lower_tier_dtype = fp8``)
    sessions(L) = pages // ceil(L / page_size)          a session owns whole pages; its tail page is private

The page-size study answers the other half of choosing ``page_size`` from a real length
distribution: internal fragmentation (unused slots in each request's last page) grows
with the page size, while page-table entries, and so per-page bookkeeping, shrink.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.geometry import ModelGeometry, parse_dtype

TIERS: tuple[str, ...] = ("hbm", "dram", "nvme")
MAX_PAGE_SIZE = 1024
DEFAULT_STUDY_PAGE_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128, 256)


def validate_page_size(page_size: int, *, name: str = "page_size") -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise InvalidArgument(f"{name} must be an integer, got {page_size!r}", field=name)
    if not (1 <= page_size <= MAX_PAGE_SIZE) or page_size & (page_size - 1):
        raise InvalidArgument(
            f"{name} must be a power of two in [1, {MAX_PAGE_SIZE}], got {page_size}", field=name
        )


def validate_headroom(headroom: float, *, name: str = "headroom") -> None:
    if not (0.0 <= headroom < 1.0):  # also rejects NaN
        raise InvalidArgument(f"{name} must be in [0, 1), got {headroom}", field=name)


def validate_budget(num_bytes: float, *, name: str, positive: bool = False) -> None:
    if not math.isfinite(num_bytes):
        raise InvalidArgument(f"{name} must be a finite number, got {num_bytes}", field=name)
    if positive and not num_bytes > 0:
        raise InvalidArgument(f"{name} must be > 0, got {num_bytes}", field=name)
    if not num_bytes >= 0:
        raise InvalidArgument(f"{name} must be >= 0, got {num_bytes}", field=name)


def parse_plan_dtype(text: str, *, field: str = "kv_dtype") -> tuple[str, str]:
    """``(hbm, lower)`` element types: one dtype for every tier, or ``HBM/lower`` such as ``bf16/fp8``."""
    hbm_text, sep, lower_text = str(text).partition("/")
    hbm = parse_dtype(hbm_text, field=field)[0]
    return hbm, parse_dtype(lower_text, field=field)[0] if sep else hbm


@dataclass(frozen=True, slots=True)
class TierPlan:
    tier: str
    budget_bytes: int
    reserved_bytes: int  # HBM: weights + headroom; 0 for DRAM and NVMe
    kv_bytes: int
    num_pages: int
    num_tokens: int
    sessions: Mapping[int, int]  # context length -> sessions of that length held at once


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    geometry: ModelGeometry
    kv_dtype: str
    page_size: int
    headroom: float
    bits_per_token: int
    bytes_per_page: int  # of an HBM page
    lower_bytes_per_page: int  # of a DRAM or NVMe page: bytes_per_page unless kv_dtype names a lower element
    context_lengths: tuple[int, ...]
    tiers: tuple[TierPlan, ...]
    latent_note: str | None  # set for a latent (MLA) cache, whose size is not 2 × K/V
    notes: tuple[str, ...]

    @property
    def bytes_per_token(self) -> Fraction:
        """Exact; a whole number except for fp4 with an odd element count."""
        return Fraction(self.bits_per_token, 8)

    @property
    def pages(self) -> dict[str, int]:
        return {t.tier: t.num_pages for t in self.tiers}

    def tier(self, name: str) -> TierPlan:
        for t in self.tiers:
            if t.tier == name:
                return t
        raise InvalidArgument(f"tier {name!r} is not one of {', '.join(TIERS)}", field="tier")


def plan(
    geometry: ModelGeometry,
    kv_dtype: str,
    page_size: int,
    hbm_bytes: int,
    dram_bytes: int = 0,
    nvme_bytes: int = 0,
    context_lengths: Iterable[int] = (),
    headroom: float = 0.15,
) -> CapacityPlan:
    """Pages, tokens and sessions per tier for one model on one GPU with the given budgets."""
    hbm_dtype, lower_dtype = parse_plan_dtype(kv_dtype)
    kv_dtype = hbm_dtype if lower_dtype == hbm_dtype else f"{hbm_dtype}/{lower_dtype}"
    validate_page_size(page_size)
    validate_headroom(headroom)
    validate_budget(hbm_bytes, name="hbm_bytes", positive=True)
    validate_budget(dram_bytes, name="dram_bytes")
    validate_budget(nvme_bytes, name="nvme_bytes")
    lengths = tuple(sorted(set(context_lengths)))
    for length in lengths:
        if length < 1:
            raise InvalidArgument(f"context lengths must be >= 1, got {length}", field="context_lengths")

    bits_per_token = geometry.kv_bits_per_token(hbm_dtype)
    bytes_per_page = geometry.page_bytes(hbm_dtype, page_size)  # whole bytes; fp8 includes its scales
    lower_bytes_per_page = geometry.page_bytes(lower_dtype, page_size)
    notes: list[str] = []

    hbm_free = hbm_bytes - geometry.weights_bytes
    # Fraction(str(...)) reads 0.2 as the decimal a person typed, not the binary float just above it.
    hbm_kv = max(0, math.floor(hbm_free * (1 - Fraction(str(headroom)))))
    if hbm_free <= 0:
        notes.append(
            f"weights ({geometry.weights_bytes / 2**30:,.2f} GiB) do not fit the HBM budget "
            f"({hbm_bytes / 2**30:,.2f} GiB), so HBM holds no KV: give more HBM, serve the weights "
            "in a smaller dtype, or shard the model across GPUs"
        )
    budgets = {"hbm": (hbm_bytes, hbm_kv), "dram": (dram_bytes, dram_bytes), "nvme": (nvme_bytes, nvme_bytes)}
    tiers = []
    for name in TIERS:
        budget, kv = budgets[name]
        num_pages = kv // (bytes_per_page if name == "hbm" else lower_bytes_per_page)
        tiers.append(
            TierPlan(
                tier=name,
                budget_bytes=budget,
                reserved_bytes=budget - kv,
                kv_bytes=kv,
                num_pages=num_pages,
                num_tokens=num_pages * page_size,
                sessions={n: num_pages // math.ceil(n / page_size) for n in lengths},
            )
        )

    latent_note = None
    if geometry.is_latent:
        latent_note = (
            f"latent cache (MLA): each layer stores one {geometry.latent_dim}-element vector per token "
            "(kv_lora_rank + qk_rope_head_dim) shared by K and V, not 2 × kv_heads × head_dim"
        )
        notes.append(latent_note)
    limit = geometry.max_position_embeddings
    too_long = [n for n in lengths if limit is not None and n > limit]
    if too_long:
        notes.append(f"context lengths {too_long} exceed the model's max_position_embeddings ({limit})")
    if "fp4" in (hbm_dtype, lower_dtype):
        notes.append("fp4 counts 4 bits per element; block scales (e.g. NVFP4's fp8 scale per 16) are extra")
    return CapacityPlan(
        geometry=geometry,
        kv_dtype=kv_dtype,
        page_size=page_size,
        headroom=headroom,
        bits_per_token=bits_per_token,
        bytes_per_page=bytes_per_page,
        lower_bytes_per_page=lower_bytes_per_page,
        context_lengths=lengths,
        tiers=tuple(tiers),
        latent_note=latent_note,
        notes=tuple(notes),
    )


@dataclass(frozen=True, slots=True)
class PageSizeRow:
    page_size: int
    num_slots: int  # token slots allocated: sum of ceil(L / page_size) × page_size
    num_unused_slots: int
    num_page_table_entries: int
    num_requests: int
    num_fit_budget: int | None  # requests whose allocation fits the budget; None without one

    @property
    def fragmentation_pct(self) -> float:
        return 100.0 * self.num_unused_slots / self.num_slots if self.num_slots else 0.0

    @property
    def mean_entries_per_request(self) -> float:
        return self.num_page_table_entries / self.num_requests

    @property
    def fit_budget_pct(self) -> float | None:
        return None if self.num_fit_budget is None else 100.0 * self.num_fit_budget / self.num_requests


@dataclass(frozen=True, slots=True)
class PageSizeStudy:
    num_requests: int
    num_tokens: int
    max_length: int
    budget_tokens: int | None
    rows: tuple[PageSizeRow, ...]


def page_size_study(
    lengths: Sequence[int],
    page_sizes: Iterable[int] = DEFAULT_STUDY_PAGE_SIZES,
    budget_tokens: int | None = None,
) -> PageSizeStudy:
    """Fragmentation and page-table size of a length distribution at each page size."""
    if not lengths:
        raise InvalidArgument("the page-size study needs at least one request length", field="lengths")
    if min(lengths) < 0:
        raise InvalidArgument(f"request lengths must be >= 0, got {min(lengths)}", field="lengths")
    if budget_tokens is not None and budget_tokens < 1:
        raise InvalidArgument(f"budget_tokens must be >= 1, got {budget_tokens}", field="budget_tokens")
    rows = []
    for page_size in page_sizes:
        if page_size < 1:
            raise InvalidArgument(f"page sizes must be >= 1, got {page_size}", field="page_sizes")
        pages_per_request = [-(-n // page_size) for n in lengths]
        num_entries = sum(pages_per_request)
        fit = None
        if budget_tokens is not None:
            fit = sum(1 for pages in pages_per_request if pages * page_size <= budget_tokens)
        rows.append(
            PageSizeRow(
                page_size=page_size,
                num_slots=num_entries * page_size,
                num_unused_slots=num_entries * page_size - sum(lengths),
                num_page_table_entries=num_entries,
                num_requests=len(lengths),
                num_fit_budget=fit,
            )
        )
    return PageSizeStudy(
        num_requests=len(lengths),
        num_tokens=sum(lengths),
        max_length=max(lengths),
        budget_tokens=budget_tokens,
        rows=tuple(rows),
    )


def read_lengths_csv(path: str | Path, column: str) -> list[int]:
    """Request lengths from one integer column of a CSV file with a header row."""
    path = Path(path).expanduser()
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            columns = reader.fieldnames or []
            if column not in columns:
                available = ", ".join(columns) if columns else "none (the file is empty)"
                raise InvalidArgument(
                    f"column {column!r} is not in {path}; available columns: {available}", field="column"
                )
            lengths = []
            for row in reader:
                raw = (row.get(column) or "").strip()
                try:
                    value = int(raw)
                except ValueError:
                    value = -1
                if value < 0:
                    raise InvalidArgument(
                        f"{path} line {reader.line_num}: column {column!r} must be an integer >= 0, got {raw!r}",
                        field="column",
                    )
                lengths.append(value)
    except OSError as exc:
        raise InvalidArgument(f"cannot read lengths CSV {path}: {exc.strerror}", field="lengths_csv") from exc
    except (UnicodeDecodeError, csv.Error) as exc:
        raise InvalidArgument(f"{path} is not a readable CSV file: {exc}", field="lengths_csv") from exc
    if not lengths:
        raise InvalidArgument(f"{path} has a header but no rows", field="lengths_csv")
    return lengths
