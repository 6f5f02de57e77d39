"""`convert_checkpoint`: write config.json, tokenizer files and params into OUT, atomically.

Everything goes into a temp dir beside OUT, renamed into place at the end, so a crash or
Ctrl-C never leaves a half-written OUT that later looks converted.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from minivllm_jax.loading.checkpoint import save_params
from minivllm_jax.loading.errors import ConversionError, OutputExistsError
from minivllm_jax.loading.quantize import quantize_model_params
from minivllm_jax.loading.reader import read_checkpoint
from minivllm_jax.ops.quantization import CHECKPOINT_KEY

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.is_file():
        raise OutputExistsError(f"output {out} is a file; expected a new or empty directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"output directory {out} exists and is not empty (use --overwrite to replace it)"
        )


def _save_tokenizer(src: Path, dst: Path) -> None:
    """Round-trip through `AutoTokenizer` so OUT has standard files (GGUF: built from its metadata)."""
    from transformers import AutoTokenizer

    if src.is_dir():
        if not any((src / name).is_file() for name in _TOKENIZER_FILES):
            warnings.warn(
                f"{src} has no tokenizer files; the converted model will accept token ids only",
                stacklevel=2,
            )
            return
        folder, kwargs = src, {}
    else:
        folder, kwargs = src.parent, {"gguf_file": src.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)
        tokenizer.save_pretrained(str(dst))
    except Exception as e:  # transformers raises many types; the cause matters more than the type
        raise ConversionError(
            f"could not convert the tokenizer of {src}: {type(e).__name__}: {e}"
        ) from e
    if src.is_dir() and (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", dst / "generation_config.json")


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename tmp to out; an empty out is replaced by rename itself, a full one only if overwrite."""
    if overwrite and out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, old / "x")
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.rename(tmp, out)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise OutputExistsError(
                f"output directory {out} appeared while converting; left it untouched"
            ) from e
        raise


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    dtype: Any = "float32",
    overwrite: bool = False,
    progress: bool = True,
    quantize: str | None = None,
    group_size: int = 32,
) -> Path:
    """Convert an HF folder or .gguf into OUT (config.json, tokenizer, params/) and return OUT.
    `quantize` ("int8", "int4" in groups of `group_size`, or "gguf": a GGUF's own 4-bit blocks)
    stores the projections quantized, and config.json says how, so loading never quantizes again."""
    src, out = Path(src), Path(out).absolute()
    _check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; OUT should be readable like any model dir
        hf_config, params = read_checkpoint(src, dtype=dtype, progress=progress)
        if quantize is not None:
            params = quantize_model_params(
                params, quantize, src, hf_config["num_hidden_layers"], group_size
            )
            hf_config[CHECKPOINT_KEY] = {
                "scheme": quantize,
                "group_size": 32 if quantize == "gguf" else group_size,
            }
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        _save_tokenizer(src, tmp)
        save_params(tmp / "params", params)
        del params
        _publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
