"""DRAM tier pool: free-page bookkeeping shared with PagePool, and checksums that never outlive a page."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.cache.page_pool import PoolGeometry
from kvtier.domain.errors import IntegrityError
from kvtier.tiers.dram import make_dram_pool

GEOMETRY = PoolGeometry(num_layers=2, kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)


def test_free_mask_follows_the_free_list():
    pool = make_dram_pool(5, GEOMETRY)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.mark_cached(b)
    pool.release(b)  # cached: not free
    pool.release(c)  # back to the free list
    assert (a, b, c) == (0, 1, 2)
    assert pool.free_mask(np.arange(5)).tolist() == [False, False, True, True, True]
    pool.unmark_cached(b)
    assert pool.free_mask(np.array([1, 0])).tolist() == [True, False]
    assert pool.allocate() == 3  # the free list is FIFO; the mask follows it
    assert pool.free_mask(np.arange(5)).tolist() == [False, True, True, False, True]
    pool.check_integrity()


def test_integrity_catches_a_free_flag_that_drifted_from_the_free_list():
    pool = make_dram_pool(3, GEOMETRY)
    page = pool.allocate()
    pool._is_free[page] = 1  # simulate drift
    with pytest.raises(IntegrityError, match="3 pages flagged free, 2 in the free list"):
        pool.check_integrity()


def test_a_page_forgets_its_checksum_when_it_becomes_free():
    pool = make_dram_pool(4, GEOMETRY)
    pages = [pool.allocate() for _ in range(3)]
    pool.set_checksums(pages, np.array([7, 8, 2**64 - 1], dtype=np.uint64))
    pool.mark_cached(pages[1])
    for p in pages:
        pool.release(p)
    assert pool.checksums_of(pages) == [None, 8, None]  # the cached page keeps its checksum
    pool.check_integrity()
    pool.unmark_cached(pages[1])
    assert pool.checksum(pages[1]) is None
    pool.check_integrity()
