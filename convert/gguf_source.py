"""llama.cpp GGUF files: dequantized to float, renamed to HF names, Q/K rows un-permuted.

llama.cpp's converter interleaves the rows of each Q/K head for its RoPE kernel; HF's
rotate-half RoPE (and ours) expects the original order, so that permutation is undone here.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from convert.errors import ConversionError, CorruptCheckpointError, UnsupportedArchitectureError
from convert.source import Source, TensorEntry

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)


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
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers raises assorted types for bad metadata
        raise ConversionError(f"{path}: transformers could not read the config from the GGUF metadata: {e}") from e
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
    except Exception as e:  # truncated or foreign files surface as ValueError/IndexError/struct errors
        raise CorruptCheckpointError(f"{path} is not a readable GGUF file (truncated?): {e}") from e
    arch = gguf_architecture(reader)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    hf_config = gguf_hf_config(path)
    heads = {
        ".self_attn.q_proj.": hf_config["num_attention_heads"],
        ".self_attn.k_proj.": hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"],
    }
    entries = []
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest-first
        n_heads = next((h for key, h in heads.items() if key in name), None)
        entries.append(TensorEntry(name, shape, _loader(tensor, shape, n_heads, path), f"{path.name}:{tensor.name}"))
    yield Source(hf_config, entries)


def _loader(tensor, shape: tuple[int, ...], n_heads: int | None, path: Path):
    def load() -> np.ndarray:
        import gguf

        try:
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except NotImplementedError as e:
            raise ConversionError(f"{path.name}: {tensor.name} has GGUF type {tensor.tensor_type.name}: {e}") from e
        except ValueError as e:
            raise CorruptCheckpointError(f"{path.name}: cannot decode {tensor.name} (truncated?): {e}") from e
        return unpermute_rotary(w, n_heads) if n_heads else w

    return load
