"""Swap instead of recompute: the host pool a preempted sequence's KV pages wait in.

A preempted sequence either gives its pages back and is recomputed from its tokens later
("recompute", vLLM's default), or has its computed pages copied out to this pool and copied back
into fresh pages when it resumes ("swap"). "auto" decides per sequence with a cost model: moving
its pages twice (out and back, at the copy speed measured at warm-up) against prefilling its
computed tokens again (at the per-token cost of the largest step measured so far).

Host bookkeeping only: the pool counts pages against `swap_space_gb`; the copies themselves are
the page mover's (`PageMover.gather_pages` / `scatter_pages`), dispatched in order with the steps,
so a page is read before any later step can reuse it. On a CPU backend the gathered copy already
lives in host memory, so the pool keeps that array as it is (one copy out, one back); on an
accelerator it is moved to the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Copy speed assumed before warm-up measures it (bytes/s): a conservative host memcpy.
DEFAULT_SWAP_BYTES_PER_S = 2e9


@dataclasses.dataclass(eq=False)
class SwappedKV:
    """One sequence's computed pages while it is swapped out."""

    num_pages: int
    source_pages: list[int]  # device pages to copy out (freed by the page manager already)
    data: Any = None  # the copied pages (a KVCache-shaped tree, pages on axis 1) once dispatched
    released: bool = False  # its pages were given back to the pool


class SwapPool:
    """Capacity accounting and the per-sequence choice between swap and recompute."""

    def __init__(self, mode: str, capacity_pages: int, bytes_per_page: int) -> None:
        self.mode = mode
        self.capacity_pages = capacity_pages
        self.bytes_per_page = bytes_per_page
        self.bytes_per_second = DEFAULT_SWAP_BYTES_PER_S
        self.used_pages = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_recomputes = 0  # preemptions that chose (or fell back to) recompute

    def should_swap(self, num_pages: int, num_tokens: int, seconds_per_token: float | None) -> bool:
        """Swap `num_pages` pages rather than recompute `num_tokens` tokens? Never when the pool
        is full; "auto" swaps when two copies of the pages cost less than the prefill (or when
        no prefill has been measured yet: keeping computed work is the safer guess)."""
        if (
            self.mode == "recompute"
            or num_pages == 0
            or self.used_pages + num_pages > self.capacity_pages
        ):
            return False
        if self.mode == "swap" or seconds_per_token is None:
            return True
        return self.swap_seconds(num_pages) < num_tokens * seconds_per_token

    def swap_seconds(self, num_pages: int) -> float:
        return 2 * num_pages * self.bytes_per_page / self.bytes_per_second

    def take(self, source_pages: list[int]) -> SwappedKV:
        self.used_pages += len(source_pages)
        self.num_swap_outs += 1
        return SwappedKV(len(source_pages), list(source_pages))

    def release(self, swapped: SwappedKV) -> None:
        """The sequence resumed (its pages were copied back) or ended while swapped out.
        Idempotent: a second release of the same pages (a failure path) does nothing."""
        if not swapped.released:
            swapped.released = True
            self.used_pages -= swapped.num_pages
        swapped.data = None

    def reset(self) -> None:
        """Nothing is swapped out any more (`Scheduler.reset`, after a recovery)."""
        self.used_pages = 0
