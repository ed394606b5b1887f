"""The KV cache's storage format as a namespace names it: element type, FP8 scheme, lower tiers.

A namespace's ``kv_dtype`` is part of its digest (``kvtier.domain.hashing``), so it must name
everything that changes the bytes a page holds or the values attention reads back. Plain
float caches are one word; an FP8 cache also names its format and its scale granularity, and
a cache whose lower tiers hold another format than HBM names both::

    kv_dtype  :=  element [ "/" element ]          HBM element, then the lower tiers' (DRAM, NVMe)
    element   :=  "fp32" | "fp16" | "bf16" | "fp4" | "fp8"
               |  "fp8_" format "@" granularity      format: e4m3 | e5m2;  granularity: page-head

    fp8_e4m3@page-head          FP8 e4m3 pages in every tier, one scale per (page, layer, plane, kv head)
    bf16/fp8_e4m3@page-head     bf16 in HBM; pages demoted below HBM are requantized to that FP8
                                scheme, and come back dequantized (their values changed once)

``resolve`` turns what an operator types (``fp8``, ``fp8_e5m2``, vLLM's spellings) into the
canonical name a worker registers; pages of two namespaces whose canonical names differ are
never shared. The bare ``fp8`` and ``fp4`` stay valid element names for the capacity planner
(bytes only) but no worker registers them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.domain.errors import InvalidArgument

KV_ELEMENT_TYPES = ("fp32", "fp16", "bf16", "fp8", "fp4")
FP8_FORMATS = ("e4m3", "e5m2")
# Scale granularities of FP8 pages (``kvtier.domain.page_layout``'s diagram).
FP8_GRANULARITIES = ("page-head",)
DEFAULT_FP8_FORMAT = "e4m3"
DEFAULT_FP8_GRANULARITY = "page-head"
FLOAT_ELEMENTS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True, slots=True)
class KvElement:
    """One tier's element type; ``fp8_format`` and ``granularity`` are set for resolved FP8 only."""

    base: str  # one of KV_ELEMENT_TYPES
    fp8_format: str = ""
    granularity: str = ""

    @property
    def name(self) -> str:
        if self.fp8_format:
            return f"fp8_{self.fp8_format}@{self.granularity}"
        return self.base

    @property
    def is_fp8(self) -> bool:
        return self.base == "fp8"

    @property
    def is_float(self) -> bool:
        return self.base in FLOAT_ELEMENTS


@dataclass(frozen=True, slots=True)
class KvCacheDtype:
    """The HBM element and the lower tiers' element (the same one unless the name says otherwise)."""

    hbm: KvElement
    lower: KvElement

    @property
    def name(self) -> str:
        return self.hbm.name if self.lower == self.hbm else f"{self.hbm.name}/{self.lower.name}"

    @property
    def requantizes_below(self) -> bool:
        """Pages change format when they leave HBM (and change values once, on the way down)."""
        return self.lower != self.hbm


def _element(text: str, field: str, *, resolve: bool) -> KvElement:
    word = text.strip().lower()
    if word in ("fp8", "fp8_e4m3", "fp8_e5m2", "float8_e4m3fn", "float8_e5m2") and resolve:
        fmt = "e5m2" if "e5m2" in word else DEFAULT_FP8_FORMAT
        return KvElement("fp8", fmt, DEFAULT_FP8_GRANULARITY)
    if word in KV_ELEMENT_TYPES:
        return KvElement(word)
    if word.startswith("fp8_") and "@" in word:
        fmt, _, granularity = word[4:].partition("@")
        if fmt not in FP8_FORMATS:
            raise InvalidArgument(
                f"{field} {text!r}: FP8 format {fmt!r} is not one of {', '.join(FP8_FORMATS)}", field=field
            )
        if granularity not in FP8_GRANULARITIES:
            raise InvalidArgument(
                f"{field} {text!r}: FP8 scale granularity {granularity!r} is not one of "
                f"{', '.join(FP8_GRANULARITIES)}",
                field=field,
            )
        return KvElement("fp8", fmt, granularity)
    raise InvalidArgument(
        f"{field} {text!r} is not one of {', '.join(KV_ELEMENT_TYPES)}, fp8_e4m3 or fp8_e5m2 "
        f"(canonical FP8 names carry their scales: fp8_e4m3@{DEFAULT_FP8_GRANULARITY})",
        field=field,
    )


def parse_kv_dtype(text: str, *, field: str = "kv_dtype", resolve: bool = False) -> KvCacheDtype:
    """Parse a ``kv_dtype`` (grammar in the module doc). ``resolve`` also accepts the short FP8
    spellings (``fp8``, ``fp8_e5m2``) and fills in the defaults; without it a name must be canonical."""
    if not isinstance(text, str) or not text:
        raise InvalidArgument(f"{field} must be a non-empty string, got {text!r}", field=field)
    hbm_text, sep, lower_text = text.partition("/")
    hbm = _element(hbm_text, field, resolve=resolve)
    lower = _element(lower_text, field, resolve=resolve) if sep else hbm
    if sep:
        if not (hbm.is_float and lower.is_fp8 and lower.fp8_format):
            raise InvalidArgument(
                f"{field} {text!r}: a separate lower-tier element must be a resolved FP8 scheme under "
                f"a float HBM element (e.g. bf16/fp8_e4m3@{DEFAULT_FP8_GRANULARITY})",
                field=field,
            )
    if not resolve and text.strip().lower() != text:
        raise InvalidArgument(f"{field} {text!r} must be lower case without spaces", field=field)
    return KvCacheDtype(hbm, lower)


def resolve(kv_dtype: str, *, lower_tier_dtype: str = "", field: str = "kv_cache_dtype") -> KvCacheDtype:
    """The canonical cache format for an operator's ``kv_cache_dtype`` and ``lower_tier_dtype``
    (empty: lower tiers hold what HBM holds)."""
    spec = parse_kv_dtype(kv_dtype, field=field, resolve=True)
    if spec.hbm.base in ("fp4",) or (spec.hbm.is_fp8 and not spec.hbm.fp8_format):
        raise InvalidArgument(f"{field} {kv_dtype!r} is not served by the engine", field=field)
    if lower_tier_dtype and lower_tier_dtype != "same":
        lower = _element(lower_tier_dtype, "lower_tier_dtype", resolve=True)
        if lower != spec.hbm:
            if not (spec.hbm.is_float and lower.is_fp8):
                raise InvalidArgument(
                    f"lower_tier_dtype {lower_tier_dtype!r} needs a float kv_cache_dtype (fp32, fp16 or bf16) "
                    f"and an FP8 lower element; kv_cache_dtype is {kv_dtype!r}",
                    field="lower_tier_dtype",
                )
            spec = KvCacheDtype(spec.hbm, lower)
    return spec


def is_valid_namespace_kv_dtype(text: str) -> bool:
    try:
        parse_kv_dtype(text)
    except InvalidArgument:
        return False
    return True
