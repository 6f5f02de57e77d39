"""Model families: HF architecture name (`architectures[0]`, else `model_type`) -> the family
that maps its `config.json` to a `ModelConfig` and names its extra tensors.

Every family runs the one decoder in `models/decoder.py`; a family is what it changes there,
as `ModelConfig` fields (biases, q/k norms, sliding windows, soft-capping, ...). Adding one:
write `models/<name>.py` with a `FAMILY = ModelFamily(...)` (its `config_from_hf` and, for
tensors Llama does not have, their HF names) and add `<name>` to `FAMILY_MODULES`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

from minivllm_jax.config import ModelConfig, UnsupportedModelError

# Llama first: it is the default, and the first one error messages name.
FAMILY_MODULES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")

# Our per-layer leaves that are not projections (norm weights) -> their HF module under
# `model.layers.{i}.`. Families add theirs with `ModelFamily.layer_weights`.
LLAMA_LAYER_WEIGHTS = (
    ("input_layernorm", "input_layernorm"),
    ("post_attention_layernorm", "post_attention_layernorm"),
)


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str  # ModelConfig.family
    architectures: tuple[str, ...]  # HF `architectures` entries
    model_types: tuple[str, ...]  # HF `model_type` values (a config without architectures)
    config_from_hf: Callable[
        [dict[str, Any]], ModelConfig
    ]  # sets the family's fields; `hf_config.decoder_fields` does the rest
    layer_weights: tuple[tuple[str, str], ...] = ()  # extra per-layer (our key, HF module) pairs


@functools.cache
def families() -> tuple[ModelFamily, ...]:
    """Every registered family, in `FAMILY_MODULES` order (imported on first use: the family
    modules import `models.hf_config`, which asks this module for them)."""
    return tuple(
        importlib.import_module(f"minivllm_jax.models.{name}").FAMILY for name in FAMILY_MODULES
    )


def supported_architectures() -> tuple[str, ...]:
    return tuple(arch for family in families() for arch in family.architectures)


def get_family(name: str) -> ModelFamily:
    for family in families():
        if family.name == name:
            return family
    raise UnsupportedModelError(
        f"unknown model family {name!r}; known: {', '.join(f.name for f in families())}"
    )


def family_for_hf(hf: dict[str, Any]) -> ModelFamily:
    """The family of an HF config dict: by its first known architecture, else its model_type."""
    archs = tuple(hf.get("architectures") or ())
    for arch in archs:
        for family in families():
            if arch in family.architectures:
                return family
    model_type = hf.get("model_type")
    for family in families():
        if model_type in family.model_types:
            return family
    model_types = ", ".join(repr(t) for f in families() for t in f.model_types)
    raise UnsupportedModelError(
        f"unsupported architecture {archs or model_type!r}; supported: "
        f"{', '.join(supported_architectures())} (model_type {model_types})"
    )


def layer_weight_names(cfg: ModelConfig) -> dict[str, str]:
    """Our per-layer norm keys -> HF module names, for `cfg`'s family (`params.hf_weight_map`)."""
    return dict(LLAMA_LAYER_WEIGHTS + get_family(cfg.family).layer_weights)
