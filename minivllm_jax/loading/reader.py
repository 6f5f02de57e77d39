"""Read a checkpoint into our params pytree, strictly through `hf_weight_map` (the table of the
family that config.json's architecture names: `minivllm_jax.models.registry`).

Every tensor in the file must map to exactly one slot of the tree and every slot must be
filled, with the shape the config implies. The tree is allocated once in the target dtype and
filled one tensor at a time, so peak memory stays about one model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from minivllm_jax.config import ModelConfig, UnsupportedModelError
from minivllm_jax.loading.errors import (
    CheckpointNotFoundError,
    ConversionError,
    CorruptCheckpointError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
    WeightMismatchError,
)
from minivllm_jax.loading.gguf_source import open_gguf
from minivllm_jax.loading.safetensors_source import open_hf_folder
from minivllm_jax.loading.source import Source, TensorEntry
from minivllm_jax.models.hf_config import config_from_hf
from minivllm_jax.models.params import hf_weight_map, param_shapes

DTYPES = ("float32", "bfloat16", "float16")
EXPECTED = (
    "an HF save_pretrained folder (config.json + model.safetensors or sharded) or a .gguf file"
)


def check_dtype(dtype: Any) -> np.dtype:
    name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ConversionError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return np.dtype(jnp.dtype(name))


def model_config(hf_config: dict[str, Any]) -> ModelConfig:
    """`config_from_hf` with its failures turned into conversion errors."""
    try:
        return config_from_hf(hf_config)
    except UnsupportedModelError as e:
        raise UnsupportedArchitectureError(str(e)) from e
    except KeyError as e:
        raise ConversionError(f"config.json lacks the required key {e}") from e
    except (TypeError, ValueError) as e:
        raise ConversionError(f"config.json has a bad value: {e}") from e


@contextlib.contextmanager
def open_source(src: Path) -> Iterator[Source]:
    if not src.exists():
        raise CheckpointNotFoundError(f"{src} does not exist; expected {EXPECTED}")
    if src.is_dir():
        opener = open_hf_folder
    elif src.suffix.lower() == ".gguf":
        opener = open_gguf
    else:
        raise CheckpointNotFoundError(f"{src} is a file but not a .gguf; expected {EXPECTED}")
    with opener(src) as source:
        yield source


def read_checkpoint(
    src: str | Path, dtype: Any = "float32", progress: bool = True
) -> tuple[dict[str, Any], Any]:
    """Return `(hf_config, params)`: the HF config dict and our params tree as numpy arrays."""
    np_dtype = check_dtype(dtype)
    with open_source(Path(src)) as source:
        cfg = model_config(source.hf_config)
        params = _assemble(cfg, source.entries, np_dtype, progress)
    return source.hf_config, params


def _is_harmless(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # derived buffer some old checkpoints saved


def _hf_shape(leaf_shape: tuple[int, ...], layer: int | None, transpose: bool) -> tuple[int, ...]:
    shape = leaf_shape[1:] if layer is not None else leaf_shape
    return tuple(reversed(shape)) if transpose else tuple(shape)


def _listing(names: list[str], limit: int = 5) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_names(
    cfg: ModelConfig, entries: list[TensorEntry], table: dict
) -> dict[str, TensorEntry]:
    by_name: dict[str, TensorEntry] = {}
    for e in entries:
        if e.name in by_name:
            raise WeightMismatchError(
                f"duplicate tensor {e.name}: in {by_name[e.name].origin} and {e.origin}"
            )
        by_name[e.name] = e
    tied_head = ["lm_head.weight"] if cfg.tie_word_embeddings else []
    unexpected = [
        n for n in by_name if n not in table and not _is_harmless(n) and n not in tied_head
    ]
    if unexpected:
        raise WeightMismatchError(
            f"unexpected tensors not in the {cfg.family} conversion table: {_listing(unexpected)}"
        )
    missing = [n for n in table if n not in by_name]
    if missing:
        raise WeightMismatchError(f"missing tensors: {_listing(missing)}")
    return by_name


def _assemble(
    cfg: ModelConfig, entries: list[TensorEntry], np_dtype: np.dtype, progress: bool
) -> Any:
    table = hf_weight_map(cfg)
    by_name = _check_names(cfg, entries, table)
    shapes = param_shapes(cfg)

    def leaf(tree: Any, path: tuple[str, ...]) -> Any:
        for key in path:
            tree = tree[key]
        return tree

    for name, (path, layer, transpose) in table.items():
        expected = _hf_shape(leaf(shapes, path).shape, layer, transpose)
        if by_name[name].shape != expected:
            raise ShapeMismatchError(
                f"{by_name[name].origin}: shape {list(by_name[name].shape)}, expected {list(expected)} from config.json"
            )

    params = jax.tree.map(lambda s: np.empty(s.shape, np_dtype), shapes)
    todo = [e for e in entries if e.name in table]  # file order: sequential reads
    for e in tqdm(todo, desc="reading tensors", unit="tensor", disable=not progress, leave=False):
        path, layer, transpose = table[e.name]
        value = e.load()
        if value.shape != e.shape:
            raise CorruptCheckpointError(
                f"{e.origin}: data has shape {list(value.shape)}, header says {list(e.shape)}"
            )
        dst = leaf(params, path)
        dst[... if layer is None else layer] = value.T if transpose else value

    if cfg.tie_word_embeddings and "lm_head.weight" in by_name:
        head = by_name["lm_head.weight"]
        if head.shape != params["embed_tokens"].shape or not np.array_equal(
            head.load().astype(np_dtype), params["embed_tokens"]
        ):
            raise WeightMismatchError(
                f"{head.origin}: config ties embeddings but lm_head.weight differs from them"
            )
    return params
