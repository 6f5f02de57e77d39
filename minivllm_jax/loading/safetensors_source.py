"""HF `save_pretrained` folders: config.json plus one model.safetensors or index-listed shards."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can return bf16 arrays)
from safetensors import SafetensorError, safe_open

from minivllm_jax.loading.errors import (
    CheckpointNotFoundError,
    ConversionError,
    CorruptCheckpointError,
)
from minivllm_jax.loading.source import Source, TensorEntry

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointNotFoundError(f"missing {path.name} in {path.parent}")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON: {e}") from e


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights, checked to exist."""
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if (folder / INDEX).is_file():
        weight_map = read_json(folder / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptCheckpointError(f"{folder / INDEX} has no 'weight_map'")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointNotFoundError(
                    f"shard {f.name} listed in {INDEX} is missing from {folder}"
                )
        return files
    found = sorted(p.name for p in folder.iterdir())[:10]
    hint = (
        " (PyTorch .bin checkpoints are not supported; re-save with safetensors)"
        if any(n.endswith(".bin") for n in found)
        else ""
    )
    raise CheckpointNotFoundError(
        f"{folder} has no {SINGLE} or {INDEX}{hint}; found: {', '.join(found) or 'nothing'}"
    )


@contextlib.contextmanager
def open_hf_folder(folder: Path) -> Iterator[Source]:
    """Open every shard lazily (memory-mapped); tensors are read one at a time by `entry.load()`."""
    hf_config = read_json(folder / "config.json")
    files = shard_files(folder)
    with contextlib.ExitStack() as stack:
        entries = []
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="numpy"))
                names = list(handle.keys())
                shapes = [tuple(handle.get_slice(n).get_shape()) for n in names]
            except (SafetensorError, OSError, ValueError) as e:
                raise CorruptCheckpointError(
                    f"{path} is not a readable safetensors file (truncated?): {e}"
                ) from e
            for name, shape in zip(names, shapes):
                entries.append(
                    TensorEntry(name, shape, _loader(handle, name, path), f"{path.name}:{name}")
                )
        yield Source(hf_config, entries)


def _loader(handle, name: str, path: Path):
    def load():
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            raise ConversionError(f"{path.name}: cannot read tensor {name}: {e}") from e

    return load
