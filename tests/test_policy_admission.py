"""Admission arithmetic (``kvtier.policy.admission``) on plain page and token counts."""

from __future__ import annotations

import pytest

from kvtier.domain.errors import InvalidArgument
from kvtier.policy.admission import AdmissionPages, admission_pages, pages_for, reserved_pages, shortfall


def demand(tokens: int, hbm: int = 0, lower: int = 0, out: int = 16, reservation: int = 8,
           page_size: int = 4) -> AdmissionPages:
    return admission_pages(num_tokens=tokens, page_size=page_size, num_hbm_hits=hbm, num_lower_hits=lower,
                           num_output_left=out, reservation_tokens=reservation)


@pytest.mark.parametrize(("tokens", "hbm", "lower", "allocated"), [
    (10, 0, 0, 3),  # nothing cached: every page is new
    (10, 2, 0, 1),  # two full pages hit in HBM: the partial tail is new
    (10, 1, 1, 2),  # one in HBM, one below: the one below is promoted, counted
    (10, 0, 2, 3),  # both below HBM
    (8, 2, 0, 1),  # a full hit: the last page is copied privately (copy-on-write)
    (8, 1, 1, 2),  # a full hit across tiers: one promoted, one copy-on-write
    (8, 0, 2, 3),  # a full hit wholly below HBM
    (1, 0, 0, 1),
])
def test_allocated_pages(tokens: int, hbm: int, lower: int, allocated: int) -> None:
    pages = demand(tokens, hbm, lower, out=1)
    assert pages.num_allocated == allocated
    assert pages.num_pages == allocated + pages.num_reserved


@pytest.mark.parametrize(("tokens", "out", "reservation", "reserved"), [
    (10, 16, 8, 2),  # 10 + 8 tokens: 5 pages, 3 of them the prompt's
    (10, 1, 8, 0),  # the one token left fits in the prompt's tail page
    (12, 1, 8, 1),  # the prompt fills its pages: the next token needs a new one
    (12, 0, 8, 1),  # nothing left still counts one token
    (10, 16, 64, 4),  # at most the tokens left: 10 + 16 tokens, 7 pages
    (1, 100, 8, 2),  # 1 + 8 tokens: 3 pages
])
def test_reserved_pages(tokens: int, out: int, reservation: int, reserved: int) -> None:
    assert reserved_pages(tokens, 4, num_output_left=out, reservation_tokens=reservation) == reserved
    pages = demand(tokens, out=out, reservation=reservation)
    assert pages.num_reserved == reserved
    assert pages.num_pages == pages.num_allocated + reserved


def test_full_hit_with_reservation() -> None:
    # 8 tokens, both pages hit: the copy-on-write page, then 8 output tokens' two pages.
    assert demand(8, hbm=2) == AdmissionPages(1, 2)


def test_lower_hits_with_reservation() -> None:
    # 10 tokens, one page in HBM, one below: one promoted, one new, 8 output tokens' two pages.
    assert demand(10, hbm=1, lower=1) == AdmissionPages(2, 2)


@pytest.mark.parametrize(("room", "short", "short_alone"), [(0, 4, 2), (2, 2, 0), (4, 0, -2), (9, -5, -7)])
def test_shortfall(room: int, short: int, short_alone: int) -> None:
    """The reservation counts while another sequence runs (or is admitted ahead); a lone
    request counts only the pages its admission allocates."""
    pages = demand(10, hbm=1, lower=1)
    assert shortfall(pages, room) == short
    assert shortfall(pages, room, is_alone=True) == short_alone


def test_pages_for() -> None:
    assert [pages_for(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


@pytest.mark.parametrize(("field", "kwargs"), [
    ("page_size", {"page_size": 0}),
    ("num_tokens", {"tokens": 0}),
    ("num_hbm_hits", {"hbm": -1}),
])
def test_bad_counts_name_the_field(field: str, kwargs: dict[str, int]) -> None:
    args: dict[str, int] = {"tokens": 10, **kwargs}
    with pytest.raises(InvalidArgument) as info:
        demand(**args)  # type: ignore[arg-type]
    assert info.value.field == field
