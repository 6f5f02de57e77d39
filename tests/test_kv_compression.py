"""KV compression (`minivllm_jax/engine/kv/compression.py`): the page policies, `Chunk.position_offset`,
the exactness of dropping pages (a decode over a page list with holes equals full attention
with the dropped keys masked out, at the original positions), and the device page scores."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax.config import KVCompressionConfig, ModelConfig
from minivllm_jax.engine.kv.compression import kept_pages, needs_scores, wants_compression
from minivllm_jax.engine.step import StepSpec, page_attention_scores_jit
from minivllm_jax.models.decoder import forward
from minivllm_jax.models.layers import apply_rope, rms_norm, rope_inv_freq
from minivllm_jax.models.params import init_params, unstack_layers
from minivllm_jax.ops.batch import Chunk, build_step_batch
from minivllm_jax.ops.kv_cache import init_kv_cache

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=1e4,
    max_position_embeddings=256,
)
PS = 4
PROMPT = (
    np.random.default_rng(0).integers(3, CFG.vocab_size, 22).tolist()
)  # 5 full pages and 2 tokens
PAGES = [7, 3, 9, 2, 5, 8]  # out of order: the page list decides
# Not donating: a test reads a cache again after stepping it.
_forward = jax.jit(
    forward, static_argnames=("cfg", "attention", "all_logits", "matmul", "return_queries")
)


def forward_nodonate(params, *args, **kwargs):
    """`forward` of the tests' stored params (`dense_logits` reads them stacked)."""
    return _forward(unstack_layers(params), *args, **kwargs)


@pytest.fixture(scope="module")
def params():
    # A larger init scale than the default: peaky attention, so wrong keys or positions show.
    return init_params(CFG, jax.random.PRNGKey(0), scale=0.3)


def step(tokens, context_len, pages, offset=0, num_listed=None):
    chunk = Chunk(tokens, context_len, pages, offset)
    return build_step_batch([chunk], PS, len(tokens), 1, num_listed or len(pages))


def prefilled(params, page_dtype="auto", dtype=jnp.float32):
    cache = init_kv_cache(CFG, num_pages=12, page_size=PS, dtype=dtype, kv_cache_dtype=page_dtype)
    _, cache = forward_nodonate(params, cache, step(PROMPT, 0, PAGES), CFG)
    return cache


