"""HF `config.json` -> `ModelConfig`: the fields every family reads alike (`decoder_fields`), the
helpers families use for theirs, and `config_from_hf`, which asks the registry for the family
its architecture names (`minivllm_jax.models.registry`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from minivllm_jax.config import ModelConfig, RopeScaling, UnsupportedModelError
from minivllm_jax.models.registry import family_for_hf

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF `layer_types` values


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Build from a `config.json` dict (transformers 4.x or 5.x layout) by the family that its
    architecture names; `UnsupportedModelError` otherwise."""
    family = family_for_hf(hf)
    return dataclasses.replace(family.config_from_hf(hf), family=family.name)


def parse_rope(rope: dict[str, Any], default_theta: float) -> tuple[float, RopeScaling | None]:
    """`(rope_theta, rope_scaling)` from an HF RoPE dict (`rope_parameters`, or 4.x's `rope_scaling`)."""
    rope = dict(rope)
    theta = float(rope.pop("rope_theta", default_theta))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    return theta, (
        rope_type,
        tuple(sorted((k, float(v)) for k, v in rope.items() if isinstance(v, (int, float)))),
    )


def check_activation(hf: dict[str, Any], allowed: tuple[str, ...]) -> str:
    """The MLP activation (`hidden_activation` in Gemma configs, else `hidden_act`), if implemented."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or allowed[0]
    if act not in allowed:
        raise UnsupportedModelError(
            f"unsupported hidden_act {act!r}; supported here: {', '.join(allowed)}"
        )
    return act


def layer_windows(
    hf: dict[str, Any], window: int | None, default_types: list[str]
) -> tuple[int, ...]:
    """Per-layer windows from HF `layer_types` (`default_types`, the family's own rule, when the
    config has none): `window` on "sliding_attention" layers, 0 on the others; () if none slides."""
    types = hf.get("layer_types") or default_types
    if len(types) != hf["num_hidden_layers"] or not set(types) <= set(LAYER_TYPES):
        raise UnsupportedModelError(
            f"layer_types must name one of {LAYER_TYPES} per layer "
            f"({hf['num_hidden_layers']}), got {types}"
        )
    if not window or "sliding_attention" not in types:
        return ()
    if int(window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def decoder_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields every family reads alike (sizes, RoPE, norms' eps, special
    tokens), from a `config.json` dict of transformers 4.x or 5.x; families add their own."""
    num_heads = hf["num_attention_heads"]
    # transformers 5 moved rope_theta (and the scaling dict) into `rope_parameters`.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_theta, rope_scaling = parse_rope(rope, hf.get("rope_theta", 10000.0))
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
