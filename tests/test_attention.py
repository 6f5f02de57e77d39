"""The ragged paged attention reference against a plain per-token softmax in numpy, over a step
that mixes every kind of sequence: decodes with and without cached context, fresh prompts,
prompt chunks after cached context (several query tiles and page spans), and padding; with
float32 pages and with int8 pages (a scale per token and KV head), which every implementation
must read as `value * scale`. And the dispatcher: what the native kernel says it supports, an
explicit choice it cannot serve refused, "auto" falling back (logged once)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax import LLM, kernels
from minivllm_jax.kernels import ragged_paged_attention as native_kernel
from minivllm_jax.ops.attention import ATTENTION, get_attention, resolve_attention
from minivllm_jax.ops.batch import Chunk, build_step_batch
from minivllm_jax.ops.kv_cache import KVCache

L, NUM_PAGES, KVH, G, HD, PS = 2, 96, 2, 3, 16, 4
# (cached tokens, new tokens) per sequence: decodes, a fresh prompt, chunks after context
# (the 70-token chunk spans two query tiles; 140 cached tokens span two page groups).
SPECS = [(5, 1), (0, 1), (17, 1), (0, 7), (9, 30), (3, 1), (140, 70), (0, 2), (64, 1)]


def naive_attention(
    q, k_new, v_new, k_cache, v_cache, layer, specs, chunks, scale=HD**-0.5, softcap=None, window=0
):
    """Per token and head: softmax over its keys, at scale `scale`, scores soft-capped by `softcap`,
    only the keys at the `window` latest cache indices (itself included) when `window` > 0."""
    out = np.zeros_like(q)
    t = 0
    for (context, n), chunk in zip(specs, chunks):
        pages = np.asarray(chunk.pages)
        k_past = np.concatenate([k_cache[layer, p].transpose(0, 2, 1) for p in pages], axis=1)[
            :, :context
        ]
        v_past = np.concatenate([v_cache[layer, p] for p in pages], axis=1)[:, :context]
        for i in range(n):
            keys = np.concatenate(
                [k_past, k_new[t : t + i + 1].transpose(1, 0, 2)], axis=1
            )  # [KVH, c+i+1, hd]
            values = np.concatenate([v_past, v_new[t : t + i + 1].transpose(1, 0, 2)], axis=1)
            for h in range(KVH * G):
                s = keys[h // G] @ q[t + i, h] * scale
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                if window:  # the query is at cache index context + i, key j at index j
                    s = np.where(np.arange(len(s)) > context + i - window, s, -np.inf)
                p = np.exp(s - s.max())
                out[t + i, h] = (p / p.sum()) @ values[h // G]
        t += n
    return out


def random_cache(rng, page_dtype: str) -> tuple[KVCache, np.ndarray, np.ndarray]:
    """A cache of random pages and the float K/V it stands for."""
    if page_dtype == "float32":
        k_cache = rng.standard_normal((L, NUM_PAGES, KVH, HD, PS)).astype(np.float32)
        v_cache = rng.standard_normal((L, NUM_PAGES, KVH, PS, HD)).astype(np.float32)
        return KVCache(jnp.asarray(k_cache), jnp.asarray(v_cache)), k_cache, v_cache
    k_q = rng.integers(-127, 128, (L, NUM_PAGES, KVH, HD, PS)).astype(np.int8)
    v_q = rng.integers(-127, 128, (L, NUM_PAGES, KVH, PS, HD)).astype(np.int8)
    k_scale, v_scale = (
        rng.uniform(0.002, 0.02, (L, NUM_PAGES, KVH, PS)).astype(np.float32) for _ in range(2)
    )
    cache = KVCache(*map(jnp.asarray, (k_q, v_q, k_scale, v_scale)))
    return (
        cache,
        k_q.astype(np.float32) * k_scale[:, :, :, None, :],
        v_q.astype(np.float32) * v_scale[..., None],
    )


def round_as_int8(x: np.ndarray) -> np.ndarray:
    """What int8 pages hold for `[..., head_dim]` vectors: symmetric int8 per vector, dequantized."""
    scale = np.abs(x).max(-1, keepdims=True) / 127.0
    return (np.clip(np.round(x / scale), -127, 127) * scale).astype(np.float32)


def mixed_step(rng, page_dtype: str):
    """A cache and a step over every kind of sequence in `SPECS`, plus padding."""
    cache, k_cache, v_cache = random_cache(rng, page_dtype)
    free = list(rng.permutation(np.arange(1, NUM_PAGES)))
    chunks = []
    for context, n in SPECS:
        pages = [int(free.pop()) for _ in range(-(-(context + n) // PS))]
        chunks.append(Chunk(rng.integers(0, 10, n).tolist(), context, pages))
    num_tokens = sum(n for _, n in SPECS) + 5  # padding tokens and padded sequences too
    batch = build_step_batch(chunks, PS, num_tokens, len(SPECS) + 3, 120)
    q = rng.standard_normal((num_tokens, KVH * G, HD)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((num_tokens, KVH, HD)).astype(np.float32) for _ in range(2))
    return cache, k_cache, v_cache, chunks, batch, q, k_new, v_new


@pytest.mark.parametrize("page_dtype", ["float32", "int8"])
@pytest.mark.parametrize("impl", sorted(ATTENTION))
def test_ragged_attention_matches_per_token_softmax(impl, page_dtype):
    if impl == "native" and not kernels.native_available():
        pytest.skip("native kernels not available (not built, or MINIVLLM_KERNELS=reference)")
    rng = np.random.default_rng(0)
    cache, k_cache, v_cache, chunks, batch, q, k_new, v_new = mixed_step(rng, page_dtype)
    attend = jax.jit(get_attention(impl))
    real = sum(n for _, n in SPECS)
    for layer in range(L):
        got = np.asarray(attend(q, k_new, v_new, cache, jnp.int32(layer), batch))
        stored = (
            (lambda x: x) if page_dtype == "float32" else round_as_int8
        )  # how the cache keeps new K/V
        want = naive_attention(
            q, stored(k_new), stored(v_new), k_cache, v_cache, layer, SPECS, chunks
        )
        np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=1e-5)
        assert not np.any(got[real:])  # padding tokens give zeros


def test_unknown_attention_implementation_is_a_clear_error():
    with pytest.raises(
        ValueError, match="unknown attention implementation 'flash'; available: native, reference"
    ):
        get_attention("flash")


@pytest.mark.parametrize("page_dtype", ["float32", "int8"])
@pytest.mark.parametrize("windows", [(3, 0), (21, 21)], ids=["per_layer", "constant"])
def test_reference_honours_window_softcap_and_scale(page_dtype, windows):
    """Sliding windows (a traced value per layer: one shorter than a page, then none; or the
    same constant for every layer, spanning pages), soft-capping and another scale, against the
    per-token softmax over the same mixed step: windows that end inside the new tokens, inside
    a decode's pages and inside a chunk's cached page spans."""
    rng = np.random.default_rng(1)
    cache, k_cache, v_cache, chunks, batch, q, k_new, v_new = mixed_step(rng, page_dtype)
    scale, softcap = 0.4, 2.0  # scores of about N(0, 1.6): the cap bends many of them
    per_layer = len(set(windows)) > 1

    @jax.jit
    def attend(q, k_new, v_new, cache, layer, batch):
        window = jnp.asarray(windows, jnp.int32)[layer] if per_layer else windows[0]
        return ATTENTION["reference"](
            q, k_new, v_new, cache, layer, batch, scale=scale, softcap=softcap, window=window
        )

    real = sum(n for _, n in SPECS)
    stored = (lambda x: x) if page_dtype == "float32" else round_as_int8
    for layer in range(L):
        got = np.asarray(attend(q, k_new, v_new, cache, jnp.int32(layer), batch))
        args = (
            q,
            stored(k_new),
            stored(v_new),
            k_cache,
            v_cache,
            layer,
            SPECS,
            chunks,
            scale,
            softcap,
        )
        want = naive_attention(*args, window=windows[layer])
        np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=1e-5)
        assert not np.any(got[real:])
        if windows[layer]:  # the window changes the answer: ignoring it would fail the test
            assert np.abs(naive_attention(*args)[:real] - want[:real]).max() > 0.1


def test_the_native_kernel_supports_only_what_it_computes():
    """float32 activations over float32 or int8 pages, plain causal softmax at hd ** -0.5."""
    assert native_kernel.supports(jnp.float32, jnp.float32)
    assert native_kernel.supports(jnp.float32, jnp.int8)
    for dtype in (jnp.bfloat16, jnp.float16):
        assert not native_kernel.supports(dtype, dtype)
        assert not native_kernel.supports(dtype, jnp.int8)
        assert not native_kernel.supports(jnp.float32, dtype)
    assert not native_kernel.supports(jnp.float32, jnp.float32, softcap=50.0)
    assert not native_kernel.supports(jnp.float32, jnp.float32, sliding_window=True)
    assert not native_kernel.supports(jnp.float32, jnp.float32, default_scale=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_native_is_refused_for_16_bit_activations_and_auto_falls_back_once(
    dtype, monkeypatch, caplog
):
    """Asked for by name, the kernel that cannot serve the model is an error naming what to use
    (it used to run the reference silently); "auto" picks the reference and logs why, once."""
    monkeypatch.delenv(kernels.FORCE_REFERENCE_ENV, raising=False)
    with pytest.raises(
        ValueError,
        match=f"attention='native' cannot serve this model: {dtype} activations.*"
        "use attention='auto'",
    ):
        resolve_attention("native", None, dtype)
    kernels.log_fallback_once.cache_clear()
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        for _ in range(2):
            assert resolve_attention("auto", None, dtype) == "reference"
    fallbacks = [r.getMessage() for r in caplog.records if r.name == kernels.__name__]
    assert len(fallbacks) == 1 and f"{dtype} activations" in fallbacks[0], fallbacks
    assert resolve_attention("auto", None, dtype, "int8") == "reference"
    served = "native" if kernels.native_available() else "reference"
    assert resolve_attention("auto", None, "float32") == served
    assert resolve_attention("auto", None, "float32", "int8") == served


def test_the_native_implementation_never_falls_back_inside_a_program():
    """Called on bfloat16 arrays, the native implementation raises instead of computing
    something else (the reference), whatever the dispatcher decided."""
    rng = np.random.default_rng(0)
    cache, _, _, _, batch, q, k_new, v_new = mixed_step(rng, "float32")
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    with pytest.raises(ValueError, match="native attention kernel cannot serve bfloat16"):
        jax.jit(get_attention("native"))(
            bf16(q), bf16(k_new), bf16(v_new), cache, jnp.int32(0), batch
        )


def test_llm_refuses_native_attention_for_a_bfloat16_model(
    tiny_model_with_tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))  # the bfloat16 conversion
    monkeypatch.delenv(kernels.FORCE_REFERENCE_ENV, raising=False)
    with pytest.raises(
        ValueError, match="attention='native' cannot serve this model: bfloat16 activations"
    ):
        LLM(
            str(tiny_model_with_tokenizer),
            dtype="bfloat16",
            attention="native",
            num_pages=8,
            max_model_len=64,
            warmup=False,
            use_tqdm=False,
        )
