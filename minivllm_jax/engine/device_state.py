"""`DeviceState`: the arrays every step program donates and gets back, and where arrays go.

The KV cache, the penalty state and the fed-back tokens (the last step's sampled tokens, see
`step.py`) live on the device between steps; a program takes them donated and returns their
next values, which the caller stores back here. The runner, the page mover and the penalty
slots share one `DeviceState`, so each sees the others' latest buffers.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from minivllm_jax.config import EngineConfig, ModelConfig
from minivllm_jax.engine.step import PenaltyState, init_penalty_state
from minivllm_jax.ops.kv_cache import KVCache, init_kv_cache
from minivllm_jax.parallel import sharding

logger = logging.getLogger(__name__)


class DeviceState:
    """`cache`, `penalty_state` and `fed_back`, made empty where the step reads them: on a mesh
    the cache split by KV head and the rest whole on each device (each process making only its
    own shards); on one device (a data-parallel replica) all there; else on the default device.

    `place(tree)` puts the host's per-step arrays where a compiled program takes them, and
    `abstract(tree)` gives their types for compiling one."""

    def __init__(
        self,
        step_config: ModelConfig,
        config: EngineConfig,
        vocab_size: int,
        dtype: Any,
        mesh: Mesh | None,
        device: jax.Device | None,
    ) -> None:
        self.step_config = step_config
        self.config = config
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.mesh = mesh
        # The default device needs no placing; a replica's device or a mesh (whole on each
        # device) does, since a compiled program takes its arguments where it was compiled for them.
        self.host_sharding = (
            None
            if device is None and mesh is None
            else jax.sharding.SingleDeviceSharding(device)
            if mesh is None
            else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        )
        self.rebuild()

    def rebuild(self) -> None:
        """An empty KV cache, penalty state and fed-back tokens (every page's contents and
        every slot's history are gone)."""
        cfg = self.config

        def make() -> tuple[KVCache, PenaltyState, jax.Array]:
            cache = init_kv_cache(
                self.step_config,
                cfg.cache.num_pages,
                cfg.cache.page_size,
                self.dtype,
                cfg.cache.kv_cache_dtype,
            )
            return (
                cache,
                init_penalty_state(cfg.scheduler.max_num_seqs, self.vocab_size),
                jnp.zeros(cfg.scheduler.max_num_seqs, jnp.int32),
            )

        if self.host_sharding is None:
            self.cache, self.penalty_state, self.fed_back = make()
            return
        cache = jax.eval_shape(make)[0]
        cache_sharding = (
            self.host_sharding if self.mesh is None else sharding.cache_shardings(cache, self.mesh)
        )
        out = (cache_sharding, self.host_sharding, self.host_sharding)
        self.cache, self.penalty_state, self.fed_back = jax.jit(make, out_shardings=out)()

    def rebuild_if_lost(self) -> bool:
        """Rebuild if a failed program took the donated buffers with it (a donated input is
        deleted even when the program fails); True if it was rebuilt."""
        leaves = jax.tree.leaves((self.cache, self.penalty_state))
        if not any(leaf.is_deleted() for leaf in leaves):
            return False
        logger.warning("the KV cache buffers were lost with a failed step; rebuilding the cache")
        self.rebuild()
        return True

    def abstract(self, tree: Any) -> Any:
        """The types (shape, dtype, placement) of host arrays `tree`, to compile a program for."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                np.shape(x), np.asarray(x).dtype, sharding=self.host_sharding
            ),
            tree,
        )

    def place(self, tree: Any) -> Any:
        """Host arrays `tree` where a compiled program takes them."""
        return tree if self.host_sharding is None else jax.device_put(tree, self.host_sharding)
