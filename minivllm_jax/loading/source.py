"""What a checkpoint reader yields: the HF config and lazily loadable tensors under their HF names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor, known by name and shape before any of its data is read (so checks fail fast)."""

    name: str  # HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
    shape: tuple[int, ...]  # HF layout ([out, in] for linear weights)
    load: Callable[[], np.ndarray]
    origin: str  # file (and name inside it) for error messages


@dataclasses.dataclass
class Source:
    hf_config: dict[str, Any]
    entries: list[TensorEntry]
