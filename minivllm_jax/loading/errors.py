"""Conversion errors: one base class, so callers (the CLI, `LLM`) catch one thing and print it."""

from __future__ import annotations

from minivllm_jax.config import UnsupportedModelError


class ConversionError(Exception):
    """A checkpoint could not be converted; the message says what was expected and what was found."""


class CheckpointNotFoundError(ConversionError, FileNotFoundError):
    """The source path, a file it needs (config.json, a shard) or a model package is missing."""


class UnsupportedArchitectureError(ConversionError, UnsupportedModelError):
    """The checkpoint is not a model family we implement (also an `UnsupportedModelError`)."""


class WeightMismatchError(ConversionError):
    """Tensors missing, unexpected or duplicated with respect to the strict conversion table."""


class ShapeMismatchError(WeightMismatchError):
    """A tensor's shape differs from the one the config implies."""


class CorruptCheckpointError(ConversionError):
    """A file is truncated or not in the format its name claims."""


class OutputExistsError(ConversionError, FileExistsError):
    """The output directory exists and is not empty (pass `overwrite=True` to replace it)."""
