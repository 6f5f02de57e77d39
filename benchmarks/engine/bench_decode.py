"""Batch-1 greedy decode: our jitted JAX step vs HF transformers `generate` (PyTorch) and
llama.cpp (on the shipped Q4_1 GGUF and on an F32 GGUF of the same weights), same run.

Reports compile times, time to first token, and decode tokens/s (tokens after the first,
medians over repetitions) for each, on the same prompt and thread count, and how many of
llama.cpp's greedy tokens agree with ours.

    python benchmarks/engine/bench_decode.py [--tokens 128] [--reps 3] [--quick] [--no-llamacpp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib import peers  # noqa: E402
from benchmarks.lib.harness import decode_rate, load_model, stream_greedy  # noqa: E402
from benchmarks.lib.report import add_options, ms, script_parser, write_result  # noqa: E402
from benchmarks.lib.workloads import tokenizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, "decode.json")
    p.add_argument("--prompt", default="Write a short story about a robot learning to paint.")
    add_options(
        p,
        [
            ("--tokens", 128, "new tokens per run"),
            ("--reps", 3, "timed runs (medians reported)"),
            ("--threads", 2, "torch and llama.cpp threads (XLA uses the same cores)"),
            ("--no-hf", False, "skip the PyTorch peer"),
        ],
    )
    peers.add_peer_args(p)
    p.add_argument("--quick", action="store_true", help="16 tokens, 1 rep")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.reps = 16, 1
    return args


def bench_ours(model: str, prompt_ids: list[int], tokens: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minivllm_jax.engine.step import StepSpec, forward_jit
    from minivllm_jax.ops.batch import single_sequence_batch
    from minivllm_jax.ops.kv_cache import init_kv_cache

    cfg, params = load_model(model)
    # Compile times: lower+compile each program once before any call with that shape.
    pages = list(range(1, -(-(len(prompt_ids) + tokens) // 16) + 1))
    cache = init_kv_cache(cfg, len(pages) + 1, 16, jnp.float32)
    compile_s = {}
    for name, batch in [
        ("prefill", single_sequence_batch(np.asarray(prompt_ids), 0, pages, 16)),
        ("decode", single_sequence_batch(np.array([1]), len(prompt_ids), pages, 16)),
    ]:
        start = time.perf_counter()
        forward_jit.lower(params, cache, batch, StepSpec(cfg)).compile()
        compile_s[name] = time.perf_counter() - start
    del cache

    runs = [stream_greedy(params, cfg, prompt_ids, tokens) for _ in range(reps)]
    ids = [r.pop("token_ids") for r in runs][-1]
    jax.clear_caches()
    return {"compile_s": compile_s, **_medians(runs), "token_ids": ids}


def _medians(runs: list[dict]) -> dict:
    """Median TTFT and decode tok/s over the repetitions, with the runs themselves."""
    return {
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "runs": runs,
    }


def bench_hf(model: str, prompt_ids: list[int], tokens: int, reps: int, threads: int) -> dict:
    hf = peers.load_hf_model(model, "float32", threads)
    peers.hf_generate(hf, [prompt_ids], 4)  # warm-up
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        peers.hf_generate(hf, [prompt_ids], 1)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        peers.hf_generate(hf, [prompt_ids], tokens)
        total = time.perf_counter() - start
        runs.append({"ttft_s": ttft, "decode_tok_s": (tokens - 1) / max(total - ttft, 1e-9)})
    return _medians(runs)


def bench_llamacpp(
    path: Path, prompt_ids: list[int], tokens: int, reps: int, threads: int, ours: dict
) -> dict:
    """llama.cpp's batch-1 greedy decode of exactly `tokens` tokens on GGUF `path`, measured as
    ours is (TTFT; tokens after the first over their time), and how many agree with ours."""
    runs = []
    with peers.LlamaCppPeer(path, threads) as peer:
        for _ in range(reps):
            r = peer.run([prompt_ids], [tokens], 1)
            t, ids = r.token_times[0], r.token_ids[0]
            runs.append({"ttft_s": t[0] - r.arrival[0], "decode_tok_s": decode_rate(t)})
    medians = _medians(runs)
    return {
        "gguf": path.name,
        **medians,
        "ours_speedup": ours["decode_tok_s"] / medians["decode_tok_s"],
        "tokens_agreeing_with_ours": peers.common_prefix(ids, ours["token_ids"]),
        "token_ids": ids,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    prompt_ids = tokenizer(args.model).encode(args.prompt)
    result = {
        "benchmark": "decode_batch1",
        "model": args.model,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.tokens,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "ours": bench_ours(args.model, prompt_ids, args.tokens, args.reps),
    }
    if not args.no_hf:
        result["hf"] = bench_hf(args.model, prompt_ids, args.tokens, args.reps, args.threads)
        result["speedup"] = result["ours"]["decode_tok_s"] / result["hf"]["decode_tok_s"]
    ours = result["ours"]
    measure = lambda _, path: bench_llamacpp(
        path, prompt_ids, args.tokens, args.reps, args.threads, ours
    )
    peers.run_variants(args, result, measure)
    write_result(result, args.out)
    line = lambda r: f"decode {r['decode_tok_s']:.1f} tok/s, ttft {ms(r['ttft_s'])} ms"
    print(f"ours: {line(ours)}, compile {ours['compile_s']}")
    if "hf" in result:
        print(f"HF:   {line(result['hf'])}\nspeedup {result['speedup']:.2f}x")
    for variant, r in result.get("llamacpp", {}).items():
        print(
            f"llama.cpp {variant}: {line(r)}, ours/llama.cpp {r['ours_speedup']:.2f}x, first "
            f"{r['tokens_agreeing_with_ours']} of {args.tokens} greedy tokens agree with ours"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
