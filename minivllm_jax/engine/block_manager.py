"""`BlockManager`: KV pages, refcounts and the hash-chained prefix cache (host bookkeeping only).

Page 0 is the scratch page and never handed out. A full page is identified by a hash chained
over its parent's hash and its tokens, so equal prefixes map to equal pages. Freed pages keep
their hash until reused (least recently freed first), so a finished or preempted request's
prefix can still be hit later.
"""

from __future__ import annotations

from collections import OrderedDict

from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.kv_cache import SCRATCH_PAGE


def _page_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = [0] * num_pages
        # Free pages in reuse order; an OrderedDict so a prefix hit can pull one out in O(1).
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages) if p != SCRATCH_PAGE)
        self.hash_to_page: dict[int, int] = {}
        self.page_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # page -> (hash, tokens) when cached

    @property
    def num_free_pages(self) -> int:
        return len(self.free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---------------------------------------------------------------- prefix cache lookups

    def _cached_prefix(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Pages (and their hashes) holding the longest cached prefix, leaving a token to compute."""
        pages: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return pages, hashes
        parent = None
        for i in range((len(token_ids) - 1) // self.page_size):
            tokens = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            h = _page_hash(parent, tokens)
            page = self.hash_to_page.get(h)
            if page is None or self.page_key[page][1] != tokens:
                break
            pages.append(page)
            hashes.append(h)
            parent = h
        return pages, hashes

    def _take_fresh_page(self) -> int:
        page, _ = self.free.popitem(last=False)
        if page in self.page_key:  # evict its stale prefix-cache entry
            h, _ = self.page_key.pop(page)
            if self.hash_to_page.get(h) == page:
                del self.hash_to_page[h]
        self.refcount[page] = 1
        return page

    # ---------------------------------------------------------------- verbs

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        cached, _ = self._cached_prefix(seq.token_ids)
        needed = self.pages_for(len(seq)) - len(cached)
        free_after_hits = self.num_free_pages - sum(1 for p in cached if self.refcount[p] == 0)
        return needed + reserve <= free_after_hits

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence pages for all its tokens, reusing cached prefix pages."""
        assert not seq.pages, "allocate() on a sequence that already holds pages"
        cached, hashes = self._cached_prefix(seq.token_ids)
        for page in cached:
            if self.refcount[page] == 0:
                del self.free[page]
            self.refcount[page] += 1
        fresh = [self._take_fresh_page() for _ in range(self.pages_for(len(seq)) - len(cached))]
        seq.pages = cached + fresh
        seq.page_hashes = hashes
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.page_size

    def can_append(self, seq: Sequence) -> bool:
        return self.pages_for(len(seq)) - len(seq.pages) <= self.num_free_pages

    def append(self, seq: Sequence) -> None:
        """Make sure the sequence has pages for all its tokens (decode grows one token a step)."""
        while len(seq.pages) < self.pages_for(len(seq)):
            seq.pages.append(self._take_fresh_page())

    def commit(self, seq: Sequence) -> None:
        """Register the hashes of pages that became full and computed, so others can share them."""
        if not self.enable_prefix_caching:
            return
        token_ids = seq.token_ids
        for i in range(len(seq.page_hashes), seq.num_computed_tokens // self.page_size):
            page = seq.pages[i]
            tokens = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            h = _page_hash(seq.page_hashes[-1] if seq.page_hashes else None, tokens)
            if h not in self.hash_to_page and page not in self.page_key:
                self.hash_to_page[h] = page
                self.page_key[page] = (h, tokens)
            seq.page_hashes.append(h)

    def free_pages(self, seq: Sequence) -> None:
        """Return the sequence's pages (finish, abort or preemption); shared pages stay alive."""
        for page in reversed(seq.pages):  # tail first: a prefix lives longer in the free list
            self.refcount[page] -= 1
            assert self.refcount[page] >= 0, f"page {page} freed twice"
            if self.refcount[page] == 0:
                self.free[page] = None
        seq.pages = []
        seq.page_hashes = []
        seq.num_computed_tokens = 0
