"""Quantizing a model as it loads or converts: a scheme applied to its float weights
(`minivllm_jax.ops.quantization`), or a GGUF's own 4-bit blocks taken as they are ("gguf")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minivllm_jax.loading.aliases import MODEL_ALIASES, alias_source
from minivllm_jax.loading.gguf_source import read_int4_projections
from minivllm_jax.ops.quantization import (
    LLM_QUANTIZATIONS,
    quantize_head,
    quantize_params,
    with_int4_projections,
)


def gguf_source_of(model: str | Path) -> Path:
    """The GGUF file behind `model` (an alias of a shipped GGUF, or a .gguf path), for
    quantization='gguf'; anything else is a ValueError saying what to use."""
    path = alias_source(str(model)) if str(model) in MODEL_ALIASES else Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(
            f"quantization='gguf' serves a GGUF file's own 4-bit blocks; {str(model)!r} is not a GGUF "
            "model (an alias of one or a .gguf path): use quantization='int4' or 'int8'"
        )
    return path


def quantize_model_params(
    params: dict[str, Any],
    scheme: str | None,
    source: str | Path,
    num_layers: int,
    group_size: int = 32,
) -> dict[str, Any]:
    """Stacked float params of the model read from `source` with its projections quantized by
    `scheme` (one of `LLM_QUANTIZATIONS`, or None: unchanged)."""
    if scheme is not None and scheme not in LLM_QUANTIZATIONS:
        raise ValueError(f"unknown quantization {scheme!r}; use one of {LLM_QUANTIZATIONS} or None")
    if scheme == "gguf":
        return quantize_head(
            with_int4_projections(params, read_int4_projections(gguf_source_of(source), num_layers))
        )
    return quantize_params(params, scheme, group_size)
