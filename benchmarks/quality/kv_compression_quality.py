"""What KV compression (`minivllm_jax.engine.kv.compression`) costs in quality and saves in memory: a
long text teacher-forced through the model chunk by chunk over ONE sequence's page list,
dropping pages by a policy after every chunk as the engine would, against the same text under
full attention.

    python -m benchmarks.quality.kv_compression_quality                       # tiny random model: a smoke run
    python -m benchmarks.quality.kv_compression_quality --model smollm2-135m \\
        --config '{"policy": "sink_window", "window_tokens": 1024}' \\
        --config '{"policy": "page_scores", "window_tokens": 512, "budget_tokens": 1024}'

Fixed shapes throughout (the page list is padded to the whole text's pages, the chunk to
`chunk` tokens): one compiled forward and one compiled scorer for the whole text.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.lib.harness import load_model, tiny_model_config
from benchmarks.lib.report import add_options
from benchmarks.lib.workloads import text_ids, tokenizer
from minivllm_jax.config import KVCompressionConfig, ModelConfig
from minivllm_jax.engine.kv.compression import kept_pages, needs_scores, wants_compression
from minivllm_jax.engine.step import StepSpec, forward_jit, page_attention_scores_jit
from minivllm_jax.models.params import ServingParams, init_params, model_dtype, unstack_layers
from minivllm_jax.ops.batch import Chunk, build_step_batch
from minivllm_jax.ops.kv_cache import init_kv_cache, kv_bytes_per_page


@jax.jit
def _nll_and_argmax(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's negative log-likelihood of its target and its argmax (on the device: only
    `2 * T` numbers leave it, not `[T, vocab]` logits)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0], jnp.argmax(logits, axis=-1)


def evaluate(
    params: ServingParams,
    cfg: ModelConfig,
    token_ids: Sequence[int],
    config: KVCompressionConfig | None,
    page_size: int = 16,
    chunk: int = 16,
    attention: str = "reference",
    matmul: str = "reference",
    kv_cache_dtype: str = "auto",
    reference_argmax: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Teacher-force `token_ids` in `chunk`-token steps, compressing the sequence's pages by
    `config` after each step (None: full attention). Returns:

    - "perplexity": exp of the mean NLL of tokens 1..n-1 (each predicted from those before it);
    - "argmax": the greedy prediction at positions 0..n-2;
    - "greedy_agreement": the fraction of those equal to full attention's (`reference_argmax`,
      else computed here by a full-attention run; 1.0 for `config=None`);
    - "kept_fraction": the mean over positions 0..n-2 of (tokens the position attended to) /
      (tokens up to and including it); "final_kept_tokens": the tokens cached at the end;
    - "kept_pages_max": the most pages the sequence held at once (after a step's write, before
      its drop), and "bytes_per_seq": those pages' KV bytes (`kv_cache.kv_bytes_per_page`);
    - "compressions" (steps that dropped pages) and "seconds".
    """
    n = len(token_ids)
    if n < 2:
        raise ValueError(f"need at least 2 tokens, got {n}")
    if config is not None:
        config.check_page_size(page_size)
    t0 = time.perf_counter()
    dtype = model_dtype(params)
    spec = StepSpec(cfg, attention, matmul)
    total_pages = -(-n // page_size)
    cache = init_kv_cache(cfg, total_pages + 1, page_size, dtype, kv_cache_dtype)
    fresh = iter(
        range(1, total_pages + 1)
    )  # every page the text can need, each used once: dropped ones are not reused
    ids = np.asarray(token_ids, np.int32)
    pages: list[int] = []
    cached = dropped = 0  # tokens in the cache (= the next cache index), tokens dropped from it
    nll, argmax, kept_fraction = [], [], []
    kept_pages_max = compressions = 0
    for start in range(0, n, chunk):
        tokens = ids[start : start + chunk]
        while len(pages) * page_size < cached + len(tokens):
            pages.append(next(fresh))
        batch = build_step_batch(
            [Chunk(tokens, cached, pages, dropped)], page_size, chunk, 1, total_pages
        )
        logits, cache = forward_jit(params, cache, batch, spec, all_logits=True)
        targets = np.zeros(chunk, np.int32)
        scored = min(len(tokens), n - 1 - start)  # positions that have a next token
        targets[:scored] = ids[start + 1 : start + 1 + scored]
        step_nll, step_argmax = map(np.asarray, _nll_and_argmax(logits, targets))
        nll.extend(step_nll[:scored].tolist())
        argmax.extend(step_argmax[:scored].tolist())
        kept_fraction.extend((cached + j + 1) / (start + j + 1) for j in range(scored))
        cached += len(tokens)
        kept_pages_max = max(kept_pages_max, len(pages))
        num_full = cached // page_size
        if config is None or not wants_compression(config, num_full, page_size):
            continue
        scores = None
        if needs_scores(config):  # the last computed token, re-fed at its own cache index
            last = Chunk(
                ids[start + len(tokens) - 1 : start + len(tokens)], cached - 1, pages, dropped
            )
            score_batch = build_step_batch([last], page_size, 1, 1, total_pages)
            scores = np.asarray(page_attention_scores_jit(params, cache, score_batch, spec))
        keep = kept_pages(config, num_full, page_size, scores)
        gone = (num_full - len(keep)) * page_size
        pages = [pages[i] for i in keep] + pages[num_full:]
        cached, dropped, compressions = cached - gone, dropped + gone, compressions + 1

    if reference_argmax is None:
        reference_argmax = (
            argmax
            if config is None
            else evaluate(
                params, cfg, token_ids, None, page_size, chunk, attention, matmul, kv_cache_dtype
            )["argmax"]
        )
    if len(reference_argmax) != n - 1:
        raise ValueError(f"reference_argmax has {len(reference_argmax)} entries, expected {n - 1}")
    return {
        "policy": None
        if config is None
        else {k: v for k, v in vars(config).items() if v is not None},
        "tokens": n,
        "perplexity": math.exp(float(np.mean(nll))),
        "greedy_agreement": float(np.mean(np.asarray(argmax) == np.asarray(reference_argmax))),
        "kept_fraction": float(np.mean(kept_fraction)),
        "final_kept_tokens": cached,
        "kept_pages_max": kept_pages_max,
        "bytes_per_seq": kept_pages_max * kv_bytes_per_page(cfg, page_size, dtype, kv_cache_dtype),
        "compressions": compressions,
        "seconds": time.perf_counter() - t0,
        "argmax": argmax,
    }


def _load(
    args: argparse.Namespace,
) -> tuple[ServingParams, ModelConfig, list[int], dict[str, Any]]:
    """A real model (`--model`: an alias or folder, converted on first use) and its tokens of
    `--text`, or without `--model` a tiny random model and random tokens (smoke run)."""
    if args.model is None:
        cfg = tiny_model_config()
        params = unstack_layers(init_params(cfg, jax.random.PRNGKey(args.seed), scale=0.3))
        ids = (
            np.random.default_rng(args.seed)
            .integers(3, cfg.vocab_size, args.tokens or 512)
            .tolist()
        )
        return params, cfg, ids, {"model": "tiny-random"}
    cfg, params = load_model(args.model, args.dtype)
    ids, sources = text_ids(tokenizer(args.model), args.text)
    if args.tokens:
        ids = ids[: args.tokens]
    return params, cfg, ids, {"model": args.model, "text": sources}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="alias or model folder (default: a tiny random model)")
    p.add_argument("--text", nargs="*", help="text files (default: the licence texts of workloads)")
    p.add_argument("--config", action="append", help="a KVCompressionConfig as JSON (repeatable)")
    add_options(
        p,
        [
            ("--dtype", "float32", "the model's dtype"),
            ("--tokens", int, "score only the first N tokens"),
            ("--page-size", 16, "tokens per KV page"),
            ("--chunk", int, "tokens per step (default: the page size)"),
            ("--attention", "reference", "attention implementation"),
            ("--matmul", "reference", "projection matmuls"),
            ("--kv-cache-dtype", "auto", "KV pages: auto (the model's dtype) or int8"),
            ("--seed", 0, "seed of the tiny model and its tokens"),
            ("--out", str, "write the results as JSON here"),
        ],
    )
    args = p.parse_args(argv)
    configs = (
        [KVCompressionConfig.from_dict(json.loads(c)) for c in args.config]
        if args.config
        else [
            KVCompressionConfig("sink_window", sink_tokens=16, window_tokens=64),
            KVCompressionConfig("page_scores", sink_tokens=16, window_tokens=32, budget_tokens=96),
        ]
    )
    params, cfg, ids, info = _load(args)
    common = dict(
        page_size=args.page_size,
        chunk=args.chunk or args.page_size,
        attention=args.attention,
        matmul=args.matmul,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    full = evaluate(params, cfg, ids, None, **common)
    results = [full] + [
        evaluate(params, cfg, ids, c, reference_argmax=full["argmax"], **common) for c in configs
    ]
    for r in results:
        r.pop("argmax")
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**info, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
