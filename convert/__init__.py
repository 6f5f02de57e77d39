"""Checkpoint conversion: HF safetensors folders and llama.cpp GGUF files -> our params pytree."""

from convert.errors import (
    CheckpointNotFoundError,
    ConversionError,
    CorruptCheckpointError,
    OutputExistsError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
    WeightMismatchError,
)
from convert.reader import read_checkpoint
from convert.resolve import MODEL_ALIASES, resolve_model
from convert.writer import convert_checkpoint

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
