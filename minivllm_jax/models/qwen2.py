"""Qwen2 and Qwen2.5: Llama with biases on q, k and v (none on o_proj), and sliding windows on
the layers from `max_window_layers` on when `use_sliding_window` is set."""

from __future__ import annotations

from typing import Any

from minivllm_jax.config import ModelConfig
from minivllm_jax.models.hf_config import check_activation, decoder_fields, layer_windows
from minivllm_jax.models.registry import ModelFamily


def qwen_layer_windows(hf: dict[str, Any]) -> tuple[int, ...]:
    """Qwen's rule (also Qwen3's): `layer_types` if given, else the layers from
    `max_window_layers` on slide; only with `use_sliding_window`."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    first = hf.get("max_window_layers", 28)
    default = [
        "sliding_attention" if i >= first else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    return layer_windows(hf, window, default)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    check_activation(hf, ("silu",))
    return ModelConfig(**decoder_fields(hf), qkv_bias=True, layer_windows=qwen_layer_windows(hf))


FAMILY = ModelFamily("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), config_from_hf)
