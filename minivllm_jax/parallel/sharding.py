"""Tensor parallelism on JAX's own SPMD runtime: a `Mesh` with one axis, the same params
pytree sharded Megatron-style, the KV cache split by KV head, the model under `shard_map`.

Per device of a `tp`-way mesh (`TP_AXIS`), of the serving params (`models.params.ServingParams`):
- `qkv_proj` by output columns: the device's query heads, then its K and V heads (the merged
  columns are reordered once, at load, so that each device's slice is contiguous);
  `gate_up_proj` likewise: its slice of gate, then of up.
- `o_proj` and `down_proj` by input rows: each device multiplies its heads' (its
  intermediate slice's) part, and one all-reduce per projection sums them (two a layer).
- `embed_tokens` by vocabulary rows and an untied `lm_head` by vocabulary columns when the
  vocabulary divides by `tp` (else they are replicated): the lookup is local plus an
  all-reduce, the logits one all-gather. Norms are replicated.
- The KV cache `[L, pages, KVH, ...]` by KV head: each device reads only its heads' pages;
  page ids, block tables and the host scheduler are the same as with one device.

GQA with fewer KV heads than devices: each KV head is repeated `tp // KVH` times (in the
weights and so in the cache), so every device holds the one KV head its query heads read.
Exact, at `tp // KVH` times the KV memory. Refused with a `ValueError` (nothing is padded):
query heads, intermediate size, or KV heads (unless `tp` is a multiple of them) that do not
divide by `tp`, and quantized weights (their panels are laid out for one device).

The step is still one jitted program: `shard_map` runs the model on each device's slices with
explicit collectives (`forward(..., axis=TP_AXIS)`), and the sampler after it runs on the
replicated logits. So the native kernels (attention) run per device on local shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from minivllm_jax.config import ModelConfig
from minivllm_jax.models.params import Params, ServingParams
from minivllm_jax.ops.kv_cache import KVCache
from minivllm_jax.ops.quantization import is_quantized

TP_AXIS = "tp"


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over the first `tensor_parallel_size` of `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
            f"{len(devices)} available ({devices[0].platform})"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP_AXIS,))


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise a ValueError saying why `cfg` cannot be split `tp` ways (see the module docstring)."""
    problems = _split_problems(cfg, tp)
    if problems:
        divisors = [d for d in range(1, cfg.num_heads + 1) if not _split_problems(cfg, d)]
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide {', '.join(problems)}; "
            f"this model splits {divisors} ways"
        )


def _split_problems(cfg: ModelConfig, tp: int) -> list[str]:
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads} (nor is {tp} a multiple of it)")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    return problems


def kv_replicas(cfg: ModelConfig, tp: int) -> int:
    """How many times each KV head is stored (1 unless there are fewer KV heads than devices)."""
    return max(1, tp // cfg.num_kv_heads)


def stored_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """`cfg` with the KV heads as the sharded weights and cache hold them (repeated when
    `kv_replicas > 1`): what the cache is built from and the step is given."""
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * kv_replicas(cfg, tp))


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """One device's share of a `stored_config`: its heads and intermediate slice (the
    vocabulary stays global: `forward` tells a split table by its shape)."""
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=cfg.num_kv_heads // tp,
        intermediate_size=cfg.intermediate_size // tp,
    )


# ----------------------------------------------------------------------------------- params


def _per_device_columns(parts: list[np.ndarray], tp: int) -> np.ndarray:
    """Columns `[a | b | c]` (last axis) reordered to `[a_0 b_0 c_0 | a_1 b_1 c_1 | ...]`:
    device `i`'s contiguous slice then holds its share of every part."""
    split = [np.split(part, tp, axis=-1) for part in parts]
    return np.concatenate([piece for i in range(tp) for piece in (s[i] for s in split)], axis=-1)


def _reorder_layer(lp: Params, cfg: ModelConfig, tp: int) -> Params:
    q_dim, kv_dim, f = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    r, hd = kv_replicas(cfg, tp), cfg.head_dim

    def qkv(a: np.ndarray) -> np.ndarray:
        q, k, v = np.split(a, [q_dim, q_dim + kv_dim], axis=-1)
        if r > 1:  # repeat each KV head r times, so each device has one
            k, v = (
                np.repeat(x.reshape(*x.shape[:-1], cfg.num_kv_heads, hd), r, axis=-2).reshape(
                    *x.shape[:-1], -1
                )
                for x in (k, v)
            )
        return _per_device_columns([q, k, v], tp)

    out = dict(lp)
    out["qkv_proj"] = {name: qkv(np.asarray(a)) for name, a in lp["qkv_proj"].items()}
    out["gate_up_proj"] = {
        name: _per_device_columns(np.split(np.asarray(a), [f], axis=-1), tp)
        for name, a in lp["gate_up_proj"].items()
    }
    return out


