"""A page's format below HBM when it differs from HBM's: the contract the transfer engine uses.

With ``lower_tier_dtype = fp8`` HBM holds float pages and DRAM and NVMe hold FP8 pages
(``kvtier.domain.kv_dtype``: the namespace names both). Every copy that crosses the HBM
boundary converts, and only those: DRAM <-> NVMe moves the stored bytes as they are.

    HBM -> DRAM / NVMe   encode (requantize), then checksum the encoded bytes: the checksum
                         covers what is stored, as for any other page below HBM
    DRAM / NVMe -> HBM   verify the stored bytes against their checksum, then decode

A page changes value once, on its first way down; decoding and encoding again gives the
same codes (power-of-two scales), so a page that goes down and up repeatedly, or back onto
its shadow copy (decision 0012), keeps the values it had after the first trip.
The engine supplies the codec (``kvtier.engine.attention.fp8.Fp8PageCodec``); this layer
knows only its shape.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvtier.cache.page_pool import PoolGeometry


class PageCodec(Protocol):
    """Converts runs of whole pages between the HBM pool's format and the lower tiers'."""

    @property
    def lower_geometry(self) -> PoolGeometry:
        """The pool geometry of DRAM and NVMe (their pages' dtype and exact bytes)."""
        ...

    def encode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Write HBM pages ``src [k, ...]`` as lower-tier pages into ``dst [k, ...]`` (any device each)."""
        ...

    def decode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Write lower-tier pages ``src [k, ...]`` as HBM pages into ``dst [k, ...]``."""
        ...
