"""llama.cpp GGUF files: dequantized to float, renamed to HF names, Q/K rows un-permuted.

llama.cpp's converter interleaves the rows of each Q/K head for its RoPE kernel; HF's
rotate-half RoPE (and ours) expects the original order, so that permutation is undone here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from minivllm_jax.loading.errors import (
    ConversionError,
    CorruptCheckpointError,
    UnsupportedArchitectureError,
)
from minivllm_jax.loading.source import Source, TensorEntry
from minivllm_jax.ops.quantization import Int4Weight, int4_weight, pack_int4

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
# GGML block types whose values are our int4 layout exactly (`minivllm_jax.ops.quantization`):
# 32 values a block with a float16 scale and minimum (Q4_0: minimum = -8 * scale).
INT4_BLOCK_TYPES = ("Q4_0", "Q4_1")
_BLOCK_VALUES = 32
_PROJECTIONS = {name.split(".")[1] for name in _BLOCK.values() if "proj" in name}


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names keep a
    `gguf:` prefix so the strict table reports them as unexpected."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{suffix}"
    return f"gguf:{gguf_name}"


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's per-head row permutation (`[h, 2, d/2] -> [h, d/2, 2]` on rows)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise CorruptCheckpointError("GGUF file has no general.architecture metadata")
    return str(field.contents())


def gguf_hf_config(path: Path) -> dict[str, Any]:
    """The HF config dict, as transformers itself derives it from the GGUF metadata."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except Exception as e:  # transformers raises assorted types for bad metadata
        raise ConversionError(
            f"{path}: transformers could not read the config from the GGUF metadata: {e}"
        ) from e
    hf = config.to_dict()
    hf.pop("_name_or_path", None)
    if not hf.get("architectures") and hf.get("model_type") == "llama":
        hf["architectures"] = ["LlamaForCausalLM"]
    return hf


@contextlib.contextmanager
def open_gguf(path: Path) -> Iterator[Source]:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (
        Exception
    ) as e:  # truncated or foreign files surface as ValueError/IndexError/struct errors
        raise CorruptCheckpointError(f"{path} is not a readable GGUF file (truncated?): {e}") from e
    arch = gguf_architecture(reader)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    hf_config = gguf_hf_config(path)
    heads = {
        ".self_attn.q_proj.": hf_config["num_attention_heads"],
        ".self_attn.k_proj.": hf_config.get("num_key_value_heads")
        or hf_config["num_attention_heads"],
    }
    entries = []
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest-first
        n_heads = next((h for key, h in heads.items() if key in name), None)
        entries.append(
            TensorEntry(
                name, shape, _loader(tensor, shape, n_heads, path), f"{path.name}:{tensor.name}"
            )
        )
    yield Source(hf_config, entries)


def _loader(tensor, shape: tuple[int, ...], n_heads: int | None, path: Path):
    def load() -> np.ndarray:
        import gguf

        try:
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except NotImplementedError as e:
            raise ConversionError(
                f"{path.name}: {tensor.name} has GGUF type {tensor.tensor_type.name}: {e}"
            ) from e
        except ValueError as e:
            raise CorruptCheckpointError(
                f"{path.name}: cannot decode {tensor.name} (truncated?): {e}"
            ) from e
        return unpermute_rotary(w, n_heads) if n_heads else w

    return load


def int4_blocks(
    data: np.ndarray, type_name: str, rows: int, cols: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0/Q4_1 tensor's raw bytes (`[rows, blocks * block_bytes]`, blocks along `cols`) as
    `q` uint8 `[rows, cols]` in 0..15 and float32 `scales`, `mins` `[rows, cols / 32]`, with
    `w = q * scale + min` the value GGML's dequantizer gives. A block is a float16 scale `d`,
    for Q4_1 a float16 minimum `m`, then 16 bytes: byte j holds value j (low nibble) and j + 16."""
    if type_name not in INT4_BLOCK_TYPES:
        raise ValueError(
            f"not an int4 block type: {type_name} (supported: {', '.join(INT4_BLOCK_TYPES)})"
        )
    head = 4 if type_name == "Q4_1" else 2
    blocks = np.ascontiguousarray(data, np.uint8).reshape(rows, cols // _BLOCK_VALUES, head + 16)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        mins = -8.0 * scales
    nibbles = blocks[..., head:]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(rows, cols)
    return q, scales, mins


def read_int4_projections(path: Path, num_layers: int) -> dict[str, Int4Weight]:
    """Every layer projection of a GGUF whose weights are Q4_0/Q4_1 blocks, as our int4 weight
    stacked over layers, without a round trip through floats: `{"q_proj": Int4Weight(uint8
    [L, in / 2, out], f32 [L, in / 32, 2, out]), ...}` (`minivllm_jax.ops.quantization`), Q/K rows
    un-permuted as the float path does. A projection stored in another type is an error that
    says which: those files are served with quantization='int4' or 'int8' instead."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    hf_config = gguf_hf_config(path)
    heads = {
        "q_proj": hf_config["num_attention_heads"],
        "k_proj": hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"],
    }
    per_layer: dict[str, list] = {}
    for tensor in reader.tensors:
        parts = hf_name(tensor.name).split(".")
        if (
            len(parts) != 6
            or parts[:2] != ["model", "layers"]
            or parts[4] not in _PROJECTIONS
            or parts[5] != "weight"
        ):
            continue  # norms, embedding and head (and biases) keep the float path
        layer, name = int(parts[2]), parts[4]
        if tensor.tensor_type.name not in INT4_BLOCK_TYPES:
            raise ConversionError(
                f"{path.name}: {tensor.name} is {tensor.tensor_type.name}, not one of "
                f"{', '.join(INT4_BLOCK_TYPES)}; use quantization='int4' or 'int8' for this file"
            )
        cols, rows = (int(n) for n in tensor.shape)  # GGUF lists dims fastest-first: [in, out]
        q, scales, mins = int4_blocks(tensor.data, tensor.tensor_type.name, rows, cols)
        if name in heads:
            q, scales, mins = (unpermute_rotary(a, heads[name]) for a in (q, scales, mins))
        per_layer.setdefault(name, [None] * num_layers)[layer] = {
            "q": pack_int4(q.T),
            "scales": np.ascontiguousarray(scales.T),
            "mins": np.ascontiguousarray(mins.T),
        }
    missing = [
        f"{name}[{i}]"
        for name, layers in per_layer.items()
        for i, x in enumerate(layers)
        if x is None
    ]
    if missing:
        raise ConversionError(f"{path.name}: projections missing: {', '.join(missing[:8])}")
    return {
        name: int4_weight(*(np.stack([x[key] for x in layers]) for key in ("q", "scales", "mins")))
        for name, layers in per_layer.items()
    }
