"""`PageManager`: KV pages, refcounts and the hash-chained prefix cache (host bookkeeping only).

Page 0 is the scratch page and never handed out. A full page is identified by a sha256 digest
chained over its parent page's digest and its own tokens, so equal prefixes map to equal pages
and a prompt cannot be crafted to land on another request's page (a weak key such as Python's
`hash` can be collided on purpose: vLLM's CVE-2025-25183). A hit also checks the stored parent
digest and tokens, so even a digest collision cannot serve a page from another chain. Freed
pages keep their digest until reused (least recently freed first), so a finished or preempted
request's prefix can still be hit later.

The scheduler's one verb is `allocate_slots`: all or nothing, it gives a sequence pages for
its tokens (and a lookahead) or returns None having changed nothing, and the scheduler preempts
and retries (vLLM v1's `KVCacheManager.allocate_slots`). An admission walks (hashes) its prompt's
prefix once, in that call.

With a disk tier (`DiskPageStore`), a cached page about to be reused is queued in `evicted` to be
written out first (`take_evicted`), and an admission whose prefix continues on disk gets fresh
pages whose contents come back in its `PageAllocation.disk_loads`; the scheduler hands both to
the engine in the schedule output (`sched_output.PageMoves`), copied (`KVTiers.move_pages`)
before the step runs. A sequence swapped out at preemption gets fresh pages on resume and its
KV is copied back the same way (`minivllm_jax.engine.kv.swap`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict

import numpy as np

from minivllm_jax.engine.kv.disk import DiskPageStore
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.ops.kv_cache import SCRATCH_PAGE

ROOT_DIGEST = b""  # the "parent" of a sequence's first page (no cache salt)
MAX_CACHE_SALT_CHARS = 256  # a salt is an identifier (vLLM's cache_salt), not a payload


def check_cache_salt(cache_salt: str | None) -> None:
    """ValueError unless `cache_salt` is None or a non-empty string of at most MAX_CACHE_SALT_CHARS."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"
        )


def root_digest(cache_salt: str | None) -> bytes:
    """The parent of a sequence's first page: `ROOT_DIGEST`, or a digest of the request's cache
    salt (vLLM's `cache_salt`), so every page of a salted chain differs from the unsalted one and
    from other salts' (in memory and in the disk tier, keyed by the same digests): a client cannot
    learn by timing whether a differently salted request cached a prompt."""
    if cache_salt is None:
        return ROOT_DIGEST
    return hashlib.sha256(
        b"minivllm cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass")
    ).digest()


