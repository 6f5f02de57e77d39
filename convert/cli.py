"""`minivllm-convert SRC OUT [--dtype ...] [--quantize int8|int4|w8a8|gguf] [--overwrite]`: errors print one
line and exit 2."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from minivllm_jax.loading.aliases import MODEL_ALIASES, alias_source
from minivllm_jax.loading.checkpoint import CheckpointError
from minivllm_jax.loading.errors import CheckpointNotFoundError, ConversionError
from minivllm_jax.loading.reader import DTYPES, EXPECTED
from minivllm_jax.loading.writer import convert_checkpoint
from minivllm_jax.ops.quantization import INT4_GROUP_SIZES, LLM_QUANTIZATIONS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="minivllm-convert",
        description="Convert an HF safetensors folder or a .gguf file into a minivllm-jax model directory.",
    )
    parser.add_argument(
        "src", help=f"HF save_pretrained folder, .gguf file, or alias ({', '.join(MODEL_ALIASES)})"
    )
    parser.add_argument("out", help="output directory (created atomically)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="params dtype (default float32)"
    )
    parser.add_argument(
        "--quantize",
        choices=LLM_QUANTIZATIONS,
        default=None,
        help="store the layers' projections quantized (int8 per channel, int4 per group, w8a8: "
        "int8 per channel packed for the int8-activation matmul, or gguf: a Q4_0/Q4_1 GGUF's "
        "own blocks); LLM(OUT) then loads them as they are",
    )
    parser.add_argument(
        "--group-size", type=int, choices=INT4_GROUP_SIZES, default=32, help="int4 group size"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        src = alias_source(args.src) if args.src in MODEL_ALIASES else Path(args.src)
        if not src.exists():
            raise CheckpointNotFoundError(
                f"{src} does not exist and is not a model alias ({', '.join(MODEL_ALIASES)}); expected {EXPECTED}"
            )
        out = convert_checkpoint(
            src,
            args.out,
            args.dtype,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            quantize=args.quantize,
            group_size=args.group_size,
        )
    except (ConversionError, CheckpointError, OSError, ValueError) as e:
        print(f"minivllm-convert: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("minivllm-convert: interrupted; nothing was written", file=sys.stderr)
        return 130
    quantized = f", {args.quantize} projections" if args.quantize else ""
    print(
        f"converted {args.src} -> {out} ({args.dtype}{quantized}) in {time.perf_counter() - start:.1f} s"
    )
    return 0