# ------------------------------------------------------------------------------- the policies


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(policy="h2o"), "unknown KV compression policy 'h2o'"),
        (dict(policy="sink_window", sink_tokens=-1), "sink_tokens must be an integer >= 0"),
        (dict(policy="sink_window", window_tokens=2.5), "window_tokens must be an integer >= 0"),
        (dict(policy="page_scores"), "needs budget_tokens"),
        (
            dict(policy="page_scores", sink_tokens=4, window_tokens=8, budget_tokens=11),
            r"must be >= sink_tokens \+ window",
        ),
        (dict(policy="sink_window", budget_tokens=64), "budget_tokens is for policy 'page_scores'"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCompressionConfig(**kwargs)


def test_config_from_dict():
    config = KVCompressionConfig.from_dict({"policy": "page_scores", "budget_tokens": 512})
    assert config == KVCompressionConfig("page_scores", budget_tokens=512) and hash(config)
    with pytest.raises(ValueError, match="unknown KV compression keys: budget, sinks"):
        KVCompressionConfig.from_dict({"policy": "sink_window", "sinks": 4, "budget": 1})
    with pytest.raises(ValueError, match="needs 'policy'"):
        KVCompressionConfig.from_dict({"window_tokens": 16})
    with pytest.raises(ValueError, match="must be a JSON object"):
        KVCompressionConfig.from_dict(["sink_window"])


def test_sink_window_keeps_sink_and_window_pages():
    config = KVCompressionConfig("sink_window", sink_tokens=4, window_tokens=8)
    assert kept_pages(config, 10, 4) == [0, 8, 9]
    assert kept_pages(config, 10, 3) == [0, 1, 7, 8, 9]  # 4 sink tokens need 2 pages of 3; 8 need 3
    assert kept_pages(KVCompressionConfig("sink_window", sink_tokens=0, window_tokens=5), 6, 4) == [
        4,
        5,
    ]
    assert kept_pages(config, 3, 4) == [0, 1, 2] and not wants_compression(
        config, 3, 4
    )  # short: nothing goes
    assert wants_compression(config, 4, 4) and kept_pages(config, 4, 4) == [0, 2, 3]
    assert not needs_scores(config)


def test_page_scores_keep_the_best_middle_pages_within_budget():
    config = KVCompressionConfig("page_scores", sink_tokens=4, window_tokens=8, budget_tokens=23)
    scores = [
        0.0,
        0.05,
        0.3,
        0.01,
        0.2,
        0.3,
        0.02,
        0.0,
        0.0,
        0.0,
        0.9,
    ]  # the last entry is the partial page
    # budget: 23 // 4 = 5 full pages: the sink (0), the window (8, 9) and the two best of 1..7.
    assert kept_pages(config, 10, 4, scores) == [0, 2, 5, 8, 9]  # 2 and 5 tie: both fit
    assert kept_pages(config, 10, 4, [0, 1, 1, 1, 0, 0, 0, 0, 0, 0]) == [
        0,
        1,
        2,
        8,
        9,
    ]  # ties: the earlier
    assert not wants_compression(config, 5, 4) and kept_pages(config, 5, 4) == [0, 1, 2, 3, 4]
    assert needs_scores(config)
    with pytest.raises(ValueError, match="needs a score for each of the 10 full pages"):
        kept_pages(config, 10, 4)
    with pytest.raises(ValueError, match=r"rounded to pages of 16 \(32\)"):
        kept_pages(
            KVCompressionConfig("page_scores", sink_tokens=4, window_tokens=8, budget_tokens=16),
            10,
            16,
        )


def test_kept_pages_bound_memory_as_a_sequence_grows():
    """Compressing after every new full page keeps the page count constant however long it runs."""
    rng = np.random.default_rng(1)
    sink_window = KVCompressionConfig("sink_window", sink_tokens=4, window_tokens=16)
    for config, most in (
        (sink_window, 5),
        (KVCompressionConfig("page_scores", sink_tokens=4, window_tokens=8, budget_tokens=24), 6),
    ):
        pages = []
        for page in range(40):
            pages.append(page)
            keep = kept_pages(config, len(pages), 4, rng.random(len(pages)))
            assert keep[-1] == len(pages) - 1 and (
                keep[0] == 0
            )  # the newest page and the sink stay
            pages = [pages[i] for i in keep]
            assert len(pages) <= most
        assert len(pages) == most and pages[0] == 0


# ---------------------------------------------------------------------------- position offset


def test_position_offset_shifts_positions_only():
    chunks = [Chunk([5, 6, 7], 5, [4, 9, 2]), Chunk([8], 2, [3])]
    plain = build_step_batch(chunks, PS, 6, 3, 8)
    shifted = build_step_batch([chunks[0], Chunk([8], 2, [3], position_offset=12)], PS, 6, 3, 8)
    np.testing.assert_array_equal(
        shifted.positions, plain.positions + np.array([0, 0, 0, 12, 0, 0])
    )
    for name in (
        "tokens",
        "slot_mapping",
        "query_start",
        "query_len",
        "context_len",
        "page_start",
        "page_ids",
    ):
        np.testing.assert_array_equal(getattr(shifted, name), getattr(plain, name), err_msg=name)
    np.testing.assert_array_equal(
        plain.slot_mapping[:4], [9 * PS + 1, 9 * PS + 2, 9 * PS + 3, 3 * PS + 2]
    )


# ------------------------------------------------------------------- dropping pages is exact


def dense_logits(params, tokens, positions, visible):
    """The model over a whole token sequence with plain dense attention: query `i` sees key `j`
    where `visible[i, j]`. Independent of the paged cache, batches and slots."""
    lp, T, H, KVH, hd = params["layers"], len(tokens), CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    x = params["embed_tokens"][jnp.asarray(tokens)]
    freqs = jnp.asarray(positions, jnp.float32)[:, None] * rope_inv_freq(CFG)
    emb = jnp.concatenate([freqs, freqs], -1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    for layer in range(CFG.num_layers):
        w = jax.tree.map(lambda a: a[layer], lp)
        h = rms_norm(x, w["input_layernorm"], CFG.rms_norm_eps)
        q = apply_rope((h @ w["q_proj"]["kernel"]).reshape(T, H, hd), cos, sin)
        k = apply_rope((h @ w["k_proj"]["kernel"]).reshape(T, KVH, hd), cos, sin)
        v = (h @ w["v_proj"]["kernel"]).reshape(T, KVH, hd)
        k, v = jnp.repeat(k, H // KVH, axis=1), jnp.repeat(v, H // KVH, axis=1)
        s = jnp.where(visible[None], jnp.einsum("thd,shd->hts", q, k) * hd**-0.5, -jnp.inf)
        attn = jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1), v).reshape(T, H * hd)
        x = x + attn @ w["o_proj"]["kernel"]
        h = rms_norm(x, w["post_attention_layernorm"], CFG.rms_norm_eps)
        x = (
            x
            + (jax.nn.silu(h @ w["gate_proj"]["kernel"]) * (h @ w["up_proj"]["kernel"]))
            @ w["down_proj"]["kernel"]
        )
    return rms_norm(x, params["norm"], CFG.rms_norm_eps) @ params["lm_head"]


def decode_after_drop(params, new_tokens, offset):
    """Drop the prompt's full pages 1 and 2 (tokens 4..11), then decode `new_tokens` one at a
    time with cache indices 14, 15, 16 (the last in a fresh page) at positions 14 + `offset`..."""
    cache = prefilled(params)
    pages = [PAGES[0]] + PAGES[3:] + [6]  # dropped: PAGES[1:3]; page 6 is new
    context = len(PROMPT) - 2 * PS
    logits = []
    for i, token in enumerate(new_tokens):
        out, cache = forward_nodonate(params, cache, step([token], context + i, pages, offset), CFG)
        logits.append(np.asarray(out[0]))
    return np.stack(logits)


def test_decoding_over_dropped_pages_equals_masked_full_attention(params):
    new_tokens = [11, 12, 13]
    tokens = PROMPT + new_tokens
    T, P = len(tokens), len(PROMPT)
    causal = np.tril(np.ones((T, T), bool))
    masked = causal.copy()
    masked[P:, PS : 3 * PS] = (
        False  # the new tokens do not see the dropped pages; the prompt saw them
    )
    want = np.asarray(dense_logits(params, tokens, np.arange(T), masked))[P:]
    got = decode_after_drop(params, new_tokens, offset=2 * PS)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # The check can tell: the positions the cache indices would give, or the dropped keys kept, differ.
    assert np.abs(decode_after_drop(params, new_tokens, offset=0) - want).max() > 1e-3
    assert (
        np.abs(np.asarray(dense_logits(params, tokens, np.arange(T), causal))[P:] - want).max()
        > 1e-3
    )


# -------------------------------------------------------------------------------- page scores


def reference_scores(queries, k_pages, context_len, num_listed):
    """Per-page softmax mass by hand: `queries` [L, H, hd], `k_pages` [L, pages, KVH, hd, PS]."""
    L, H, hd = queries.shape
    KVH = k_pages.shape[2]
    mass = np.zeros(num_listed)
    for layer in range(L):
        keys = np.concatenate(list(k_pages[layer]), axis=-1)[
            ..., :context_len
        ]  # [KVH, hd, context]
        for h in range(H):
            s = queries[layer, h] @ keys[h // (H // KVH)] / np.sqrt(hd)
            p = np.exp(s - s.max())
            p /= p.sum()
            for i in range(-(-context_len // PS)):
                mass[i] += p[i * PS : (i + 1) * PS].sum()
    return mass / (L * H)


@pytest.mark.parametrize(
    "page_dtype, dtype", [("auto", jnp.float32), ("int8", jnp.float32), ("auto", jnp.bfloat16)]
)
def test_page_attention_scores_match_a_softmax_by_hand(params, page_dtype, dtype):
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    cache = prefilled(params, page_dtype, dtype)
    batch = step(
        [PROMPT[-1]], len(PROMPT) - 1, PAGES, num_listed=len(PAGES) + 3
    )  # re-feed the last token
    scores = np.asarray(
        page_attention_scores_jit(unstack_layers(params), cache, batch, StepSpec(CFG))
    )
    assert scores.shape == (len(PAGES) + 3,) and scores.dtype == np.float32
    np.testing.assert_allclose(scores.sum(), 1.0, rtol=1e-6)
    assert np.all(scores[: len(PAGES)] > 0) and not np.any(
        scores[len(PAGES) :]
    )  # padding gets nothing

    _, _, queries = forward_nodonate(params, cache, batch, CFG, return_queries=True)
    k = np.asarray(cache.k[:, np.array(PAGES)])
    if page_dtype == "int8":
        k = k.astype(np.float32) * np.asarray(cache.k_scale[:, np.array(PAGES)])[:, :, :, None, :]
    elif k.dtype == np.uint16:  # bf16 pages hold their bits
        k = np.asarray(
            jax.lax.bitcast_convert_type(jnp.asarray(k), jnp.bfloat16).astype(jnp.float32)
        )
    want = reference_scores(
        np.asarray(queries[:, 0].astype(jnp.float32)), k, len(PROMPT) - 1, len(PAGES) + 3
    )
    np.testing.assert_allclose(scores, want, atol=1e-6, rtol=1e-5)


def test_return_queries_changes_nothing_else(params):
    cache = prefilled(params)
    batch = step([PROMPT[-1], 40, 41], len(PROMPT) - 1, PAGES)
    logits, new_cache = forward_nodonate(params, cache, batch, CFG, all_logits=True)
    logits_q, cache_q, queries = forward_nodonate(
        params, cache, batch, CFG, all_logits=True, return_queries=True
    )
    np.testing.assert_array_equal(logits_q, logits)
    for a, b in zip(jax.tree.leaves(cache_q), jax.tree.leaves(new_cache)):
        np.testing.assert_array_equal(a, b)
    assert queries.shape == (CFG.num_layers, 3, CFG.num_heads, CFG.head_dim)
    # Layer 0's queries are the post-RoPE projections of the normalized embeddings.
    w = jax.tree.map(lambda a: a[0], params["layers"])
    h = rms_norm(params["embed_tokens"][batch.tokens], w["input_layernorm"], CFG.rms_norm_eps)
    freqs = jnp.asarray(batch.positions, jnp.float32)[:, None] * rope_inv_freq(CFG)
    emb = jnp.concatenate([freqs, freqs], -1)
    q0 = apply_rope(
        (h @ w["q_proj"]["kernel"]).reshape(3, CFG.num_heads, CFG.head_dim),
        jnp.cos(emb),
        jnp.sin(emb),
    )
    np.testing.assert_allclose(queries[0], q0, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- the quality benchmark's loop


def test_benchmark_loop_equals_dense_attention_over_the_kept_tokens(params):
    """`benchmarks.quality.kv_compression_quality.evaluate` against the dense model with each position's
    visible tokens replayed from the policy (no cache, slots or position offsets), compiling
    its forward once for the whole text."""
    from benchmarks.quality.kv_compression_quality import evaluate
    from minivllm_jax.engine.step import forward_jit

    ids = np.random.default_rng(2).integers(3, CFG.vocab_size, 50).tolist()
    config = KVCompressionConfig("sink_window", sink_tokens=4, window_tokens=8)
    visible = np.tril(np.ones((len(ids), len(ids)), bool))
    pages = []  # the original page numbers the sequence holds
    for start in range(0, len(ids), PS):
        seen = np.zeros(len(ids), bool)
        for page in pages:
            seen[page * PS : (page + 1) * PS] = True
        visible[start : start + PS, :start] &= seen[:start]
        pages.append(start // PS)
        full = len(pages) - (min(start + PS, len(ids)) % PS > 0)  # the last page may be partial
        pages = [pages[i] for i in kept_pages(config, full, PS)] + pages[full:]
    logp = jax.nn.log_softmax(dense_logits(params, ids, np.arange(len(ids)), visible), axis=-1)
    nll = -np.asarray(logp)[np.arange(len(ids) - 1), ids[1:]]

    full_run = evaluate(unstack_layers(params), CFG, ids, None, page_size=PS, chunk=PS)
    compiled = forward_jit._cache_size()
    got = evaluate(
        unstack_layers(params),
        CFG,
        ids,
        config,
        page_size=PS,
        chunk=PS,
        reference_argmax=full_run["argmax"],
    )
    assert forward_jit._cache_size() == compiled  # the same program for every chunk and either run
    np.testing.assert_allclose(got["perplexity"], np.exp(nll.mean()), rtol=1e-5)
    assert got["argmax"] == np.asarray(logp).argmax(-1)[:-1].tolist()
    assert (
        got["kept_pages_max"] == 4
        and got["final_kept_tokens"] == 4 + 8 + 2
        and got["compressions"] == 9
    )
    assert got["kept_fraction"] < 1.0 and got["greedy_agreement"] < 1.0
    assert (
        full_run["greedy_agreement"] == 1.0
        and full_run["kept_fraction"] == 1.0
        and full_run["compressions"] == 0
    )
