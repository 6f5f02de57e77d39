"""Mistral: Llama with sliding-window attention on every layer when `sliding_window` is set
(HF's Mistral ignores `layer_types`)."""

from __future__ import annotations

from typing import Any

from minivllm_jax.config import ModelConfig
from minivllm_jax.models.hf_config import check_activation, decoder_fields, layer_windows
from minivllm_jax.models.registry import ModelFamily


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    check_activation(hf, ("silu",))
    every = ["sliding_attention"] * hf["num_hidden_layers"]
    windows = layer_windows({**hf, "layer_types": None}, hf.get("sliding_window"), every)
    return ModelConfig(**decoder_fields(hf), layer_windows=windows)


FAMILY = ModelFamily("mistral", ("MistralForCausalLM",), ("mistral",), config_from_hf)
