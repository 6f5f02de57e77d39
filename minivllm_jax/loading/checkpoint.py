"""Params on disk: an orbax checkpoint, restored against `param_shapes` so tree and shapes are checked.

orbax is imported where a checkpoint is read or written, not with the package: it is a heavy
import (tensorstore and friends) that `import minivllm_jax` and the server's CLI need not pay.

A converted model directory holds the HF `config.json`, the tokenizer files and `params/`. A
quantized one (`minivllm-convert --quantize`) records its scheme in config.json
(`quantization.CHECKPOINT_KEY`) and stores the projections as their quantized arrays.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from minivllm_jax.config import ModelConfig
from minivllm_jax.models.hf_config import config_from_hf
from minivllm_jax.models.params import Params, param_shapes
from minivllm_jax.ops.quantization import (
    CHECKPOINT_KEY,
    Int4Weight,
    Int8Weight,
    W8A8Weight,
    is_quantized,
    quantized_shapes,
)

# A quantized weight's arrays on disk, beside its projection's other leaves (a bias): the key of
# its packed values, which says the scheme, and its scales (int4: scales and minimums apart).
DISK_NAMES = {Int8Weight: "qweight", Int4Weight: "qweight4", W8A8Weight: "qweight_a8"}
_WEIGHT_TYPES = {name: cls for cls, name in DISK_NAMES.items()}
HEAD_NAMES = ("embed_tokens", "lm_head")

if TYPE_CHECKING:
    import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A converted directory or params checkpoint is missing or does not match the config."""


def is_converted_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and (path / "params").is_dir()


def _split(a: Any, index: int) -> Any:
    """`a[..., index, :]`, also of a `ShapeDtypeStruct`."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((*a.shape[:-2], a.shape[-1]), a.dtype)
    return a[..., index, :]


def _weight_to_disk(w: Any) -> dict[str, Any]:
    if isinstance(w, Int4Weight):
        sm = w.scales_mins
        return {"qweight4": w.q, "scales": _split(sm, 0), "mins": _split(sm, 1)}
    return {DISK_NAMES[type(w)]: w.q, "scales": w.scales}


def _weight_from_disk(arrays: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The weight stored in `arrays` and the leaves beside it."""
    (name,) = _WEIGHT_TYPES.keys() & arrays.keys()
    rest = {k: v for k, v in arrays.items() if k not in (name, "scales", "mins")}
    if name == "qweight4":
        sm = jnp.stack([jnp.asarray(arrays["scales"]), jnp.asarray(arrays["mins"])], axis=-2)
        return Int4Weight(arrays[name], sm), rest
    return _WEIGHT_TYPES[name](arrays[name], arrays["scales"]), rest


def to_disk(params: Params) -> dict[str, Any]:
    """Stacked params as orbax stores them: plain nested dicts of arrays (or of
    `ShapeDtypeStruct`s), each quantized weight under `DISK_NAMES`."""
    layers = {
        name: {**_weight_to_disk(v["kernel"]), **{k: b for k, b in v.items() if k != "kernel"}}
        if isinstance(v, dict) and is_quantized(v.get("kernel"))
        else v
        for name, v in params["layers"].items()
    }
    heads = {
        name: _weight_to_disk(params[name]) for name in HEAD_NAMES if is_quantized(params.get(name))
    }
    return {**params, "layers": layers, **heads}


def from_disk(tree: dict[str, Any]) -> Params:
    """Inverse of `to_disk`: the weight types back in their places."""

    def projection(v: Any) -> Any:
        if not (isinstance(v, dict) and _WEIGHT_TYPES.keys() & v.keys()):
            return v
        weight, rest = _weight_from_disk(v)
        return {"kernel": weight, **rest}

    heads = {
        name: _weight_from_disk(tree[name])[0]
        for name in HEAD_NAMES
        if isinstance(tree.get(name), dict)
    }
    return {**tree, "layers": {k: projection(v) for k, v in tree["layers"].items()}, **heads}


def save_params(path: str | Path, params: Params) -> None:
    """Write `params` (numpy or jax arrays) to a new orbax checkpoint directory at `path`.

    Saved synchronously from host arrays without orbax's default defensive copy, so converting
    a model never holds it twice in memory.
    """
    import orbax.checkpoint as ocp  # heavy: see the module docstring

    host = jax.tree.map(np.asarray, to_disk(params))
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False))
    )
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry)) as ckptr:
        ckptr.save(Path(path).absolute(), args=ocp.args.PyTreeSave(host))


def _saved_leaves(ckptr: ocp.StandardCheckpointer, path: Path) -> dict[str, Any]:
    try:
        tree = ckptr.metadata(path).item_metadata.tree
    except Exception as e:  # orbax raises assorted types for a missing or damaged directory
        raise CheckpointError(f"{path} is not a readable params checkpoint: {e}") from e
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def load_params(
    path: str | Path, cfg: ModelConfig, dtype: Any = None, quantization: dict | None = None
) -> Params:
    """Restore params as jax arrays in `dtype` (default: as saved), checking tree and shapes first;
    `quantization` (a checkpoint's recorded scheme) gives the projections their quantized tree.

    Orbax would silently restore a saved shape that differs from the target, so we compare the
    on-disk metadata with `param_shapes(cfg)` ourselves.
    """
    import orbax.checkpoint as ocp  # heavy: see the module docstring

    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        saved = _saved_leaves(ckptr, path)
        if dtype is None:
            dtype = next(iter(saved.values())).dtype
        target = param_shapes(cfg, dtype)
        if quantization is not None:
            target = to_disk(
                quantized_shapes(target, quantization["scheme"], quantization.get("group_size", 32))
            )
        wanted = {
            jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(target)[0]
        }
        if saved.keys() != wanted.keys():
            diff = sorted(saved.keys() ^ wanted.keys())
            raise CheckpointError(
                f"{path}: params tree does not match the config; differing leaves: {diff[:5]}"
            )
        for key, want in wanted.items():
            if tuple(saved[key].shape) != want.shape:
                raise CheckpointError(
                    f"{path}: {key} has shape {saved[key].shape}, config implies {want.shape}"
                )
        device = jax.sharding.SingleDeviceSharding(
            jax.local_devices()[0]
        )  # this process's (several may load)
        abstract = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), target
        )
        return from_disk(ckptr.restore(path, abstract))


def load_converted(
    path: str | Path, dtype: Any = None
) -> tuple[ModelConfig, dict[str, Any], Params]:
    """Load a `minivllm-convert` output dir: `(ModelConfig, hf_config_dict, params)`; a quantized
    one comes back quantized (its scheme is `hf_config_dict[quantization.CHECKPOINT_KEY]`)."""
    path = Path(path)
    if not is_converted_dir(path):
        raise CheckpointError(
            f"{path} is not a converted model: expected config.json and params/ (run minivllm-convert)"
        )
    hf_config = json.loads((path / "config.json").read_text())
    cfg = config_from_hf(hf_config)
    dtype = None if dtype is None else jnp.dtype(dtype)
    return cfg, hf_config, load_params(path / "params", cfg, dtype, hf_config.get(CHECKPOINT_KEY))
