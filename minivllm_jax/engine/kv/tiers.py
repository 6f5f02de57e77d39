"""`KVTiers`: where KV pages live besides the cache in memory, and the copies between them.

Two tiers sit under the paged cache: the host swap pool of preempted sequences (`swap.py`) and
the prefix cache's disk tier (`disk.py`). The scheduler and the page manager only decide
what should move (host bookkeeping), handed over as the `PageMoves` of a `ScheduledBatch`;
`move_pages` dispatches those copies before the step that relies on them, in one fixed order:
copies out first (swap-outs, pages
leaving for disk), which read pages that the copies in (swap-ins, disk hits) and the step may
then overwrite. Every copy is a device program ordered after the steps dispatched before it,
so it reads what they wrote.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging

import jax
import numpy as np

from minivllm_jax.config import EngineConfig, ModelConfig
from minivllm_jax.engine.kv.disk import DiskPageStore
from minivllm_jax.engine.kv.pages import CachedPage, PageManager
from minivllm_jax.engine.kv.swap import SwapPool
from minivllm_jax.engine.runner import ModelRunner
from minivllm_jax.engine.sched_output import PageMoves
from minivllm_jax.engine.scheduler import Scheduler
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.models.params import ServingParams
from minivllm_jax.ops.kv_cache import KVCache, kv_bytes_per_page

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class FailedMoves:
    """What the page copies that failed cost: sequences to recompute from their tokens (their
    pages were requeued by `Scheduler.preempt`; drop them from the step) and sequences whose
    pages hold nothing usable and cannot be refilled the same way (fail their requests)."""

    recompute: list[Sequence] = dataclasses.field(default_factory=list)
    failed: list[Sequence] = dataclasses.field(default_factory=list)
    error: str = ""

    def __bool__(self) -> bool:
        return bool(self.recompute or self.failed)


def kv_layout_fingerprint(
    model_config: ModelConfig, config: EngineConfig, params: ServingParams, cache: KVCache
) -> str:
    """What a page's K/V depend on besides its tokens: the model's config, its weights and the
    cache's layout. The disk tier keeps pages under this name, so another model, checkpoint,
    dtype or page size never sees them. The weights are sampled (each leaf's first and last
    rows) rather than hashed whole: enough to tell checkpoints apart, at no start-up cost."""
    h = hashlib.sha256(
        repr((model_config, config.cache.page_size, config.cache.kv_cache_dtype)).encode()
    )
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

    def __init__(
        self, model_config: ModelConfig, config: EngineConfig, runner: ModelRunner
    ) -> None:
        self.mover = runner.page_mover  # the device copies
        self.disk = None
        if config.cache.kv_disk_dir is not None:
            namespace = kv_layout_fingerprint(model_config, config, runner.params, runner.cache)
            self.disk = DiskPageStore(
                config.cache.kv_disk_dir, int(config.cache.kv_disk_gb * 2**30), namespace
            )
        self.swap_pool = None
        if config.scheduler.preemption_mode != "recompute":
            page_bytes = kv_bytes_per_page(
                model_config, config.cache.page_size, runner.dtype, config.cache.kv_cache_dtype
            )
            self.swap_pool = SwapPool(
                config.scheduler.preemption_mode,
                int(config.cache.swap_space_gb * 2**30) // page_bytes,
                page_bytes,
            )

    def warmed_up(self) -> None:
        """Take the page copy speed measured at warm-up into the swap cost model."""
        if self.swap_pool is not None and self.mover.bytes_per_s is not None:
            self.swap_pool.bytes_per_second = self.mover.bytes_per_s

    def move_pages(self, moves: PageMoves, sched: Scheduler, pm: PageManager) -> FailedMoves:
        """Dispatch `moves` (from `sched`'s batch), in the order of the module docstring.

        Each move is a transaction of its own sequence: a move is handed over once (a failed
        copy is never retried by a later step), and a copy that raises
        costs only its sequence. A failed swap-out or swap-in recomputes the sequence from its
        tokens; a failed disk write only leaves those pages out of the disk tier; a failed disk
        load uncaches the pages and fails the sequences holding them (recomputing would load
        the same pages again)."""
        out = FailedMoves()
        for seq, swapped in moves.swap_outs:
            try:
                swapped.data = self.mover.gather_pages(swapped.source_pages)
            except Exception as e:  # noqa: BLE001 (only this sequence's copy is lost)
                logger.exception("swapping out %r failed; it is recomputed instead", seq)
                out.error = f"{type(e).__name__}: {e}"
                sched.swap_out_failed(seq, swapped)
        if moves.to_disk:
            try:
                self.write_to_disk(list(moves.to_disk))
            except Exception:  # noqa: BLE001 (a cache: the pages are simply not on disk)
                logger.exception(
                    "writing %d evicted pages to the disk tier failed; they are dropped",
                    len(moves.to_disk),
                )
        for seq, swapped, pages in moves.swap_ins:
            try:
                if swapped.data is None:
                    raise RuntimeError("its pages were never copied out")
                self.mover.scatter_pages(swapped.data, pages)
            except Exception as e:  # noqa: BLE001
                logger.exception("swapping in %r failed; it is recomputed instead", seq)
                out.error = f"{type(e).__name__}: {e}"
                if not seq.is_finished:
                    sched.recompute(seq)
                    out.recompute.append(seq)
            finally:
                sched.swap_pool.release(swapped)
        loaded = moves.from_disk
        if loaded:
            try:
                self.mover.scatter_pages(
                    self.mover.host_pieces([a for _, a in loaded]), [p for p, _ in loaded]
                )
            except Exception as e:  # noqa: BLE001
                logger.exception(
                    "loading %d pages from the disk tier failed; failing the sequences that hold them",
                    len(loaded),
                )
                out.error = f"{type(e).__name__}: {e}"
                pages = {p for p, _ in loaded}
                pm.drop_cached(pages)
                out.failed += [
                    s for s in sched.running + sched.waiting if pages.intersection(s.pages)
                ]
        return out

    def write_to_disk(self, pages: list[tuple[int, CachedPage]]) -> None:
        """Queue cached pages for the disk tier: copied now (in step order), written by its thread."""
        start = 0
        for data, count in self.mover.gather_pages([page for page, _ in pages]):
            entries = [(e.digest, e.parent, e.tokens) for _, e in pages[start : start + count]]
            self.disk.save_later(entries, functools.partial(_leaves, data))
            start += count

    def stats(self, pm: PageManager) -> dict[str, int]:
        """Where KV lives and moves: the `EngineStats` fields of each tier (read by /metrics)."""
        stats = dict(
            memory_hit_tokens=pm.num_memory_hit_tokens, disk_hit_tokens=pm.num_disk_hit_tokens
        )
        pool, disk = self.swap_pool, self.disk
        if pool is not None:
            stats.update(
                swap_pages=pool.used_pages,
                swap_outs=pool.num_swap_outs,
                swap_ins=pool.num_swap_ins,
                swap_recomputes=pool.num_recomputes,
                swap_bytes_per_second=pool.bytes_per_second,
            )
        if disk is not None:
            stats.update(
                disk_pages=disk.num_pages,
                disk_bytes=disk.num_bytes,
                disk_pages_written=disk.num_written,
                disk_corrupt=disk.num_corrupt,
            )
        return stats

    def close(self, sched: Scheduler, pm: PageManager) -> None:
        """A clean shutdown: write every cached page still only in memory to the disk tier (so a
        restarted server finds them) and wait for the writes. Safe to call twice."""
        if self.disk is None or self.disk.closed:
            return
        self.move_pages(sched.take_moves(), sched, pm)
        self.write_to_disk(pm.pages_to_persist())
        self.disk.close()
