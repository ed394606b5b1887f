import pytest

from kvtier.domain.errors import IntegrityError
from kvtier.domain.tiers import Tier

from factories import keys_for, make_index


def cache_chain(index, tokens, page_size=4, tenant="t"):
    """Allocate, insert and release a chain of pages as a finished sequence would."""
    keys = keys_for(tokens, page_size, tenant)
    pages = []
    for i, key in enumerate(keys):
        page = index.pool.allocate()
        assert page is not None
        index.insert(key, keys[i - 1] if i else None, page, tokens[i * page_size : (i + 1) * page_size])
        pages.append(page)
    for page in pages:
        index.pool.release(page)
    return keys, pages


def test_longest_match_and_token_check():
    index = make_index()
    tokens = list(range(12))
    keys, pages = cache_chain(index, tokens)
    m = index.match(keys_for(list(range(8)) + [99, 99, 99, 99]), list(range(8)) + [99] * 4)
    assert m.pages == pages[:2]
    # Same keys but different tokens (a forged collision) stop the match.
    bad = list(tokens)
    bad[5] = 77
    assert index.match(keys, bad).num_pages == 1
    index.check_integrity()


def test_tenants_with_identical_tokens_do_not_match():
    index = make_index()
    cache_chain(index, list(range(8)), tenant="a")
    assert index.match(keys_for(list(range(8)), tenant="b"), list(range(8))).num_pages == 0


def test_insert_requires_parent_and_rejects_duplicates():
    index = make_index()
    keys = keys_for(list(range(8)))
    p = index.pool.allocate()
    assert index.insert(keys[1], keys[0], p, [4, 5, 6, 7]) is None  # parent missing
    q = index.pool.allocate()
    assert index.insert(keys[0], None, q, [0, 1, 2, 3]) is not None
    assert index.insert(keys[0], None, p, [0, 1, 2, 3]) is None  # duplicate key stays private
    assert not index.pool.is_cached(p)
    index.pool.release(p)
    index.pool.release(q)
    index.check_integrity()


def test_eviction_takes_leaves_before_parents_in_lru_order():
    index = make_index(num_pages=12)
    a_keys, a_pages = cache_chain(index, list(range(12)))  # chain a: 3 pages
    b_keys, b_pages = cache_chain(index, [50 + t for t in range(8)])  # chain b: 2 pages
    index.match(a_keys[:1], None)  # touch a's root: it is now the most recent
    order = []
    index.on_remove.append(lambda n: order.append(n.key))
    assert index.evict(5) == 5
    # a's leaves go first (oldest leaf), a's root can only go after its children,
    # b's chain goes leaf-first; every key is evicted after all its descendants.
    pos = {k: i for i, k in enumerate(order)}
    assert pos[a_keys[2]] < pos[a_keys[1]] < pos[a_keys[0]]
    assert pos[b_keys[1]] < pos[b_keys[0]]
    assert order[0] == a_keys[2]
    assert index.pool.num_free == 12
    index.check_integrity()


def test_expendable_pages_go_first_leaves_before_parents_until_a_hit():
    index = make_index(num_pages=12)
    old_keys, _ = cache_chain(index, [50 + t for t in range(8)])  # 2 pages, least recently used
    ended_keys, _ = cache_chain(index, list(range(12)))  # an ended session's 3 pages, newer
    index.mark_expendable([index.get(k) for k in ended_keys])
    order = []
    index.on_remove.append(lambda n: order.append(n.key))
    assert index.evict(3) == 3
    # Despite LRU, the ended chain goes first, leaf before parent; the older chain stays.
    assert order == [ended_keys[2], ended_keys[1], ended_keys[0]]
    assert all(index.get(k) is not None for k in old_keys)
    index.check_integrity()


def test_a_hit_makes_an_expendable_page_ordinary_again():
    index = make_index(num_pages=12)
    old_keys, _ = cache_chain(index, [50 + t for t in range(4)])  # 1 page, least recently used
    keys, _ = cache_chain(index, list(range(4)))
    index.mark_expendable([index.get(keys[0])])
    index.match(keys, list(range(4)))  # asked for again: ordinary, and now the most recent
    assert not index.get(keys[0]).is_expendable
    order = []
    index.on_remove.append(lambda n: order.append(n.key))
    assert index.evict(1) == 1 and order == [old_keys[0]]
    index.check_integrity()


def test_pages_in_use_and_pinned_are_never_evicted():
    index = make_index(num_pages=6)
    keys, pages = cache_chain(index, list(range(8)))
    index.pool.acquire(pages[1])  # a running sequence holds the leaf
    assert index.evict(10) == 0
    index.pool.release(pages[1])
    index.pin(keys[1])
    assert index.evict(10) == 0
    index.unpin(keys[1])
    assert index.evict(10) == 2
    index.check_integrity()


def test_remove_of_an_inner_node_is_refused():
    index = make_index()
    keys, _ = cache_chain(index, list(range(8)))
    with pytest.raises(IntegrityError):
        index.remove(keys[0])
    index.remove(keys[1])
    index.remove(keys[0])
    assert len(index) == 0
    index.check_integrity()


def test_candidate_heaps_stay_bounded_when_pages_are_hit_and_released_without_eviction():
    index = make_index(num_pages=8)
    tokens = list(range(12))
    keys, pages = cache_chain(index, tokens)
    for _ in range(2000):  # every release re-queues the leaf and stales its previous entry
        for page in pages:
            index.pool.acquire(page)
        for page in pages:
            index.pool.release(page)
    assert sum(len(heap) for heap in index._heaps.values()) <= 2 * len(pages) + 64 + 1
    assert index.evict(8) == len(pages)  # the live entries survived the compaction, in order
    index.check_integrity()


def test_drop_or_requeue_keeps_a_victim_with_a_pinned_page_below_it():
    index = make_index(num_pages=6)
    keys = keys_for(list(range(8)))
    page = index.pool.allocate()
    top = index.insert(keys[0], None, page, [0, 1, 2, 3])
    index.pool.release(page)
    below = index.insert(keys[1], keys[0], 0, [4, 5, 6, 7], tier=Tier.DRAM, checksum=1)
    assert top is not None and below is not None
    index.pin(keys[1])
    (victim,) = index.pop_victims(Tier.HBM, 1)  # an HBM leaf: its child sits in a slower tier
    assert victim is top and index.drop_or_requeue(victim) == 0
    assert index.get(keys[0]) is top and index.get(keys[1]) is below
    index.unpin(keys[1])
    (victim,) = index.pop_victims(Tier.HBM, 1)  # handed back to the candidates
    assert victim is top and index.drop_or_requeue(victim) == 2
    assert len(index) == 0 and index.pool.num_free == 6
    index.check_integrity()
