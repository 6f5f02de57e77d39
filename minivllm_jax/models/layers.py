"""The decoder's building blocks, as pure functions: norms, RoPE, soft-capping, the projections
(every matmul through `minivllm_jax.ops.matmul`, float or quantized), the attention inputs,
the attention output and MLP of one layer, the embedding lookup and the output head.

Numerics follow HF's modeling_llama: RMSNorm in float32 then cast back before the weight,
rotate-half RoPE; what other families change is a static `ModelConfig` field, a Python-level
branch, so a Llama program contains none of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from minivllm_jax.config import ModelConfig
from minivllm_jax.models.params import Params, ServingParams
from minivllm_jax.ops.batch import StepBatch
from minivllm_jax.ops.matmul import head_matmul
from minivllm_jax.ops.matmul import matmul as project
from minivllm_jax.ops.quantization import is_quantized, lookup_embedding

# HF activation names -> the function; gelu_pytorch_tanh is GELU's tanh approximation.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies (float32), with HF's `linear` and `llama3` scaling rules; `local`:
    those of the sliding-window layers when they have their own base (`cfg.local_rope_theta`)."""
    if local:
        cfg = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)
    dim = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    )
    if cfg.rope_scaling is None:
        return inv_freq.astype(np.float32)
    kind, p = cfg.rope_scaling[0], cfg.rope_scaling_dict
    if kind == "linear":
        return (inv_freq / p["factor"]).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """HF's RMSNorm. With an `offset` (Gemma's `1 + w`), scaled in float32 before the cast
    back, as Gemma does; Llama casts first, then scales."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """Gemma's soft-capping: `cap * tanh(x / cap)`."""
    return cap * jnp.tanh(x / cap)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, heads, hd]; cos/sin: [T, hd] (rotate-half convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def linear(matmul: str, x: jax.Array, p: Params, axis: str | None = None) -> jax.Array:
    """`x @ kernel + bias`, the kernel float or quantized, by the `matmul` implementation
    (`minivllm_jax.ops.matmul`). With `axis` the kernel's input rows are split over that mesh
    axis (o_proj and down_proj under tensor parallelism, `minivllm_jax.parallel.sharding`): the
    partial products are summed over the devices (one all-reduce) before the bias is added, once."""
    y = project(x, p["kernel"], matmul)
    if axis is not None:
        y = lax.psum(y, axis)
    return y + p["bias"] if "bias" in p else y


def attention_inputs(
    cfg: ModelConfig, matmul: str, lp: Params, x: jax.Array
) -> tuple[jax.Array, ...]:
    T, q_dim, kv_dim = x.shape[0], cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
    qkv = linear(matmul, rms_norm(x, lp["input_layernorm"], eps, offset), lp["qkv_proj"])
    q, k, v = jnp.split(qkv, [q_dim, q_dim + kv_dim], axis=-1)
    q, k = q.reshape(T, cfg.num_heads, cfg.head_dim), k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:  # per head, before RoPE
        q, k = rms_norm(q, lp["q_norm"], eps, offset), rms_norm(k, lp["k_norm"], eps, offset)
    return q, k, v.reshape(T, cfg.num_kv_heads, cfg.head_dim)


def attention_output_and_mlp(
    cfg: ModelConfig,
    matmul: str,
    axis: str | None,
    lp: Params,
    x: jax.Array,
    attn: jax.Array,
) -> jax.Array:
    eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
    if (
        cfg.sandwich_norms
    ):  # Gemma: post_attention_layernorm norms the attention output, not the MLP input
        x = x + rms_norm(
            linear(matmul, attn, lp["o_proj"], axis), lp["post_attention_layernorm"], eps, offset
        )
        h = rms_norm(x, lp["pre_feedforward_layernorm"], eps, offset)
    else:
        x = x + linear(matmul, attn, lp["o_proj"], axis)
        h = rms_norm(x, lp["post_attention_layernorm"], eps, offset)
    gate, up = jnp.split(linear(matmul, h, lp["gate_up_proj"]), 2, axis=-1)
    y = linear(matmul, ACTIVATIONS[cfg.hidden_act](gate) * up, lp["down_proj"], axis)
    return x + (
        rms_norm(y, lp["post_feedforward_layernorm"], eps, offset) if cfg.sandwich_norms else y
    )


def rope(
    cfg: ModelConfig, positions: jax.Array, dtype: Any, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[T, hd]` of the tokens' positions (`local`: see `rope_inv_freq`)."""
    freqs = positions[:, None].astype(jnp.float32) * rope_inv_freq(cfg, local)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def output_logits(
    params: ServingParams,
    cfg: ModelConfig,
    matmul: str,
    axis: str | None,
    x: jax.Array,
    batch: StepBatch,
    all_logits: bool,
    logit_rows: jax.Array | None,
) -> jax.Array:
    """Float32 logits of the final hidden states `x` at the rows `decoder.forward` returns."""
    if logit_rows is not None:
        x = x[logit_rows]
    elif not all_logits:
        last = batch.query_start + jnp.maximum(batch.query_len, 1) - 1
        x = x[jnp.clip(last, 0, batch.num_tokens - 1)]
    x = rms_norm(x, params.norm, cfg.rms_norm_eps, cfg.norm_weight_offset)
    head = params.embed_tokens if cfg.tie_word_embeddings else params.lm_head
    # A quantized tied head is stored as the head, [hidden, vocab] (`quantization.quantize_head`).
    transposed = cfg.tie_word_embeddings and not is_quantized(head)
    logits = head_matmul(x, head, transposed, matmul)
    if (
        axis is not None and logits.shape[-1] < cfg.vocab_size
    ):  # this device's slice of the vocabulary
        logits = lax.all_gather(logits, axis, axis=logits.ndim - 1, tiled=True)
    return logits


def embed(
    table: Any, tokens: jax.Array, cfg: ModelConfig, dtype: Any, axis: str | None
) -> jax.Array:
    """The tokens' embeddings. A table split by vocabulary over `axis` (tensor parallelism)
    holds rows `[i * rows, (i + 1) * rows)` on device `i`: each device looks up the tokens it
    holds, zeros the others, and the sum over devices is every token's row."""
    rows = cfg.vocab_size if is_quantized(table) else table.shape[0]
    if axis is None or rows == cfg.vocab_size:
        return lookup_embedding(table, tokens, dtype)
    local = tokens - lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    x = lookup_embedding(table, jnp.where(mine, local, 0), dtype)
    return lax.psum(jnp.where(mine[:, None], x, jnp.zeros_like(x)), axis)
