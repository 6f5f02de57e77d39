"""Time compile and one model step of `llama.forward` for a list of (B, T, P) shapes.

Random weights at SmolLM2-135M size (fp32 by default), a random paged cache and random
block tables (rows read different pages, as in serving). Prints one table row per shape:
compile seconds, median ms/step over `--reps` steps, and tokens/s (B*T per step).

Shape `B:T:P` means B rows of T new tokens each over P pages per block table. The context
before the step is `P*page_size - T` tokens (0 if negative), so a decode shape `64:1:8` attends
to 127 cached tokens plus its new one and a prefill shape `1:128:8` starts from an empty row
whose block table covers the pages its 128 new tokens are written to.

    python benchmarks/profile_step.py                       # the default decode + prefill sweep
    python benchmarks/profile_step.py --shapes 1:1:8 64:1:48 --reps 5
    python benchmarks/profile_step.py --quick               # tiny model, seconds (smoke test)
    python benchmarks/profile_step.py --impl /tmp/old_llama.py   # profile another llama.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

DEFAULT_SHAPES = [
    "1:1:8", "1:1:32", "1:1:48",
    "8:1:8", "8:1:32", "8:1:48",
    "32:1:8", "32:1:32", "32:1:48",
    "64:1:8", "64:1:32", "64:1:48",
    "1:128:8", "1:256:16", "1:512:32", "4:128:8",
]  # fmt: skip
QUICK_SHAPES = ["1:1:4", "4:1:4", "2:16:2"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=None, help="B:T:P triples (default: decode+prefill sweep)")
    p.add_argument("--quick", action="store_true", help="tiny model and tiny shapes (smoke test)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per shape (median reported)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-pages", type=int, default=2048, help="cap on cache pages (rows may share pages)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--impl", default=None, help="path of another llama.py-like module to profile instead")
    p.add_argument("--layer-loop", default=None, help="passed as forward(..., layer_loop=...) when given")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_impl(path: str | None):
    if path is None:
        from minivllm_jax.models import llama

        return llama
    spec = importlib.util.spec_from_file_location("llama_impl", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["llama_impl"] = mod
    spec.loader.exec_module(mod)
    return mod


def smollm2_config():
    from minivllm_jax.config import ModelConfig

    return ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip


def tiny_config():
    from minivllm_jax.config import ModelConfig

    return ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
        max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip


def make_batch(rng, B: int, T: int, P: int, page_size: int, num_pages: int):
    import numpy as np

    from minivllm_jax.batch import StepBatch

    ctx = max(0, P * page_size - T)
    need = -(-(ctx + T) // page_size)
    pages = rng.randint(1, num_pages, size=(B, max(P, need))).astype(np.int32)
    pos = ctx + np.arange(T, dtype=np.int32)
    positions = np.tile(pos[None], (B, 1))
    slots = np.take_along_axis(pages, np.tile((pos // page_size)[None], (B, 1)), axis=1) * page_size + pos % page_size
    return StepBatch(
        tokens=rng.randint(0, 100, size=(B, T)).astype(np.int32),
        positions=positions,
        slot_mapping=slots.astype(np.int32),
        block_tables=np.ascontiguousarray(pages[:, :P]),
        context_lens=np.full((B,), ctx, np.int32),
        query_lens=np.full((B,), T, np.int32),
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    llama = load_impl(args.impl)
    init_cache = getattr(llama, "init_kv_cache", None)
    if init_cache is None:
        from minivllm_jax.kv_cache import init_kv_cache as init_cache

    cfg = tiny_config() if args.quick else smollm2_config()
    shapes = [tuple(int(x) for x in s.split(":")) for s in (args.shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES))]
    dtype = jnp.dtype(args.dtype)
    params = llama.init_params(cfg, jax.random.PRNGKey(args.seed), dtype=dtype)
    need_pages = max(B * max(P, -(-(max(0, P * args.page_size - T) + T) // args.page_size)) for B, T, P in shapes) + 1
    num_pages = max(2, min(need_pages, args.max_pages))
    cache = init_cache(cfg, num_pages, args.page_size, dtype)
    cache = jax.tree.map(lambda a: jax.random.normal(jax.random.PRNGKey(1), a.shape, a.dtype), cache)
    rng = np.random.RandomState(args.seed)
    kwargs = {} if args.layer_loop is None else {"layer_loop": args.layer_loop}
    fwd = jax.jit(
        llama.forward, static_argnames=("cfg", "all_logits", *kwargs), donate_argnames=("cache",)
    )

    print(f"model {'tiny' if args.quick else 'SmolLM2-135M'} {args.dtype}, page_size {args.page_size}, "
          f"{num_pages} pages, impl {args.impl or 'minivllm_jax.models.llama'} {kwargs or ''}")  # fmt: skip
    print(f"{'B':>4} {'T':>5} {'P':>4} {'ctx':>5} {'compile s':>10} {'ms/step':>9} {'tok/s':>9}")
    for B, T, P in shapes:
        batch = make_batch(rng, B, T, P, args.page_size, num_pages)
        t0 = time.perf_counter()
        step = fwd.lower(params, cache, batch, cfg=cfg, **kwargs).compile()
        compile_s = time.perf_counter() - t0
        logits, cache = step(params, cache, batch)
        logits.block_until_ready()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            logits, cache = step(params, cache, batch)
            logits.block_until_ready()
            times.append(time.perf_counter() - t0)
        ms = 1e3 * float(np.median(times))
        ctx = max(0, P * args.page_size - T)
        print(f"{B:>4} {T:>5} {P:>4} {ctx:>5} {compile_s:>10.2f} {ms:>9.1f} {B * T / ms * 1e3:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
