import pytest
import torch

from kvtier.domain.errors import IntegrityError

from factories import make_index, make_pool


def test_allocate_until_empty_then_none():
    pool = make_pool(num_pages=3)
    pages = [pool.allocate() for _ in range(3)]
    assert sorted(pages) == [0, 1, 2]
    assert pool.allocate() is None
    assert pool.counts().in_use == 3 and pool.num_free == 0
    pool.check_integrity()
    for p in pages:
        pool.release(p)
    assert pool.num_free == 3
    pool.check_integrity()


def test_double_release_raises_and_does_not_corrupt():
    pool = make_pool(num_pages=2)
    p = pool.allocate()
    pool.release(p)
    with pytest.raises(IntegrityError):
        pool.release(p)
    pool.check_integrity()
    assert pool.num_free == 2


def test_cached_page_survives_release_until_unmarked():
    pool = make_pool(num_pages=2)
    p = pool.allocate()
    pool.mark_cached(p)
    pool.release(p)
    c = pool.counts()
    assert (c.free, c.cached, c.in_use) == (1, 1, 0)
    pool.acquire(p)  # a prefix hit revives it
    assert pool.counts().in_use == 1
    pool.release(p)
    pool.unmark_cached(p)
    assert pool.num_free == 2
    pool.check_integrity()


def test_acquire_of_free_page_is_a_broken_contract():
    pool = make_pool(num_pages=2)
    with pytest.raises(IntegrityError):
        pool.acquire(0)


def test_copy_on_write_copies_shared_pages_only():
    pool = make_pool(num_pages=4)
    p = pool.allocate()
    pool.tensor[p].fill_(3.0)
    assert pool.copy_on_write(p) == p  # private: no copy
    pool.acquire(p)  # now two holders
    q = pool.copy_on_write(p)
    assert q != p
    assert torch.equal(pool.tensor[q], pool.tensor[p])
    assert pool.ref_count(p) == 1 and pool.ref_count(q) == 1
    pool.tensor[q].fill_(5.0)
    assert float(pool.tensor[p].max()) == 3.0
    pool.release(p)
    pool.release(q)
    pool.check_integrity()


def test_copy_on_write_reports_pressure_as_none():
    pool = make_pool(num_pages=1)
    p = pool.allocate()
    pool.acquire(p)
    assert pool.copy_on_write(p) is None
    assert pool.ref_count(p) == 2


def test_pins_block_uncaching():
    index = make_index(num_pages=4)
    pool = index.pool
    p = pool.allocate()
    pool.mark_cached(p)
    pool.pin(p)
    with pytest.raises(IntegrityError):
        pool.unmark_cached(p)
    pool.unpin(p)
    pool.unmark_cached(p)
    pool.release(p)
    pool.check_integrity()


def test_integrity_reports_the_numbers():
    pool = make_pool(num_pages=3)
    pool.allocate()
    pool._num_in_use = 2  # simulate drift
    with pytest.raises(IntegrityError, match="in_use 2"):
        pool.check_integrity()