def param_specs(params: ServingParams, tp: int) -> ServingParams:
    """The `PartitionSpec` of every leaf of serving params (see the module docstring)."""

    def layer(lp: Params) -> Params:
        specs = {name: P() for name in lp if not isinstance(lp[name], dict)}
        for name, axis in (
            ("qkv_proj", "col"),
            ("gate_up_proj", "col"),
            ("o_proj", "row"),
            ("down_proj", "row"),
        ):
            kernel = P(None, TP_AXIS) if axis == "col" else P(TP_AXIS, None)
            specs[name] = {"kernel": kernel} | (
                {"bias": P(TP_AXIS) if axis == "col" else P()} if "bias" in lp[name] else {}
            )
        return specs

    split_vocab = params.embed_tokens.shape[0] % tp == 0
    head = params.lm_head
    return ServingParams(
        embed_tokens=P(TP_AXIS, None) if split_vocab else P(),
        layers=tuple(layer(lp) for lp in params.layers),
        norm=P(),
        lm_head=None if head is None else P(None, TP_AXIS) if head.shape[1] % tp == 0 else P(),
    )


def shard_params(params: ServingParams, cfg: ModelConfig, mesh: Mesh) -> ServingParams:
    """Serving params reordered and placed on `mesh`, each device holding only its slices.
    `cfg` is the model's own config (not yet `stored_config`)."""
    tp = mesh.shape[TP_AXIS]
    check_tensor_parallel(cfg, tp)
    if any(
        is_quantized(p.get("kernel"))
        for lp in params.layers
        for p in lp.values()
        if isinstance(p, dict)
    ) or any(is_quantized(head) for head in (params.embed_tokens, params.lm_head)):
        raise ValueError(
            "quantized weights cannot be split over devices yet: use tensor_parallel_size=1 "
            "with quantization, or quantization=None with tensor parallelism"
        )
    params = dataclasses.replace(
        params, layers=tuple(_reorder_layer(lp, cfg, tp) for lp in params.layers)
    )
    specs = param_specs(params, tp)
    # From host memory: with several processes each one places only its own devices' shards.
    return jax.tree.map(
        lambda a, spec: jax.device_put(np.asarray(a), NamedSharding(mesh, spec)), params, specs
    )


# ------------------------------------------------------------------------------------ cache


KV_HEAD_SPLIT = P(None, None, TP_AXIS)  # K, V and their scales: axis 2 is the KV head


def cache_specs(cache: KVCache) -> KVCache:
    return jax.tree.map(lambda _: KV_HEAD_SPLIT, cache)


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    return jax.tree.map(lambda _: NamedSharding(mesh, KV_HEAD_SPLIT), cache)


# ---------------------------------------------------------------------------------- forward


def sharded(
    mesh: Mesh, model: Callable[..., tuple[jax.Array, KVCache]]
) -> Callable[..., tuple[jax.Array, KVCache]]:
    """`model(params, cache, batch, axis)` (a `forward` with its static arguments bound, taking a
    `local_config`) run on each device's slices of params and cache; the batch and the
    returned logits are whole on every device, the returned cache split as it came."""
    tp = mesh.shape[TP_AXIS]

    def run(params: ServingParams, cache: KVCache, batch: Any) -> tuple[jax.Array, KVCache]:
        in_specs = (param_specs(params, tp), cache_specs(cache), P())
        body = lambda p, c, b: model(p, c, b, TP_AXIS)  # noqa: E731
        # check_vma=False: the model's loops start from constants (replicated) and carry values
        # that vary by device, which the checker would have annotated at every loop; the
        # logits are all-gathered, so they are the same on every device as out_specs says.
        return jax.shard_map(
            body, mesh=mesh, in_specs=in_specs, out_specs=(P(), cache_specs(cache)), check_vma=False
        )(params, cache, batch)

    return run
