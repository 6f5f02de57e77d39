"""`PageMover`: copies of whole KV pages on the device (swap out/in, the disk tier, copy-on-write).

Contract: every copy is a device program dispatched in order with the steps, so a gather reads
what the steps dispatched before it wrote, and a scatter or copy lands before any later step
reads the pages. Page lists are padded with the scratch page to a few bucket sizes, so a
handful of compiled programs serve every call. Host bookkeeping (which pages, and when) is the
page manager's and the scheduler's; `KVTiers.move_pages` drives the swap and disk copies.
None of it runs across several processes (the copies are not announced to the followers).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from minivllm_jax.config import EngineConfig, bucket_for
from minivllm_jax.engine.compilation import CompileManager
from minivllm_jax.engine.device_state import DeviceState
from minivllm_jax.engine.step import copy_pages_jit, gather_pages_jit, scatter_pages_jit
from minivllm_jax.ops.kv_cache import SCRATCH_PAGE, KVCache
from minivllm_jax.parallel import distributed


class PageMover:
    """Gathers, scatters and copies pages of `state.cache` with programs from `programs`."""

    def __init__(self, state: DeviceState, programs: CompileManager, config: EngineConfig) -> None:
        self.state = state
        self.programs = programs
        self.config = config
        self.bytes_per_s: float | None = None  # copy speed, once `measure_copy_speed` ran

    @property
    def buckets(self) -> tuple[int, ...]:
        """Page counts of the gather/scatter programs: doublings from 4 up to a whole sequence's."""
        top = 1 << max(2, (self.config.max_pages_per_seq - 1).bit_length())
        return tuple(1 << i for i in range(2, top.bit_length()))

    def _check_one_process(self, what: str) -> None:
        if distributed.is_multiprocess():
            raise RuntimeError(f"{what} do not run across several processes")

    def _page_index(self, pages: list[int], bucket: int) -> np.ndarray:
        index = np.full(bucket, SCRATCH_PAGE, np.int32)
        index[: len(pages)] = pages
        return index

    def _chunks(self, pages: list) -> list[tuple[list, int]]:
        """`pages` in pieces of the largest bucket, each with the bucket it is padded to."""
        top = self.buckets[-1]
        return [
            (pages[i : i + top], bucket_for(len(pages[i : i + top]), self.buckets))
            for i in range(0, len(pages), top)
        ]

    def gather_pages(self, pages: list[int]) -> list[tuple[KVCache, int]]:
        """Dispatch copies of whole pages (every layer); returns `(copy, count)` pieces, each a
        cache-shaped tree with the pages on axis 1 (padded to its bucket)."""
        self._check_one_process("page swaps and the disk tier")
        state, out = self.state, []
        for piece, bucket in self._chunks(pages):
            index = self._page_index(piece, bucket)
            program = self.programs.program(
                ("gather_pages", bucket), gather_pages_jit, state.cache, *state.abstract((index,))
            )
            out.append((program(state.cache, *state.place((index,))), len(piece)))
        return out

    def scatter_pages(self, pieces: list[tuple[Any, int]], pages: list[int]) -> None:
        """Write pieces from `gather_pages` (or host arrays of the same layout) into `pages`, in order."""
        state, start = self.state, 0
        for data, count in pieces:
            bucket = jax.tree.leaves(data)[0].shape[1]
            index = self._page_index(pages[start : start + count], bucket)
            program = self.programs.program(
                ("scatter_pages", bucket),
                scatter_pages_jit,
                state.cache,
                state.abstract(data),
                *state.abstract((index,)),
            )
            state.cache = program(state.cache, *state.place((data, index)))
            start += count

    def host_pieces(self, pages: list[dict[str, np.ndarray]]) -> list[tuple[KVCache, int]]:
        """Single pages as host arrays (leaf name -> one page, as the disk tier stores them)
        stacked into padded pieces for `scatter_pages`."""
        pieces = []
        for chunk, bucket in self._chunks(pages):
            leaves = {}
            for name in chunk[0]:
                stacked = np.stack([p[name] for p in chunk], axis=1)
                pad = [(0, 0)] * stacked.ndim
                pad[1] = (0, bucket - len(chunk))
                leaves[name] = np.pad(stacked, pad)
            pieces.append((KVCache(**leaves), len(chunk)))
        return pieces

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy KV pages `src[i]` -> `dst[i]` (every layer): copy-on-write of the partial page
        forked sequences share. The index arrays are `max_num_seqs` long, padded with the
        scratch page, so one compiled program serves every call."""
        self._check_one_process("page copies")
        state, n = self.state, self.config.scheduler.max_num_seqs
        for start in range(0, len(src), n):
            pairs = np.full((2, n), SCRATCH_PAGE, np.int32)
            chunk = src[start : start + n]
            pairs[0, : len(chunk)], pairs[1, : len(chunk)] = chunk, dst[start : start + n]
            src_dst = (pairs[0], pairs[1])
            program = self.programs.program(
                ("copy_pages",), copy_pages_jit, state.cache, *state.abstract(src_dst)
            )
            state.cache = program(state.cache, *state.place(src_dst))

    def measure_copy_speed(self) -> float:
        """Bytes a second of copying pages out and back (the largest bucket, on the scratch
        page), for the swap cost model (kept in `bytes_per_s`); also compiles every page-move
        program."""
        scratch = [SCRATCH_PAGE] * self.buckets[-1]
        for bucket in self.buckets:
            self.scatter_pages(self.gather_pages(scratch[:bucket]), scratch[:bucket])
        jax.block_until_ready(self.state.cache)
        start = time.perf_counter()
        for _ in range(3):
            self.scatter_pages(self.gather_pages(scratch), scratch)
        jax.block_until_ready(self.state.cache)
        seconds = (time.perf_counter() - start) / 3
        cache_bytes = sum(x.nbytes for x in jax.tree.leaves(self.state.cache))
        page_bytes = cache_bytes // self.config.cache.num_pages
        self.bytes_per_s = 2 * len(scratch) * page_bytes / max(seconds, 1e-9)
        return self.bytes_per_s
