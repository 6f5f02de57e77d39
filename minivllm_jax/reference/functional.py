"""A pure, fully jitted `generate` (exported as `minivllm_jax.generate`): prefill, then a
`lax.while_loop` of decode steps over a private paged KV cache, with sampling and the stop
conditions inside the loop (the JAX-native way, as in HF Flax `generate` and t5x). No scheduler
and no host round trip per token: arrays in, arrays out, one compiled program per bucket. It is
also the reference that shows the whole model path is pure.

    outs = generate(llm.params, llm.model_config, [[1, 2, 3], [4, 5]], 32)
    outs[0].token_ids, outs[0].finish_reason

Rows sample exactly as the engine does (`sampler.sample`, keyed by (seed, sample 0, step)), so a
row whose `SamplingParams` has a `seed` gives the tokens `LLM.generate` gives for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from minivllm_jax import kernels
from minivllm_jax.config import ModelConfig
from minivllm_jax.engine.step import StepSpec, model_forward
from minivllm_jax.models.params import ServingParams, model_dtype
from minivllm_jax.ops.attention import resolve_attention
from minivllm_jax.ops.batch import StepBatch
from minivllm_jax.ops.kv_cache import KVCache, init_kv_cache
from minivllm_jax.ops.sampler import (
    Penalties,
    SamplingArrays,
    apply_penalties,
    make_sampling_arrays,
    sample_penalized,
)
from minivllm_jax.sampling_params import SamplingParams


class Generated(NamedTuple):
    """What the jitted core returns (device arrays; B is the batch bucket, M the new-token bucket)."""

    tokens: jax.Array  # i32[B, M]  row r generated tokens[r, :lengths[r]] (a stop token included)
    lengths: jax.Array  # i32[B]
    stopped: jax.Array  # bool[B]  ended by a stop or EOS token; else by its token limit ("length")


class _Loop(NamedTuple):
    cache: KVCache
    out: jax.Array  # i32[B, M]
    n: jax.Array  # i32[B]  tokens generated so far (the sampler's step)
    done: jax.Array  # bool[B]
    stopped: jax.Array  # bool[B]
    counts: jax.Array  # f32[B, V]  occurrences of each token in the output (penalties)
    seen: jax.Array  # bool[B, V]  token in the prompt or the output (repetition penalty)


def generate_tokens(
    params: ServingParams,
    prompt_tokens: jax.Array,
    prompt_lens: jax.Array,
    max_tokens: jax.Array,
    stop_ids: jax.Array,
    sampling: SamplingArrays,
    *,
    spec: StepSpec,
    max_new_tokens: int,
    page_size: int = 16,
    kv_cache_dtype: str = "auto",
) -> Generated:
    """The jitted core. `prompt_tokens` `i32[T]`: the prompts back to back, row r's being the
    next `prompt_lens[r]` ids (`i32[B]`; rows of length 0 are padding), as a `StepBatch`
    packs them; `max_tokens` `i32[B]` (each row's limit, at most `max_new_tokens`); `stop_ids`
    `i32[B, K]` (the ids that end row r, EOS included; -1 pads); `sampling` from
    `make_sampling_arrays` (its `steps` are ignored: the loop counts them).

    The cache is built here, inside the program: its size follows from the bucket (row r owns
    `ceil((prompt_lens[r] + max_new_tokens) / page_size)` pages in a row, which all fit in
    `T / page_size + B * (max_new_tokens / page_size + 1)` pages, plus scratch page 0), every
    call starts it empty and nothing outlives the call, so there is nothing for a caller to
    allocate, donate or keep; XLA updates it in place inside the loop. `spec`: the model config
    and implementations (`minivllm_jax.engine.step.StepSpec`; its mesh must be None).
    """
    cfg = spec.cfg
    (T,), (B,) = prompt_tokens.shape, prompt_lens.shape
    M, ps = max_new_tokens, page_size
    num_pages = 1 + -(-T // ps) + B * (-(-M // ps) + 1)
    rows = jnp.arange(B, dtype=jnp.int32)
    row_pages = -(-(prompt_lens + M) // ps)
    page_start = jnp.cumsum(row_pages) - row_pages
    page_ids = jnp.arange(
        1, num_pages, dtype=jnp.int32
    )  # row r's: page_ids[page_start[r]:][:row_pages[r]]
    slot = lambda r, pos: (1 + page_start[r] + pos // ps) * ps + pos % ps  # noqa: E731
    cache = init_kv_cache(cfg, num_pages, ps, model_dtype(params), kv_cache_dtype)

    # Prefill: all prompts in one ragged step; tokens past the prompts are padding (scratch page).
    start = jnp.cumsum(prompt_lens) - prompt_lens
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(
        jnp.searchsorted(start + prompt_lens, t, side="right", method="compare_all"), 0, B - 1
    )
    in_prompt = t < jnp.sum(prompt_lens)
    pos = jnp.where(in_prompt, t - start[seq], 0)
    prefill = StepBatch(
        prompt_tokens,
        pos,
        jnp.where(in_prompt, slot(seq, pos), 0),
        start,
        prompt_lens,
        jnp.zeros_like(prompt_lens),
        page_start,
        page_ids,
    )

    penalized = jnp.any(
        (sampling.repetition_penalty != 1)
        | (sampling.presence_penalty != 0)
        | (sampling.frequency_penalty != 0)
    )

    def emit(s: _Loop, logits: jax.Array) -> _Loop:
        """Sample every row's next token as the engine's step does, record it, apply the stops."""
        arrays = dataclasses.replace(sampling, steps=s.n)
        history = lambda: apply_penalties(logits, arrays, Penalties(s.counts, s.seen))  # noqa: E731
        tok = sample_penalized(lax.cond(penalized, history, lambda: logits), logits, arrays).tokens
        live = ~s.done
        out = s.out.at[rows, jnp.where(live, s.n, M)].set(tok, mode="drop")
        n = s.n + live
        stop = live & jnp.any(tok[:, None] == stop_ids, axis=1)  # checked first, as the engine does
        done = s.done | stop | (n >= jnp.minimum(max_tokens, M))
        counts = s.counts.at[rows, tok].add(live.astype(jnp.float32))
        return _Loop(
            s.cache, out, n, done, s.stopped | stop, counts, s.seen.at[rows, tok].max(live)
        )

    def decode(s: _Loop) -> _Loop:
        # A finished row keeps re-feeding its last token at one position: it rewrites one slot of
        # its own pages, and its samples are not recorded. Static shapes make that work free.
        pos = jnp.maximum(prompt_lens + s.n - 1, 0)  # where the last token goes
        last = s.out[rows, jnp.maximum(s.n - 1, 0)]
        batch = StepBatch(
            last, pos, slot(rows, pos), rows, jnp.ones_like(rows), pos, page_start, page_ids
        )
        logits, cache = model_forward(params, s.cache, batch, spec)
        return emit(s._replace(cache=cache), logits)

    logits, cache = model_forward(params, cache, prefill, spec)
    seen = jnp.zeros((B, cfg.vocab_size), jnp.bool_).at[seq, prompt_tokens].max(in_prompt)
    state = _Loop(
        cache,
        jnp.zeros((B, M), jnp.int32),
        jnp.zeros(B, jnp.int32),
        prompt_lens == 0,
        jnp.zeros(B, jnp.bool_),
        jnp.zeros((B, cfg.vocab_size), jnp.float32),
        seen,
    )
    state = lax.while_loop(lambda s: ~jnp.all(s.done), decode, emit(state, logits))
    return Generated(state.out, state.n, state.stopped)


generate_tokens_jit = jax.jit(
    generate_tokens, static_argnames=("spec", "max_new_tokens", "page_size", "kv_cache_dtype")
)


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    token_ids: list[int]  # as the engine's `CompletionOutput.token_ids`: a stop token included
    finish_reason: str  # "stop" (a stop or EOS token) or "length"


def bucket(n: int, least: int = 1) -> int:
    """The power of two >= max(n, least): sizes that share a program."""
    return max(least, 1 << max(0, n - 1).bit_length())


def generate(
    params: ServingParams,
    cfg: ModelConfig,
    prompt_ids: Sequence[Sequence[int]] | Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    key: jax.Array | int | None = None,
    *,
    eos_token_ids: Sequence[int] | None = None,
    page_size: int = 16,
    attention: str = "auto",
    kv_cache_dtype: str = "auto",
) -> list[GenerateOutput]:
    """Generate for a batch of token-id prompts (or one prompt) in one jitted program.

    `max_new_tokens` caps every row and sizes the program; a row's `SamplingParams.max_tokens`
    may stop it earlier. `sampling`: one for all prompts or one per prompt; default greedy.
    `key` (a `jax.random` key or an int; default 0): row i without a seed takes the seed
    `(hi & 0x7FFFFFFF) << 32 | lo` from row i of `jax.random.bits(key, (len(prompts), 2), uint32)`,
    so a call is reproducible and the row equals the engine's run with that seed.
    `eos_token_ids` default to `cfg.eos_token_ids`; pass `llm.engine.eos_token_ids` to stop
    exactly where `LLM` does (it adds the tokenizer's and generation_config's EOS ids).
    Buckets: batch size, total prompt tokens and `max_new_tokens` each rounded up to a power of
    two (the last two at least `page_size`), so calls of similar sizes reuse one compiled program.
    """
    prompts = [prompt_ids] if len(prompt_ids) and np.ndim(prompt_ids[0]) == 0 else list(prompt_ids)
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or not all(prompts):
        raise ValueError("prompt_ids must hold at least one prompt, and no prompt may be empty")
    if any(t < 0 or t >= cfg.vocab_size for p in prompts for t in p):
        raise ValueError(f"prompt_ids must be token ids in [0, {cfg.vocab_size})")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    longest = max(map(len, prompts))
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's max_position_embeddings ({cfg.max_position_embeddings})"
        )
    sampling = SamplingParams(temperature=0.0, max_tokens=None) if sampling is None else sampling
    params_list = (
        [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    )
    if len(params_list) != len(prompts):
        raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
    for sp in params_list:
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sp).__name__}")
        if sp.stop:
            raise ValueError(
                "stop strings need the detokenizer, which cannot run inside a jitted loop: use "
                "LLM.generate, or stop_token_ids"
            )
        if sp.n != 1 or sp.logprobs is not None:
            raise ValueError(
                "generate supports n=1 without logprobs; use LLM.generate for n > 1 or logprobs"
            )

    n, B = len(prompts), bucket(len(prompts))
    T, M = bucket(sum(map(len, prompts)), page_size), bucket(max_new_tokens, page_size)
    key = (
        jax.random.key(int(key or 0)) if key is None or isinstance(key, (int, np.integer)) else key
    )
    drawn = [
        (int(hi) & 0x7FFFFFFF) << 32 | int(lo)
        for hi, lo in np.asarray(jax.random.bits(key, (n, 2), jnp.uint32))
    ]
    seeds = [sp.seed if sp.seed is not None else d for sp, d in zip(params_list, drawn)]
    eos = list(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    stops = [sp.stop_token_ids + ([] if sp.ignore_eos else eos) for sp in params_list]

    tokens = np.zeros(T, np.int32)
    tokens[: sum(map(len, prompts))] = [t for p in prompts for t in p]
    stop_ids = np.full((B, bucket(max(map(len, stops)), 4)), -1, np.int32)
    lens, limits = np.zeros(B, np.int32), np.zeros(B, np.int32)
    for r, (p, sp, stop) in enumerate(zip(prompts, params_list, stops)):
        lens[r], stop_ids[r, : len(stop)] = len(p), stop
        limits[r] = min(max_new_tokens, sp.max_tokens or max_new_tokens)
    arrays = make_sampling_arrays(
        [(sp, seed, 0, 0) for sp, seed in zip(params_list, seeds)], B, cfg.vocab_size
    )
    out = generate_tokens_jit(
        params,
        tokens,
        lens,
        limits,
        stop_ids,
        arrays,
        spec=StepSpec(
            cfg,
            resolve_attention(attention, cfg, model_dtype(params), kv_cache_dtype),
            matmul="auto" if kernels.native_available() else "reference",
        ),
        max_new_tokens=M,
        page_size=page_size,
        kv_cache_dtype=kv_cache_dtype,
    )
    out = jax.device_get(out)
    return [
        GenerateOutput(
            out.tokens[r, : out.lengths[r]].tolist(), "stop" if out.stopped[r] else "length"
        )
        for r in range(n)
    ]
