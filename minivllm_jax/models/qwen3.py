"""Qwen3 (dense): Llama with an RMSNorm over head_dim on each query and key head before RoPE,
an explicit `head_dim`, and Qwen2's optional sliding windows."""

from __future__ import annotations

from typing import Any

from minivllm_jax.config import ModelConfig
from minivllm_jax.models.hf_config import check_activation, decoder_fields
from minivllm_jax.models.qwen2 import qwen_layer_windows
from minivllm_jax.models.registry import ModelFamily


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    check_activation(hf, ("silu",))
    return ModelConfig(
        **decoder_fields(hf),
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        layer_windows=qwen_layer_windows(hf),
    )


FAMILY = ModelFamily(
    "qwen3",
    ("Qwen3ForCausalLM",),
    ("qwen3",),
    config_from_hf,
    layer_weights=(("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm")),
)
