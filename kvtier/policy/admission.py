"""Admission arithmetic: the HBM pages a request's admission takes, and its shortfall in a room.

One request of ``n`` prompt tokens, with ``hbm`` pages of its cached prefix in HBM from the
root and ``lower`` cached pages after them (below HBM, promoted on admission)::

    allocated = ceil(n / page_size) − hbm + cow      promoted, new and copy-on-write pages
    cow       = 1 when (hbm + lower) × page_size ≥ n  every prompt page hit: the last one is
                                                       copied privately to recompute its last token
    reserved  = ceil((n + out) / page_size) − ceil(n / page_size)
    out       = min(max(output tokens left, 1), reservation tokens)
    demand    = allocated + reserved
    shortfall = demand − room                          > 0: the request does not fit
                (a lone request, with no other sequence running or admitted ahead of it,
                counts ``allocated`` alone: nothing else can take its output's pages first,
                and it must be admitted whenever its prompt fits, or it would never be)

The callers differ only in the room they count: the engine's scheduler counts the pages it may
take at all (free, and idle pages it may evict or spill, less the reservations of running
sequences and the idle pages the request hits); the worker counts the pages free to take at no
copy (free, or idle with an intact copy below) less those promised to the requests queued in
the engine, and makes the rest in the background before the engine would spill for them.

Every function takes plain numbers and returns numbers: no clock, no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.domain.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class AdmissionPages:
    """The HBM pages one admission takes (module doc)."""

    num_allocated: int  # allocated on admission: promoted, new, the copy-on-write page
    num_reserved: int  # kept for the output, counted against the room (not allocated yet)

    @property
    def num_pages(self) -> int:
        return self.num_allocated + self.num_reserved


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


def reserved_pages(num_tokens: int, page_size: int, *, num_output_left: int, reservation_tokens: int) -> int:
    """Pages beyond ``num_tokens`` tokens' that the next output tokens need: at least one token,
    at most ``reservation_tokens``, never more than ``num_output_left``."""
    tokens = min(max(num_output_left, 1), reservation_tokens)
    return pages_for(num_tokens + tokens, page_size) - pages_for(num_tokens, page_size)


def admission_pages(
    *,
    num_tokens: int,
    page_size: int,
    num_hbm_hits: int,
    num_lower_hits: int,
    num_output_left: int,
    reservation_tokens: int,
) -> AdmissionPages:
    """The pages admitting a request takes (module doc). ``num_hbm_hits``: its cached prefix's
    pages in HBM from the root; ``num_lower_hits``: the cached pages after them (promoted)."""
    if page_size < 1:
        raise InvalidArgument(f"page_size must be at least 1, got {page_size}", field="page_size")
    if num_tokens < 1:
        raise InvalidArgument(f"num_tokens must be at least 1, got {num_tokens}", field="num_tokens")
    if num_hbm_hits < 0 or num_lower_hits < 0:
        raise InvalidArgument(
            f"hit counts must not be negative, got {num_hbm_hits} and {num_lower_hits}", field="num_hbm_hits"
        )
    is_full_hit = (num_hbm_hits + num_lower_hits) * page_size >= num_tokens
    allocated = pages_for(num_tokens, page_size) - num_hbm_hits + (1 if is_full_hit else 0)
    reserved = reserved_pages(num_tokens, page_size, num_output_left=num_output_left,
                              reservation_tokens=reservation_tokens)
    return AdmissionPages(max(allocated, 0), reserved)


def shortfall(pages: AdmissionPages, room: int, *, is_alone: bool = False) -> int:
    """Pages ``pages`` lacks in ``room``: positive when the admission does not fit. ``is_alone``:
    no other sequence runs or is admitted ahead, so the reservation is not counted (module doc)."""
    return (pages.num_allocated if is_alone else pages.num_pages) - room
