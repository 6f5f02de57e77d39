"""Llama: the decoder's defaults (`models/decoder.py`), so its family only names itself and
reads its two biases from the HF config."""

from __future__ import annotations

from typing import Any

from minivllm_jax.config import ModelConfig
from minivllm_jax.models.hf_config import check_activation, decoder_fields
from minivllm_jax.models.registry import ModelFamily


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Llama's `ModelConfig` from its HF config dict."""
    check_activation(hf, ("silu",))
    return ModelConfig(
        **decoder_fields(hf),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


FAMILY = ModelFamily("llama", ("LlamaForCausalLM",), ("llama",), config_from_hf)
