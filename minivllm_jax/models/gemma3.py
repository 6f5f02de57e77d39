"""Gemma 3 (text, `Gemma3ForCausalLM`): Gemma 2's layer (without attention soft-capping, which
HF's Gemma 3 never applies) plus q/k norms, and five local (sliding-window) layers to one
global: local layers rotate by `rope_local_base_freq` unscaled, global ones by `rope_theta`
with its scaling, if any."""

from __future__ import annotations

from typing import Any

from minivllm_jax.config import ModelConfig, UnsupportedModelError
from minivllm_jax.models.gemma2 import SANDWICH_NORMS, gemma_fields, hf_value
from minivllm_jax.models.hf_config import decoder_fields, layer_windows, parse_rope
from minivllm_jax.models.registry import ModelFamily


def rope_by_layer_type(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) RoPE dicts with their bases: transformers 5 keys `rope_parameters` by
    layer type; 4.x has `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq`."""
    rope = hf.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        global_rope, local_rope = (
            dict(rope.get("full_attention") or {}),
            dict(rope.get("sliding_attention") or {}),
        )
    else:
        global_rope, local_rope = dict(rope or hf.get("rope_scaling") or {}), {}
    global_rope.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local_rope.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    return global_rope, local_rope


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    global_rope, local_rope = rope_by_layer_type(hf)
    local_theta, local_scaling = parse_rope(local_rope, 10_000.0)
    if local_scaling is not None:
        raise UnsupportedModelError(
            f"scaled RoPE on Gemma 3's local layers is not supported: {local_rope}"
        )
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    default = [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    return ModelConfig(
        **{**decoder_fields({**hf, "rope_parameters": global_rope}), **gemma_fields(hf)},
        qk_norm=True,
        local_rope_theta=local_theta,
        layer_windows=layer_windows(hf, hf_value(hf, "sliding_window", 4096), default),
    )


QK_NORMS = (("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm"))
FAMILY = ModelFamily(
    "gemma3",
    ("Gemma3ForCausalLM",),
    ("gemma3_text",),
    config_from_hf,
    layer_weights=QK_NORMS + SANDWICH_NORMS,
)
