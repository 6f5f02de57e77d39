"""Checkpoint conversion: HF safetensors folders and llama.cpp GGUF files -> our params pytree."""

from minivllm_jax.loading.aliases import MODEL_ALIASES
from minivllm_jax.loading.errors import (
    CheckpointNotFoundError,
    ConversionError,
    CorruptCheckpointError,
    OutputExistsError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
    WeightMismatchError,
)
from minivllm_jax.loading.reader import read_checkpoint
from minivllm_jax.loading.resolve import resolve_model
from minivllm_jax.loading.writer import convert_checkpoint

__all__ = [
    "MODEL_ALIASES",
    "CheckpointNotFoundError",
    "ConversionError",
    "CorruptCheckpointError",
    "OutputExistsError",
    "ShapeMismatchError",
    "UnsupportedArchitectureError",
    "WeightMismatchError",
    "convert_checkpoint",
    "read_checkpoint",
    "resolve_model",
]
