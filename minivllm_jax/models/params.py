"""The model's params: the stored tree (`Params`, as converted and checkpointed) and the
serving one (`ServingParams`, what `models.decoder.forward` reads), their shapes, the HF
conversion table and random init.

Stored params (`Params`), a plain dict, every layer weight stacked over layers (leading axis L):

params = {
  "embed_tokens": [vocab, hidden],
  "layers": {
    "input_layernorm": [L, hidden], "post_attention_layernorm": [L, hidden],
    "pre_feedforward_layernorm"? / "post_feedforward_layernorm"?: [L, hidden],   # sandwich_norms
    "q_norm"? / "k_norm"?: [L, hd],                                              # qk_norm
    "q_proj": {"kernel": [L, hidden, heads*hd], "bias"?: [L, heads*hd]},  # bias: attention_bias or qkv_bias
    "k_proj" / "v_proj": {"kernel": [L, hidden, kv_heads*hd], "bias"?: [L, kv_heads*hd]},
    "o_proj": {"kernel": [L, heads*hd, hidden], "bias"?: [L, hidden]},
    "gate_proj" / "up_proj": {"kernel": [L, hidden, inter], "bias"?: [L, inter]},
    "down_proj": {"kernel": [L, inter, hidden], "bias"?: [L, hidden]},
  },
  "norm": [hidden],
  "lm_head"?: [hidden, vocab],              # absent when embeddings are tied
}
Kernels are `[in, out]` (HF's `[out, in]` transposed). A quantized model's kernels and head are
weight types of `minivllm_jax.ops.quantization` in the same places.

`unstack_layers` turns them, once, at load, into `ServingParams`: one tree per layer (a tuple),
with the projections that read the same input merged ("qkv_proj", "gate_up_proj": one bigger
dot instead of two or three small ones) and quantized weights laid out for the native kernels.
The decoder runs each layer's matmuls in that layer's branch of a `lax.switch`, which reads its
weights in place; slicing layer `i` out of a stacked array inside the layer loop would make XLA
copy every weight once per step. The two are different types, so each function says which it
takes and nothing converts "just in case".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from minivllm_jax.config import ModelConfig
from minivllm_jax.models.registry import layer_weight_names
from minivllm_jax.ops.quantization import serving_layout

Params = dict[str, Any]  # stored params (the module docstring)

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ServingParams:
    """Params as the decoder reads them (`unstack_layers`): `layers` one dict per layer, with
    "qkv_proj" and "gate_up_proj" merged; `lm_head` None when embeddings are tied."""

    embed_tokens: Any
    layers: tuple[Params, ...]
    norm: jax.Array
    lm_head: Any = None


def _has_bias(cfg: ModelConfig, name: str) -> bool:
    if name in _MLP:
        return cfg.mlp_bias
    return cfg.attention_bias or (cfg.qkv_bias and name != "o_proj")


def _proj_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    d, q, kv, f = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }


def param_shapes(cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """The abstract params tree (`ShapeDtypeStruct` leaves): drives init, conversion checks and restore."""
    L, d = cfg.num_layers, cfg.hidden_size
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))  # noqa: E731
    layers: dict[str, Any] = {"input_layernorm": sds(L, d), "post_attention_layernorm": sds(L, d)}
    if cfg.sandwich_norms:
        layers["pre_feedforward_layernorm"] = layers["post_feedforward_layernorm"] = sds(L, d)
    if cfg.qk_norm:
        layers["q_norm"] = layers["k_norm"] = sds(L, cfg.head_dim)
    for name, (din, dout) in _proj_dims(cfg).items():
        layers[name] = {"kernel": sds(L, din, dout)}
        if _has_bias(cfg, name):
            layers[name]["bias"] = sds(L, dout)
    params: Params = {"embed_tokens": sds(cfg.vocab_size, d), "layers": layers, "norm": sds(d)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = sds(d, cfg.vocab_size)
    return params


def hf_weight_map(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], int | None, bool]]:
    """HF tensor name -> (path in our tree, layer index or None, transpose?). The strict conversion table."""
    table: dict[str, tuple[tuple[str, ...], int | None, bool]] = {
        "model.embed_tokens.weight": (("embed_tokens",), None, False),
        "model.norm.weight": (("norm",), None, False),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head",), None, True)
    shapes = param_shapes(cfg)["layers"]
    modules = layer_weight_names(cfg)  # the norms' HF names, the family's own included
    norms = [key for key, leaf in shapes.items() if not isinstance(leaf, dict)]
    unnamed = [key for key in norms if key not in modules]
    if unnamed:
        raise ValueError(f"family {cfg.family!r} gives no HF name for the layer weights {unnamed}")
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for key in norms:
            table[f"{pre}{modules[key]}.weight"] = (("layers", key), i, False)
        for name in _ATTN + _MLP:
            module = ("self_attn." if name in _ATTN else "mlp.") + name
            table[f"{pre}{module}.weight"] = (("layers", name, "kernel"), i, True)
            if "bias" in shapes[name]:
                table[f"{pre}{module}.bias"] = (("layers", name, "bias"), i, False)
    return table


def init_params(
    cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, scale: float = 0.02
) -> Params:
    """Random params with the right tree (tests and benchmarks; real weights come from convert/)."""
    shapes = param_shapes(cfg, dtype)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        treedef,
        [
            (scale * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype)
            for k, s in zip(keys, leaves)
        ],
    )


def model_dtype(params: Params | ServingParams) -> jnp.dtype:
    """The model's float dtype (activations, KV cache): the final norm's, which no
    quantization changes (the first leaf may be a quantized embedding)."""
    return (params.norm if isinstance(params, ServingParams) else params["norm"]).dtype


def unstack_layers(params: Params) -> ServingParams:
    """Stored params as `ServingParams` (the module docstring). The weights are copied: drop the
    stored params afterwards so they are held once."""
    if isinstance(params, ServingParams) or not isinstance(params.get("layers"), dict):
        raise TypeError("unstack_layers takes stored params (layers stacked), not serving params")
    layers = params["layers"]

    def layer(i: int) -> Params:
        lp = dict(jax.tree.map(lambda a: a[i], layers))
        for name, parts in _MERGED.items():
            projections = [lp.pop(part) for part in parts]
            lp[name] = {  # a quantized kernel's arrays all have `out` last
                key: jax.tree.map(
                    lambda *parts: jnp.concatenate(parts, axis=-1), *[p[key] for p in projections]
                )
                for key in projections[0]
            }
        return lp

    per_layer = tuple(layer(i) for i in range(jax.tree.leaves(layers)[0].shape[0]))
    # Quantized weights are laid out for the native matmul once merged (`serving_layout`).
    served = serving_layout({**params, "layers": per_layer})
    return ServingParams(
        embed_tokens=served["embed_tokens"],
        layers=served["layers"],
        norm=served["norm"],
        lm_head=served.get("lm_head"),
    )
