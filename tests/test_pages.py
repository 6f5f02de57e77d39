"""PageManager: allocation, refcounts, prefix-cache hits and eviction, page 0 never handed out."""

from __future__ import annotations

import pytest

from minivllm_jax.engine.kv.pages import PageManager
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.sampling_params import SamplingParams


def seq(tokens) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(max_tokens=4))


def test_allocate_and_free_returns_every_page():
    bm = PageManager(num_pages=10, page_size=4)
    a, b = seq(range(10)), seq(range(100, 105))
    bm.allocate_slots(a)
    bm.allocate_slots(b)
    assert len(a.pages) == 3 and len(b.pages) == 2
    assert 0 not in a.pages + b.pages  # the scratch page is never handed out
    assert len(set(a.pages + b.pages)) == 5
    assert bm.num_free_pages == 9 - 5
    bm.free_pages(a)
    bm.free_pages(b)
    assert bm.num_free_pages == bm.num_usable_pages == 9
    assert a.pages == [] and a.num_computed_tokens == 0


def test_allocate_slots_respects_free_pages_and_reserve():
    bm = PageManager(num_pages=4, page_size=4)
    big = seq(range(12))  # 3 pages: all usable ones
    assert bm.allocate_slots(big, reserve=1) is None and big.pages == []
    assert bm.allocate_slots(big).new_pages == tuple(big.pages) and len(big.pages) == 3
    assert bm.allocate_slots(seq([1])) is None
    big.output_token_ids.append(5)  # 13 tokens need a 4th page
    assert bm.allocate_slots(big) is None and len(big.pages) == 3
    bm.free_pages(big)
    small = seq(range(4))
    bm.allocate_slots(small)
    small.output_token_ids.append(9)
    assert len(bm.allocate_slots(small).new_pages) == 1 and len(small.pages) == 2
    assert bm.allocate_slots(small).new_pages == ()  # it has its pages: nothing new
    assert len(bm.allocate_slots(small, lookahead=4).new_pages) == 1  # a multi-step run's
    assert len(small.pages) == 3


def test_failed_allocate_slots_changes_nothing():
    """All or nothing: an admission that does not fit leaves the free list (in its order), the
    refcounts, the prefix cache and the sequence as they were, even when its prefix hits cached
    pages that sit in the free list; the scheduler then preempts or stops admitting."""
    bm = PageManager(num_pages=6, page_size=4)  # 5 usable pages
    a = seq(range(10))  # 2 full pages + 2 tokens
    bm.allocate_slots(a)
    a.num_computed_tokens = 10
    bm.commit(a)
    bm.free_pages(a)  # its 2 full pages stay cached, in the free list
    hog = seq(range(100, 108))
    bm.allocate_slots(hog)  # 3 free pages left, 2 of them cached
    state = (list(bm.free), list(bm.refcount), dict(bm.digest_to_page), dict(bm.cached))
    for b, reserve in ((seq([*range(10), *range(50, 58)]), 0), (seq([*range(10), 50]), 1)):
        assert bm.allocate_slots(b, reserve=reserve) is None  # 3 new pages / 1 + reserve 1
        assert (list(bm.free), list(bm.refcount), dict(bm.digest_to_page), dict(bm.cached)) == state
        assert b.pages == [] and b.num_computed_tokens == b.num_cached_tokens == 0
        assert bm.num_memory_hit_tokens == 0
    fits = seq([*range(10), 50])
    assert len(bm.allocate_slots(fits).new_pages) == 1 and fits.num_cached_tokens == 8
    bm.check([hog, fits])


def test_admission_hashes_the_prompt_once(monkeypatch):
    """`allocate_slots` walks the prompt's cached prefix once: each full page is hashed once per
    admission (a check followed by an allocate hashed it twice)."""
    import minivllm_jax.engine.kv.pages as pages

    bm = PageManager(num_pages=16, page_size=4)
    warm = seq(range(17))  # 4 full pages + 1 token
    bm.allocate_slots(warm)
    warm.num_computed_tokens = 17
    bm.commit(warm)
    real, hashed = pages.page_digest, []
    monkeypatch.setattr(
        pages, "page_digest", lambda parent, tokens: hashed.append(tokens) or real(parent, tokens)
    )
    b = seq([*range(16), 99, 98])  # hits the 4 full pages; its last page is not full
    assert bm.allocate_slots(b, reserve=2) is not None
    assert b.num_cached_tokens == 16 and b.pages[:4] == warm.pages[:4]
    assert hashed == [tuple(range(i, i + 4)) for i in range(0, 16, 4)]


