"""Where the time of one ragged step goes, for a list of step shapes.

Random weights at SmolLM2-135M size (fp32 by default) and a random paged cache. A shape
`B:T:C` is B sequences feeding T new tokens each after C cached tokens (a decode: T = 1), laid
out as one flat ragged step in its bucket, on pages scattered over the cache as in serving;
`+` joins groups into one mixed step, e.g. `8:1:1500+1:64:0` is 8 decodes at 1,500 cached
tokens and a fresh 64-token prompt chunk. For each shape it times (median of `--reps`):
- `step`: the engine's program (model + penalties + sampling, `minivllm_jax.engine.step.engine_step`);
- `forward`: the model alone (logits of each sequence's last token);
- `no attention`: the model with attention replaced by zeros (an implementation registered
  here only), so `forward - no attention` is the attention and `step - forward` the sampler;
- `kv write`: the scatter of the step's new K/V into the cache alone (`kv_cache.write_kv`,
  part of `forward`), to see whether it is worth a kernel.

    python benchmarks/micro/profile_step.py                      # decode, prompt and mixed shapes
    python benchmarks/micro/profile_step.py --shapes 64:1:1500 --reps 5
    python benchmarks/micro/profile_step.py --quick              # tiny model, seconds (smoke test)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, as the others
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported (by the harness)

from benchmarks.lib.harness import add_engine_args, timed, tiny_model_config  # noqa: E402
from benchmarks.lib.report import add_options  # noqa: E402

DEFAULT_SHAPES = (
    "1:1:512 8:1:1500 64:1:64 64:1:375 64:1:1500 1:512:0 1:512:1024 8:1:1500+1:40:0 "
    "8:1:1500+1:120:1000"
).split()
QUICK_SHAPES = ["1:1:8", "4:1:8+1:6:0", "1:16:8"]
ENGINE_FLAGS = ("dtype", "quantization", "kv_cache_dtype", "attention", "page_size", "max_num_seqs")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shapes", nargs="+", default=None, help="B:T:C groups joined by + (default: a sweep)"
    )
    add_options(
        p,
        [
            ("--quick", False, "tiny model and tiny shapes (smoke test)"),
            ("--reps", 5, "timed steps per shape (median reported)"),
            ("--seed", 0, "seed of the random weights, cache and tokens"),
        ],
    )
    matmul = "projection matmuls (auto: native where built, as the runner)"
    p.add_argument("--matmul", default="auto", choices=["auto", "native", "reference"], help=matmul)
    add_engine_args(p, only=ENGINE_FLAGS)  # the random weights are quantized as --quantization
    return p.parse_args(argv)


def smollm2_config():
    from minivllm_jax.config import ModelConfig

    return ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=1e5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


def random_like(a, dtype):
    """Random values for a cache leaf of a `dtype` model: int8 pages, small positive scales, float
    pages, or 16-bit float pages stored as bits (`kv_cache.as_bits`)."""
    import jax
    import jax.numpy as jnp

    from minivllm_jax.ops.kv_cache import as_bits

    key = jax.random.PRNGKey(1)
    if a.dtype == jnp.uint16:
        return as_bits(jax.random.normal(key, a.shape, dtype))
    if a.dtype == jnp.int8:
        return jax.random.randint(key, a.shape, -127, 128, jnp.int8)
    if a.ndim == 4:  # the scales of int8 pages, [L, pages, kv heads, page_size]
        return jax.random.uniform(key, a.shape, a.dtype, 0.005, 0.02)
    return jax.random.normal(key, a.shape, a.dtype)


def parse_shape(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in group.split(":")) for group in text.split("+")]


def make_chunks(rng, groups: list[tuple[int, int, int]], page_size: int, num_pages: int) -> list:
    from minivllm_jax.ops.batch import Chunk

    chunks = []
    for B, T, C in groups:
        for _ in range(B):
            pages = rng.randint(1, num_pages, size=-(-(C + T) // page_size)).tolist()
            chunks.append(Chunk(rng.randint(0, 100, size=T).tolist(), C, pages))
    return chunks


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minivllm_jax import kernels
    from minivllm_jax.args import EngineArgs
    from minivllm_jax.config import bucket_for
    from minivllm_jax.engine.runtime import keep_freed_memory
    from minivllm_jax.engine.step import PenaltyRows, StepSpec, engine_step, init_penalty_state
    from minivllm_jax.models.decoder import forward
    from minivllm_jax.models.params import init_params, unstack_layers
    from minivllm_jax.ops import attention
    from minivllm_jax.ops.batch import build_step_batch
    from minivllm_jax.ops.kv_cache import init_kv_cache, write_kv
    from minivllm_jax.ops.quantization import quantize_params
    from minivllm_jax.ops.sampler import make_sampling_arrays
    from minivllm_jax.sampling_params import SamplingParams

    keep_freed_memory()  # the allocator set-up `LLM` does: without it each step's temporaries fault in afresh
    cfg = tiny_model_config(max_position_embeddings=512, tie_word_embeddings=True)
    cfg = cfg if args.quick else smollm2_config()
    shapes = args.shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    groups = [parse_shape(s) for s in shapes]
    max_ctx = max(C + T for g in groups for _, T, C in g)
    buckets = EngineArgs(  # only its buckets are used: the cache is sized below
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_ctx + 1,
        page_size=args.page_size,
        num_pages=2,
    ).create_engine_config()
    dtype = jnp.dtype(args.dtype)
    params = init_params(cfg, jax.random.PRNGKey(args.seed), dtype=dtype)
    params = unstack_layers(quantize_params(params, args.quantization))  # as the runner holds them
    matmul = (
        ("auto" if kernels.native_available() else "reference")
        if args.matmul == "auto"
        else args.matmul
    )
    num_pages = max(
        2,
        min(4096, max(sum(B * -(-(C + T) // args.page_size) for B, T, C in g) for g in groups) + 1),
    )
    cache = init_kv_cache(cfg, num_pages, args.page_size, dtype, args.kv_cache_dtype)
    cache = jax.tree.map(lambda a: random_like(a, dtype), cache)
    penalty_state = init_penalty_state(args.max_num_seqs, cfg.vocab_size)
    fed_back = jnp.zeros(args.max_num_seqs, jnp.int32)  # no placeholders in these batches
    rng = np.random.RandomState(args.seed)
    attention.ATTENTION["none"] = lambda q, k, v, cache, layer, batch: jnp.zeros_like(q)
    impl = attention.resolve_attention(args.attention, cfg, dtype, args.kv_cache_dtype)

    step_fn = jax.jit(
        engine_step, static_argnames=("spec",), donate_argnames=("cache", "penalty_state")
    )
    fwd = jax.jit(
        forward,
        static_argnames=("cfg", "attention", "all_logits", "matmul"),
        donate_argnames=("cache",),
    )
    write = jax.jit(write_kv, donate_argnames=("cache",))

    print(
        f"model {'tiny' if args.quick else 'SmolLM2-135M'} {args.dtype}, quantization {args.quantization}, "
        f"page_size {args.page_size}, {num_pages} pages ({args.kv_cache_dtype}), attention {impl}"
    )
    print(
        f"{'shape':>22} {'T':>4} {'S':>3} {'compile s':>9} {'step ms':>8} {'forward':>8} {'no attn':>8} "
        f"{'attention':>9} {'sampler':>8} {'kv write':>8} {'tok/s':>8}"
    )
    for text, group in zip(shapes, groups):
        chunks = make_chunks(rng, group, args.page_size, num_pages)
        tokens = sum(len(c.token_ids) for c in chunks)
        T = bucket_for(tokens, buckets.scheduler.token_buckets)
        S = bucket_for(len(chunks), buckets.scheduler.seq_buckets(T))
        batch = build_step_batch(chunks, args.page_size, T, S, buckets.num_listed_pages(S))
        sampling = make_sampling_arrays(
            [(SamplingParams(temperature=0.8, top_p=0.9), 1, 0, 0)] * len(chunks), S, cfg.vocab_size
        )
        rows = PenaltyRows(
            np.full(S, args.max_num_seqs, np.int32), np.zeros(S, np.int32), np.bool_(False)
        )

        ms = lambda run: 1e3 * timed(run, args.reps)[0]  # noqa: E731
        t0 = time.perf_counter()
        program = step_fn.lower(
            params,
            cache,
            penalty_state,
            fed_back,
            batch,
            sampling,
            rows,
            spec=StepSpec(cfg, impl, matmul),
        ).compile()
        compile_s = time.perf_counter() - t0

        def run_step() -> None:
            nonlocal cache, penalty_state
            result, cache, penalty_state, _ = program(
                params, cache, penalty_state, fed_back, batch, sampling, rows
            )
            result.tokens.block_until_ready()

        def run_forward(impl: str) -> None:
            nonlocal cache
            logits, cache = fwd(params, cache, batch, cfg, impl, matmul=matmul)
            logits.block_until_ready()

        new_kv = jnp.zeros((cfg.num_layers, T, cfg.num_kv_heads, cfg.head_dim), dtype)

        def run_write() -> None:
            nonlocal cache
            cache = write(cache, new_kv, new_kv, batch.slot_mapping)
            jax.block_until_ready(cache)

        step_ms, fwd_ms = ms(run_step), ms(lambda: run_forward(impl))
        bare_ms, write_ms = ms(lambda: run_forward("none")), ms(run_write)
        print(
            f"{text:>22} {T:>4} {S:>3} {compile_s:>9.2f} {step_ms:>8.1f} {fwd_ms:>8.1f} {bare_ms:>8.1f} "
            f"{fwd_ms - bare_ms:>9.1f} {step_ms - fwd_ms:>8.1f} {write_ms:>8.1f} {tokens / step_ms * 1e3:>8.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
