"""Gemma 2: embeddings scaled by sqrt(hidden), RMSNorm by (1 + w), GeGLU (tanh GELU), norms
before and after both attention and MLP, attention scale `query_pre_attn_scalar ** -0.5`,
attention and final logit soft-capping, and local (sliding) / global layers alternating."""

from __future__ import annotations

from typing import Any

from minivllm_jax.config import ModelConfig, UnsupportedModelError
from minivllm_jax.models.hf_config import check_activation, decoder_fields, layer_windows
from minivllm_jax.models.registry import ModelFamily


def hf_value(hf: dict[str, Any], key: str, default: Any) -> Any:
    """`hf[key]`, or HF's class default when the config omits it (a null stays None)."""
    return hf[key] if key in hf else default


def gemma_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share, with HF's defaults for keys a config omits."""
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            "bidirectional attention (use_bidirectional_attention) is not supported"
        )
    final_cap = hf_value(hf, "final_logit_softcapping", None)
    return dict(
        head_dim=hf_value(hf, "head_dim", 256),
        tie_word_embeddings=bool(hf_value(hf, "tie_word_embeddings", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
        norm_weight_offset=1.0,
        embedding_scale=hf["hidden_size"] ** 0.5,
        hidden_act=check_activation(hf, ("gelu_pytorch_tanh",)),
        sandwich_norms=True,
        query_pre_attn_scalar=float(hf_value(hf, "query_pre_attn_scalar", 256)),
        final_logit_softcap=None if final_cap is None else float(final_cap),
    )


SANDWICH_NORMS = (
    ("pre_feedforward_layernorm", "pre_feedforward_layernorm"),
    ("post_feedforward_layernorm", "post_feedforward_layernorm"),
)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf = {
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        **hf,
    }  # Gemma 2's defaults
    attn_cap = hf["attn_logit_softcapping"]
    default = [
        "sliding_attention" if (i + 1) % 2 else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    return ModelConfig(
        **{**decoder_fields(hf), **gemma_fields(hf)},
        attn_logit_softcap=None if attn_cap is None else float(attn_cap),
        layer_windows=layer_windows(hf, hf_value(hf, "sliding_window", 4096), default),
    )


FAMILY = ModelFamily(
    "gemma2", ("Gemma2ForCausalLM",), ("gemma2",), config_from_hf, layer_weights=SANDWICH_NORMS
)
