"""W8A8 matmul throughput: the native VNNI kernel against XLA's fp32 and int8 matmuls.

For SmolLM2-135M's projection shapes (in x out: qkv 576 x 960, gate_up 576 x 3072, down
1536 x 576, and the 576 x 49152 head) at several row counts, in one process, one after the
other for each shape: GOP/s (2 * rows * in * out / seconds, medians of --reps) of

  fp32      jitted `x @ w` in float32 (XLA's matmul; this CPU's float peak bounds it)
  int8 XLA  jitted int8 x int8 -> int32 `lax.dot_general` on ready int8 operands (no quantizing)
  w8a8 ref  `quantization.w8a8_matmul_reference` (quantize the rows, XLA's int8 dot, scale)
  w8a8      the native kernel (`kernels/w8a8_matmul.cc`) on the served layout (panels), row
            quantization included

    python benchmarks/micro/bench_w8a8_matmul.py [--rows 1 16 64 512] [--shapes 576x960 1536x576] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.harness import timed  # noqa: E402
from benchmarks.lib.report import add_options, script_parser, write_result  # noqa: E402

SHAPES = ["576x960", "576x3072", "1536x576", "576x49152"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, None, model=None)  # --out: also write the table as JSON there
    add_options(
        p,
        [
            ("--rows", [1, 16, 64, 512], "row counts of the activations"),
            ("--shapes", SHAPES, "IN x OUT of the weight, e.g. 576x960"),
            ("--reps", 9, "timed repetitions of each (medians reported)"),
        ],
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from minivllm_jax import kernels
    from minivllm_jax.kernels.w8a8_matmul import w8a8_matmul
    from minivllm_jax.ops.quantization import quantize_w8a8, to_panels, w8a8_matmul_reference

    if not kernels.native_available():
        print(
            "native kernels not available: run `python -m minivllm_jax.kernels.build`",
            file=sys.stderr,
        )
        return 2
    impls = {
        "fp32": jax.jit(lambda x, w, xq, wq, p: x @ w),
        "int8 XLA": jax.jit(
            lambda x, w, xq, wq, p: jax.lax.dot_general(
                xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32
            )
        ),
        "w8a8 ref": jax.jit(lambda x, w, xq, wq, p: w8a8_matmul_reference(x, p["stored"])),
        "w8a8": jax.jit(lambda x, w, xq, wq, p: w8a8_matmul(x, p["served"].q, p["served"].scales)),
    }
    rng = np.random.default_rng(0)
    rows_out = []
    print(
        f"{'in x out':>12} {'rows':>5} "
        + " ".join(f"{name:>9}" for name in impls)
        + "   GOP/s; w8a8 / fp32"
    )
    for shape in args.shapes:
        n_in, n_out = map(int, shape.split("x"))
        w = rng.standard_normal((n_in, n_out)).astype(np.float32)
        operands = {
            "w": jnp.asarray(w),
            "wq": jnp.asarray(rng.integers(-127, 128, (n_in, n_out), dtype=np.int8)),
            "p": {"stored": quantize_w8a8(w), "served": to_panels(quantize_w8a8(w))},
        }
        for rows in args.rows:
            x = rng.standard_normal((rows, n_in)).astype(np.float32)
            call = (
                jnp.asarray(x),
                operands["w"],
                jnp.asarray(rng.integers(-127, 128, x.shape, dtype=np.int8)),
                operands["wq"],
                operands["p"],
            )
            # One implementation at a time, each warmed up: interleaved, one's threads could
            # still be spinning when the other starts (docs/perf-notes.md, 2026-12-05).
            gop = 2 * rows * n_in * n_out / 1e9
            run = lambda f: timed(lambda: f(*call).block_until_ready(), args.reps, warmups=2)[0]
            gops = {name: gop / run(f) for name, f in impls.items()}
            rows_out.append({"in": n_in, "out": n_out, "rows": rows, "gops": gops})
            print(
                f"{n_in:>5} x {n_out:<6} {rows:>5} "
                + " ".join(f"{g:>9.0f}" for g in gops.values())
                + f"   {gops['w8a8'] / gops['fp32']:.2f}x"
            )
    if args.out:
        write_result({"benchmark": "w8a8_matmul", "unit": "GOP/s", "results": rows_out}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
