"""`KVTiers`: where KV pages live besides the cache in memory, and the copies between them.

Two tiers sit under the paged cache: the host swap pool of preempted sequences (`swap.py`) and
the prefix cache's disk tier (`kv_disk.py`). The scheduler and the block manager only queue
what should move (host bookkeeping); `move_pages` dispatches those copies through the runner
before the step that relies on them, in one fixed order: copies out first (swap-outs, pages
leaving for disk), which read pages that the copies in (swap-ins, disk hits) and the step may
then overwrite. Every copy is a device program ordered after the steps dispatched before it,
so it reads what they wrote.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import jax
import numpy as np

from minivllm_jax.config import EngineConfig, ModelConfig
from minivllm_jax.engine.block_manager import BlockManager, CachedPage
from minivllm_jax.engine.kv_disk import DiskPageStore
from minivllm_jax.engine.runner import ModelRunner
from minivllm_jax.engine.scheduler import Scheduler
from minivllm_jax.engine.swap import SwapPool
from minivllm_jax.kv_cache import KVCache, kv_bytes_per_page
from minivllm_jax.models.llama import Params


def kv_layout_fingerprint(model_config: ModelConfig, config: EngineConfig, params: Params, cache: KVCache) -> str:
    """What a page's K/V depend on besides its tokens: the model's config, its weights and the
    cache's layout. The disk tier keeps pages under this name, so another model, checkpoint,
    dtype or page size never sees them. The weights are sampled (each leaf's first and last
    rows) rather than hashed whole: enough to tell checkpoints apart, at no start-up cost."""
    h = hashlib.sha256(repr((model_config, config.page_size, config.kv_cache_dtype)).encode())
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        h.update(f"{jax.tree_util.keystr(path)}{leaf.shape}{leaf.dtype}".encode())
        if leaf.ndim:
            h.update(np.asarray(leaf[:1]).tobytes() + np.asarray(leaf[-1:]).tobytes())
    for leaf in jax.tree.leaves(cache):
        h.update(f"{leaf.shape[0]}{leaf.shape[2:]}{leaf.dtype}".encode())
    return h.hexdigest()[:24]


def _leaves(pages: KVCache) -> dict:
    """Gathered pages by leaf name, as the disk tier stores them (its writer thread copies them
    to host arrays, waiting for the gather there rather than on the engine thread)."""
    leaves = {f.name: getattr(pages, f.name) for f in dataclasses.fields(pages)}
    return {name: leaf for name, leaf in leaves.items() if leaf is not None}


class KVTiers:
    """The swap pool (None under "recompute") and the disk tier (None without `kv_disk_dir`)."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, runner: ModelRunner) -> None:
        self.runner = runner
        self.disk = None
        if config.kv_disk_dir is not None:
            namespace = kv_layout_fingerprint(model_config, config, runner.params, runner.cache)
            self.disk = DiskPageStore(config.kv_disk_dir, int(config.kv_disk_gb * 2**30), namespace)
        self.swap_pool = None
        if config.preemption_mode != "recompute":
            page_bytes = kv_bytes_per_page(model_config, config.page_size, runner.dtype, config.kv_cache_dtype)
            self.swap_pool = SwapPool(config.preemption_mode, int(config.swap_space_gb * 2**30) // page_bytes, page_bytes)

    def warmed_up(self) -> None:
        """Take the page copy speed the runner measured at warm-up into the swap cost model."""
        if self.swap_pool is not None and self.runner.page_copy_bytes_per_s is not None:
            self.swap_pool.bytes_per_second = self.runner.page_copy_bytes_per_s

    def move_pages(self, sched: Scheduler, bm: BlockManager) -> None:
        """Dispatch the copies `sched` and `bm` queued, in the order of the module docstring."""
        for swapped in sched.swap_outs:
            swapped.data = self.runner.gather_pages(swapped.source_pages)
        sched.swap_outs = []
        if bm.evicted:
            self.write_to_disk(bm.evicted)
            bm.evicted = []
        for swapped, pages in sched.swap_ins:
            self.runner.scatter_pages(swapped.data, pages)
            sched.swap_pool.release(swapped)
        sched.swap_ins = []
        if bm.loaded:
            self.runner.scatter_pages(self.runner.host_pieces([a for _, a in bm.loaded]), [p for p, _ in bm.loaded])
            bm.loaded = []

    def write_to_disk(self, pages: list[tuple[int, CachedPage]]) -> None:
        """Queue cached pages for the disk tier: copied now (in step order), written by its thread."""
        start = 0
        for data, count in self.runner.gather_pages([page for page, _ in pages]):
            entries = [(e.digest, e.parent, e.tokens) for _, e in pages[start : start + count]]
            self.disk.save_later(entries, functools.partial(_leaves, data))
            start += count

    def stats(self, bm: BlockManager) -> dict[str, int]:
        """Where KV lives and moves: the `EngineStats` fields of each tier (read by /metrics)."""
        stats = dict(memory_hit_tokens=bm.num_memory_hit_tokens, disk_hit_tokens=bm.num_disk_hit_tokens)
        pool, disk = self.swap_pool, self.disk
        if pool is not None:
            stats.update(swap_pages=pool.used_pages, swap_outs=pool.num_swap_outs, swap_ins=pool.num_swap_ins)
        if disk is not None:
            stats.update(disk_pages=disk.num_pages, disk_bytes=disk.num_bytes, disk_pages_written=disk.num_written,
                         disk_corrupt=disk.num_corrupt)  # fmt: skip
        return stats

    def close(self, sched: Scheduler, bm: BlockManager) -> None:
        """A clean shutdown: write every cached page still only in memory to the disk tier (so a
        restarted server finds them) and wait for the writes. Safe to call twice."""
        if self.disk is None or self.disk.closed:
            return
        self.move_pages(sched, bm)
        self.write_to_disk(bm.pages_to_persist())
        self.disk.close()