def test_prefix_cache_shares_full_computed_pages():
    bm = PageManager(num_pages=16, page_size=4)
    prompt = list(range(1, 11))  # 2 full pages + 2 tokens
    a = seq(prompt)
    bm.allocate_slots(a)
    assert a.num_cached_tokens == 0
    a.num_computed_tokens = len(prompt)
    bm.commit(a)
    b = seq(prompt + [99])
    bm.allocate_slots(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]
    assert bm.refcount[a.pages[0]] == 2
    bm.free_pages(a)
    bm.free_pages(b)
    assert bm.num_free_pages == 15


def test_prefix_cache_leaves_one_token_to_compute():
    bm = PageManager(num_pages=16, page_size=4)
    a = seq(range(8))
    bm.allocate_slots(a)
    a.num_computed_tokens = 8
    bm.commit(a)
    b = seq(range(8))  # identical prompt: the last page is recomputed for its logits
    bm.allocate_slots(b)
    assert b.num_cached_tokens == 4


def test_freed_pages_stay_cached_until_reused_then_miss():
    bm = PageManager(num_pages=4, page_size=4)
    a = seq(range(9))
    bm.allocate_slots(a)
    a.num_computed_tokens = 9
    bm.commit(a)
    bm.free_pages(a)
    b = seq(range(9))
    bm.allocate_slots(b)  # hits both full pages although `a` is gone
    assert b.num_cached_tokens == 8
    bm.free_pages(b)
    c = seq(range(50, 62))  # takes all 3 pages, evicting the cached prefix
    bm.allocate_slots(c)
    c.num_computed_tokens = 12
    bm.commit(c)
    bm.free_pages(c)
    d = seq(range(9))
    bm.allocate_slots(d)
    assert d.num_cached_tokens == 0


def test_prefix_caching_disabled_never_hits():
    bm = PageManager(num_pages=16, page_size=4, enable_prefix_caching=False)
    a = seq(range(9))
    bm.allocate_slots(a)
    a.num_computed_tokens = 9
    bm.commit(a)
    b = seq(range(9))
    bm.allocate_slots(b)
    assert b.num_cached_tokens == 0 and not set(a.pages) & set(b.pages)


def test_double_free_is_caught():
    bm = PageManager(num_pages=4, page_size=4)
    a = seq(range(3))
    bm.allocate_slots(a)
    pages = list(a.pages)
    bm.free_pages(a)
    a.pages = pages
    with pytest.raises(AssertionError):
        bm.free_pages(a)


def test_digest_collision_cannot_serve_another_chains_page(monkeypatch):
    """A crafted prompt whose page key collides with another request's must not read its KV:
    a hit checks the stored parent digest and tokens, not only the key."""
    import minivllm_jax.engine.kv.pages as bm_module

    monkeypatch.setattr(
        bm_module, "page_digest", lambda parent, tokens: b"collide"
    )  # every key equal
    bm = PageManager(num_pages=16, page_size=4)
    victim = seq([5, 6, 7, 8, 9, 10, 11, 12, 13])
    bm.allocate_slots(victim)
    victim.num_computed_tokens = len(victim)
    bm.commit(victim)
    attacker = seq([1, 2, 3, 4, 9, 10, 11, 12, 13])  # different first page, same (colliding) key
    bm.allocate_slots(attacker)
    assert attacker.num_cached_tokens == 0 and not set(attacker.pages) & set(victim.pages)
    # A second page whose own tokens match but whose parent chain differs is refused too.
    same_tail = seq([5, 6, 7, 99, 9, 10, 11, 12, 13])
    bm.allocate_slots(same_tail)
    assert same_tail.num_cached_tokens == 0


def test_page_digest_is_sha256_chained_over_parent():
    from minivllm_jax.engine.kv.pages import ROOT_DIGEST, page_digest

    first = page_digest(ROOT_DIGEST, (1, 2, 3, 4))
    assert len(first) == 32 and first != page_digest(ROOT_DIGEST, (1, 2, 3, 5))
    assert page_digest(first, (9,)) != page_digest(page_digest(ROOT_DIGEST, (1, 2, 3, 5)), (9,))
    assert page_digest(ROOT_DIGEST, (1, 2)) != page_digest(
        ROOT_DIGEST, (1 + (2 << 32),)
    )  # fixed-width encoding


def test_fork_shares_full_prompt_pages_by_refcount():
    bm = PageManager(num_pages=16, page_size=4)
    parent = seq(range(10))  # 2 full pages + 2 tokens
    bm.allocate_slots(parent)
    parent.num_computed_tokens = 10
    bm.commit(parent)
    child = seq(range(10))
    bm.fork(parent, child, 9)
    assert child.pages == parent.pages[:2] and child.num_computed_tokens == 8
    assert [bm.refcount[p] for p in parent.pages] == [2, 2, 1]
    assert len(bm.allocate_slots(child).new_pages) == 1  # only the partial last page is new
    assert child.pages[:2] == parent.pages[:2] and child.pages[2] not in parent.pages
    bm.free_pages(parent)
    bm.free_pages(child)
    assert bm.num_free_pages == bm.num_usable_pages