def page_digest(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """sha256 over the parent page's digest and this page's token ids (fixed-width, so no two
    token lists share an encoding)."""
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


@dataclasses.dataclass(frozen=True)
class PageAllocation:
    """What `allocate_slots` gave a sequence: the fresh pages it took, in order (appended to
    `seq.pages`; a resumed swapped-out sequence copies its KV into the first ones), and of those
    the pages to fill from the disk tier with their contents (a leaf name -> one page's array)."""

    new_pages: tuple[int, ...] = ()
    disk_loads: tuple[tuple[int, dict], ...] = ()


@dataclasses.dataclass(frozen=True)
class CachedPage:
    """What a cached page holds: checked in full on every hit, not only its digest."""

    digest: bytes
    parent: bytes
    tokens: tuple[int, ...]


class PageManager:
    """Pages of the paged KV cache and the prefix cache over them; every page but the scratch
    page is either free or held by the sequences counted in its refcount (`check`)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        disk: DiskPageStore | None = None,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = [0] * num_pages
        # Free pages in reuse order; an OrderedDict so a prefix hit can pull one out in O(1).
        self.free: OrderedDict[int, None] = OrderedDict(
            (p, None) for p in range(num_pages) if p != SCRATCH_PAGE
        )
        self.digest_to_page: dict[bytes, int] = {}
        self.cached: dict[int, CachedPage] = {}  # page -> what it holds, while it is in the cache
        self.disk = disk
        # Cached pages to write to the disk tier before they are overwritten (`take_evicted`).
        self.evicted: list[tuple[int, CachedPage]] = []
        self.num_memory_hit_tokens = 0  # prompt tokens served from pages in memory
        self.num_disk_hit_tokens = 0  # ... and from the disk tier

    @property
    def num_free_pages(self) -> int:
        return len(self.free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def stats(self) -> dict[str, int]:
        """The pages' `EngineStats` fields."""
        return dict(
            free_pages=self.num_free_pages,
            usable_pages=self.num_usable_pages,
            cached_pages=len(self.cached),
        )

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---------------------------------------------------------------- prefix cache lookups

    def _page_tokens(self, token_ids: list[int], i: int) -> tuple[int, ...]:
        return tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])

    def _cached_prefix(
        self, token_ids: list[int], root: bytes = ROOT_DIGEST
    ) -> tuple[list[int], list[bytes], bytes | None]:
        """Pages (and their digests) holding the longest cached prefix, leaving a token to compute,
        and the digest of the full page after it (None: none), where the disk tier's walk goes
        on. `root`: the chain's first parent (`root_digest` of the request's cache salt)."""
        pages: list[int] = []
        digests: list[bytes] = []
        if not self.enable_prefix_caching:
            return pages, digests, None
        parent = root
        for i in range((len(token_ids) - 1) // self.page_size):
            tokens = self._page_tokens(token_ids, i)
            digest = page_digest(parent, tokens)
            page = self.digest_to_page.get(digest)
            if page is None or self.cached[page] != CachedPage(digest, parent, tokens):
                return pages, digests, digest
            pages.append(page)
            digests.append(digest)
            parent = digest
        return pages, digests, None

    def _uncache(self, page: int) -> None:
        entry = self.cached.pop(page, None)
        if entry is not None and self.digest_to_page.get(entry.digest) == page:
            del self.digest_to_page[entry.digest]
            if self.disk is not None and not self.disk.contains(entry.digest):
                self.evicted.append((page, entry))

    def _load_from_disk(self, seq: Sequence, digest: bytes) -> list[tuple[int, dict]]:
        """Extend the sequence's cached prefix with pages found in the disk tier (each checked
        in full by the store: a corrupt or mismatched file is a miss), into fresh pages; returns
        those pages with their contents. `digest`: that of the first page past its prefix."""
        token_ids = seq.token_ids
        parent = seq.page_hashes[-1] if seq.page_hashes else root_digest(seq.cache_salt)
        loads, start = [], len(seq.pages)
        for i in range(start, (len(token_ids) - 1) // self.page_size):
            tokens = self._page_tokens(token_ids, i)
            if i > start:  # the first page's digest came from the prefix walk
                digest = page_digest(parent, tokens)
            if digest in self.digest_to_page or not self.disk.contains(digest):
                break
            arrays = self.disk.load(digest, parent, tokens)
            if arrays is None:
                break
            page = self._take_fresh_page()
            self.digest_to_page[digest] = page
            self.cached[page] = CachedPage(digest, parent, tokens)
            loads.append((page, arrays))
            seq.pages.append(page)
            seq.page_hashes.append(digest)
            self.num_disk_hit_tokens += self.page_size
            parent = digest
        return loads

    def _take_fresh_page(self) -> int:
        page, _ = self.free.popitem(last=False)
        self._uncache(page)  # its old contents are about to be overwritten
        self.refcount[page] = 1
        return page

    # ---------------------------------------------------------------- verbs

    def allocate_slots(
        self, seq: Sequence, lookahead: int = 0, reserve: int = 0
    ) -> PageAllocation | None:
        """Pages for all of the sequence's tokens and `lookahead` more, keeping `reserve` pages
        free; all or nothing: None (nothing changed) when they do not fit, and the scheduler
        preempts someone or stops admitting.

        A running sequence grows (decode, a multi-step run or a draft writes ahead). A waiting
        one is admitted: a new one reuses its cached prefix from memory, then from disk (its
        prompt hashed once, here); a forked one (beam search, n > 1) keeps the pages it shares;
        a swapped-out one (it holds no page) gets fresh pages for its KV to be copied back into."""
        cached, digests, missed = [], [], None
        admitting = seq.swapped is None and not seq.pages
        if admitting:
            cached, digests, missed = self._cached_prefix(
                seq.token_ids, root_digest(seq.cache_salt)
            )
        first_new = len(seq.pages) + len(cached)
        needed = self.pages_for(seq.cache_len + lookahead) - first_new
        revived = sum(1 for p in cached if self.refcount[p] == 0)  # cached, but in the free list
        if needed + reserve > self.num_free_pages - revived:
            return None
        loads: list[tuple[int, dict]] = []
        if admitting:
            for page in cached:
                if self.refcount[page] == 0:
                    del self.free[page]
                self.refcount[page] += 1
            seq.pages, seq.page_hashes = cached, digests
            self.num_memory_hit_tokens += len(cached) * self.page_size
            if self.disk is not None and missed is not None:
                loads = self._load_from_disk(seq, missed)
            seq.num_computed_tokens = seq.num_cached_tokens = len(seq.pages) * self.page_size
        while len(seq.pages) < self.pages_for(seq.cache_len + lookahead):
            seq.pages.append(self._take_fresh_page())
        return PageAllocation(tuple(seq.pages[first_new:]), tuple(loads))

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """Share the parent's full pages covering its first `num_tokens` tokens with `child`
        (by refcount, no copy). The child computes the rest itself into fresh pages, so a
        shared page is never written: a full page is only ever read."""
        assert not child.pages, "fork() into a sequence that already holds pages"
        full = min(num_tokens // self.page_size, parent.num_computed_tokens // self.page_size)
        child.pages = list(parent.pages[:full])
        for page in child.pages:
            self.refcount[page] += 1
        child.page_hashes = list(parent.page_hashes[:full])
        child.num_computed_tokens = full * self.page_size
        child.num_cached_tokens = parent.num_cached_tokens  # prefix-cache hits only, as the parent

    def fork_copy_on_write(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` all of the parent's computed tokens without recomputing any: full pages
        shared by refcount (as `fork`), the last partial page, which both will write into next,
        as a private copy. Returns that page's `(src, dst)` for the caller to copy on the device
        (`PageMover.copy_pages`) before either writes, or None when every page is full."""
        self.fork(parent, child, parent.num_computed_tokens)
        if parent.num_computed_tokens % self.page_size == 0:
            return None
        dst = self._take_fresh_page()
        child.pages.append(dst)
        child.num_computed_tokens = parent.num_computed_tokens
        return parent.pages[len(child.pages) - 1], dst

    def commit(self, seq: Sequence) -> None:
        """Register the digests of pages that became full and computed, so others can share them
        (not after KV compression dropped pages: its pages no longer hold the chain's tokens)."""
        if not self.enable_prefix_caching or seq.num_dropped_tokens:
            return
        first = len(seq.page_hashes)
        if first >= seq.num_computed_tokens // self.page_size:
            return  # no page became full: the common decode step
        token_ids = seq.token_ids
        for i in range(first, seq.num_computed_tokens // self.page_size):
            page = seq.pages[i]
            parent = seq.page_hashes[-1] if seq.page_hashes else root_digest(seq.cache_salt)
            tokens = self._page_tokens(token_ids, i)
            digest = page_digest(parent, tokens)
            if digest not in self.digest_to_page and page not in self.cached:
                self.digest_to_page[digest] = page
                self.cached[page] = CachedPage(digest, parent, tokens)
            seq.page_hashes.append(digest)

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; unreferenced pages go back to the free list."""
        for page in reversed(pages):  # tail first: a prefix lives longer in the free list
            self.refcount[page] -= 1
            assert self.refcount[page] >= 0, f"page {page} freed twice"
            if self.refcount[page] == 0:
                self.free[page] = None

    def free_pages(self, seq: Sequence, keep_progress: bool = False) -> None:
        """Return the sequence's pages (finish, abort or preemption); shared pages stay alive.
        `keep_progress`: its KV was copied out (swap), so its computed tokens stay computed."""
        self.release(seq.pages)
        seq.pages = []
        seq.page_hashes = []
        if not keep_progress:
            seq.num_computed_tokens = 0
            seq.num_dropped_tokens = 0

    def clear_cache(self) -> None:
        """Forget every cached page (the KV cache contents are gone, e.g. after a reset)."""
        self.digest_to_page.clear()
        self.cached.clear()
        self.evicted.clear()

    def take_evicted(self) -> list[tuple[int, CachedPage]]:
        """The cached pages queued for the disk tier since the last call (the queue empties)."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def drop_cached(self, pages: set[int]) -> None:
        """Forget these pages' prefix-cache entries without writing them anywhere: their
        contents never arrived (a failed load from the disk tier)."""
        for page in pages:
            entry = self.cached.pop(page, None)
            if entry is not None and self.digest_to_page.get(entry.digest) == page:
                del self.digest_to_page[entry.digest]

    def reset(self) -> None:
        """Rebuild the accounting from scratch once no sequence holds a page (a recovery):
        every page free with refcount 0, nothing cached or queued to move."""
        self.refcount = [0] * self.num_pages
        self.free = OrderedDict((p, None) for p in range(self.num_pages) if p != SCRATCH_PAGE)
        self.clear_cache()

    def check(self, holders: list[Sequence]) -> None:
        """Raise AssertionError unless the accounting is consistent with `holders` (every live
        sequence): free + used == usable pages, and each page's refcount equals the number of
        those sequences holding it (tests call it after every fault)."""
        owners = [0] * self.num_pages
        for seq in holders:
            for page in seq.pages:
                owners[page] += 1
        used = [p for p in range(self.num_pages) if self.refcount[p] > 0]
        problems = []
        if len(self.free) + len(used) != self.num_usable_pages:
            problems.append(
                f"{len(self.free)} free + {len(used)} used != {self.num_usable_pages} pages"
            )
        if SCRATCH_PAGE in self.free or owners[SCRATCH_PAGE] or self.refcount[SCRATCH_PAGE]:
            problems.append("the scratch page is handed out")
        problems += [
            f"page {p}: refcount {self.refcount[p]}, held by {owners[p]}"
            for p in range(self.num_pages)
            if self.refcount[p] != owners[p]
        ]
        problems += [
            f"page {p} is free with refcount {self.refcount[p]}"
            for p in self.free
            if self.refcount[p]
        ]
        if problems:
            raise AssertionError("page manager accounting: " + "; ".join(problems[:10]))

    def pages_to_persist(self) -> list[tuple[int, CachedPage]]:
        """Cached pages in memory that the disk tier does not hold yet (a clean shutdown writes them)."""
        if self.disk is None:
            return []
        return [
            (page, entry)
            for page, entry in self.cached.items()
            if not self.disk.contains(entry.digest)
        ]
