"""Sampler: greedy/argmax, filters, seeding, distribution, logprobs and penalties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax.ops.sampler import (
    FILTER_K,
    Penalties,
    apply_penalties,
    make_sampling_arrays,
    sample,
)
from minivllm_jax.sampling_params import MAX_LOGPROBS
from minivllm_jax.sampling_params import SamplingParams as SP

V = 49_152  # the real vocab: exercises the chunked paths
sample_jit = jax.jit(sample)


def logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.RandomState(seed).randn(rows, vocab) * scale).astype(np.float32)


def draw(x: np.ndarray, rows: list[tuple], penalties: Penalties | None = None):
    """Rows are (params, seed, step) for sample 0 of a request, or (params, seed, index, step)."""
    rows = [r if len(r) == 4 else (r[0], r[1], 0, r[2]) for r in rows]
    return sample_jit(jnp.asarray(x), make_sampling_arrays(rows, x.shape[0], x.shape[1]), penalties)


@pytest.mark.parametrize("mixed", [False, True])  # all-greedy batches take a separate, cheaper path
def test_greedy_is_argmax_including_ties(mixed):
    x = logits(8)
    for i in range(2, 8):  # ties: the lower id wins, like np.argmax
        x[i, [7 * i, 40_000 + i]] = x[i].max() + 1.0
    rows = [(SP(temperature=0.0), i, i) for i in range(8)]
    if mixed:
        rows[0] = (SP(temperature=1.0), 0, 0)
    out = draw(x, rows)
    np.testing.assert_array_equal(out.tokens[1:], np.argmax(x, -1)[1:])
    assert np.asarray(out.tokens[2:]).tolist() == [7 * i for i in range(2, 8)]


@pytest.mark.parametrize(
    "params", [SP(temperature=100.0, top_k=1), SP(temperature=5.0, top_p=1e-6), SP(min_p=1.0)]
)
def test_filters_that_leave_only_the_top_token_are_greedy(params):
    x = logits(8, seed=1)
    out = draw(x, [(params, seed, 3) for seed in range(8)])
    np.testing.assert_array_equal(out.tokens, np.argmax(x, -1))


def test_seed_and_step_alone_fix_the_token():
    """Same (seed, step) -> same token whatever the batch mates, row position or batch size."""
    mates = [
        SP(temperature=1.0, top_p=0.999),
        SP(temperature=0.0),
        SP(top_k=500),
        SP(min_p=0.2, logprobs=3),
    ]
    cases = [
        (SP(temperature=0.8, top_p=0.9), 1.0),
        (SP(temperature=0.8, top_p=0.9), 5.0),
        (SP(temperature=1.2), 1.0),
    ]
    for me, scale in cases:  # a deep top-p cut, a cut inside the best FILTER_K, no cut
        x = logits(1, seed=2, scale=scale)[0]
        for seed in range(4):
            alone = int(draw(x[None], [(me, seed, 5)]).tokens[0])
            for pos, size in [(0, 4), (3, 4), (5, 8)]:
                rows = [(mates[i % len(mates)], 100 + i, i) for i in range(size)]
                rows[pos] = (me, seed, 5)
                batch = logits(size, seed=10 + seed, scale=1.0)
                batch[pos] = x
                assert int(draw(batch, rows).tokens[pos]) == alone, (me, seed, pos, size)


def test_different_seeds_and_steps_differ():
    x = np.zeros((64, 1000), np.float32)  # uniform: 64 draws should be mostly distinct
    by_seed = draw(x, [(SP(), seed, 0) for seed in range(64)]).tokens
    by_step = draw(x, [(SP(), 7, step) for step in range(64)]).tokens
    assert len(set(np.asarray(by_seed).tolist())) > 50
    assert len(set(np.asarray(by_step).tolist())) > 50


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(probs))
    expected = probs * len(tokens)
    assert counts[expected == 0].sum() == 0, "sampled a zero-probability token"
    nz = expected > 0
    return float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())


@pytest.mark.parametrize(
    "vocab,limit", [(8, 30.0), (200, 300.0)]
)  # ~p=1e-4 for df=7; mean+5sd for df=199
def test_frequencies_match_softmax(vocab, limit):
    base = np.random.RandomState(3).randn(vocab).astype(np.float32)
    n, t = 8192, 0.7
    tokens = draw(np.tile(base, (n, 1)), [(SP(temperature=t), seed, 0) for seed in range(n)]).tokens
    probs = np.exp(base / t - np.max(base / t))
    assert chi_square(np.asarray(tokens), probs / probs.sum()) < limit


def test_top_k_and_top_p_frequencies_are_renormalized():
    base = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0], np.float32)
    n = 8192
    p = (
        np.exp(base) / np.exp(base).sum()
    )  # top_k=4 keeps 4; top_p=0.75 keeps the first 3 (cum .42 .68 .84)
    for params, keep in [(SP(top_k=4), 4), (SP(top_p=0.75), 3), (SP(top_k=4, top_p=0.85), 3)]:
        tokens = draw(np.tile(base, (n, 1)), [(params, seed, 0) for seed in range(n)]).tokens
        want = np.where(np.arange(8) < keep, p, 0.0)
        assert chi_square(np.asarray(tokens), want / want.sum()) < 30.0, params


def allowed(x: np.ndarray, top_k: int, top_p: float) -> set[int]:
    order = np.argsort(-x, kind="stable")
    order = order[:top_k] if top_k > 0 else order
    p = np.exp(x[order] - x[order[0]])
    n = int(np.searchsorted(np.cumsum(p / p.sum()), top_p)) + 1
    return set(order[: n + 1].tolist())  # +1: slack for float rounding at the exact edge


CUTS = [
    (5, 1.0, 3.0),
    (1000, 1.0, 3.0),
    (-1, 0.9, 5.0),
    (-1, 0.8, 3.0),
    (-1, 0.5, 0.2),
    (300, 0.7, 0.2),
]


@pytest.mark.parametrize("top_k,top_p,scale", CUTS)
def test_top_k_top_p_stay_inside_the_allowed_set(top_k, top_p, scale):
    """Covers the fast cut (inside the best FILTER_K) and the bisection (deeper cuts)."""
    n = 256
    x = logits(1, seed=4, scale=scale)[0]
    ok = allowed(x, top_k, top_p)
    out = draw(np.tile(x, (n, 1)), [(SP(top_k=top_k, top_p=top_p), s, 0) for s in range(n)])
    tokens = set(np.asarray(out.tokens).tolist())
    assert tokens <= ok
    if len(ok) > 4 * FILTER_K:
        assert len(tokens) > FILTER_K  # the deep cut really keeps deep tokens


def test_logprobs():
    x = logits(4, vocab=16, seed=5)
    out = draw(x, [(SP(temperature=0.0, logprobs=5), 0, 0), (SP(logprobs=2), 1, 0), (SP(), 2, 0)])
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(x), -1))
    top = np.asarray(out.top_logprobs)
    assert top.shape == (4, MAX_LOGPROBS)
    assert np.all(np.diff(top[:, :16], axis=-1) <= 0)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[:, 16:], -1)
    np.testing.assert_allclose(
        jax.nn.logsumexp(out.top_logprobs, -1), 0.0, atol=1e-5
    )  # covers the whole vocab
    np.testing.assert_allclose(top[:, :16], np.sort(ref, -1)[:, ::-1], rtol=1e-5, atol=1e-5)
    assert out.tokens[0] == out.top_ids[0, 0] and out.logprobs[0] == out.top_logprobs[0, 0]
    np.testing.assert_allclose(
        out.logprobs, ref[np.arange(4), np.asarray(out.tokens)], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("vocab", [V, 32_001])  # 32_001: not a multiple of the chunk size
def test_big_vocab_argmax_and_logprobs_match_lax(vocab):
    x = logits(4, vocab, seed=6)
    x[1] = np.round(x[1])  # many ties across chunks: lower ids must still come first
    x[2] = -10.0
    x[2, [10, 30_000, 30_001]] = [
        5.0,
        9.0,
        5.0,
    ]  # the tie's lower id sits in the chunk with the lower max
    out = draw(x, [(SP(temperature=0.0, logprobs=20), i, 0) for i in range(4)])
    np.testing.assert_array_equal(out.tokens, np.argmax(x, -1))
    vals, ids = jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(x), -1), MAX_LOGPROBS)
    np.testing.assert_array_equal(out.top_ids, ids)
    np.testing.assert_allclose(out.top_logprobs, vals, rtol=1e-5, atol=1e-4)


def test_penalties_follow_hf_and_openai():
    x = np.array([[2.0, 1.5, -1.0, 0.5]], np.float32)
    counts = np.array([[3.0, 0.0, 1.0, 0.0]], np.float32)
    seen = np.array([[True, False, True, True]])
    a = make_sampling_arrays(
        [(SP(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), 0, 0, 0)], 1, 4
    )
    got = apply_penalties(jnp.asarray(x), a, Penalties(jnp.asarray(counts), jnp.asarray(seen)))
    want = [2.0 / 2 - 0.75 - 0.5, 1.5, -1.0 * 2 - 0.25 - 0.5, 0.5 / 2]
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-6)


def test_repetition_penalty_flips_greedy_choice():
    x = np.array([[3.0, 2.0, 0.0, -1.0]], np.float32)
    pen = Penalties(
        jnp.asarray([[1.0, 0, 0, 0]], jnp.float32), jnp.asarray([[True, False, False, False]])
    )
    assert int(draw(x, [(SP(temperature=0.0, repetition_penalty=1.2), 0, 0)], pen).tokens[0]) == 0
    assert int(draw(x, [(SP(temperature=0.0, repetition_penalty=2.0), 0, 0)], pen).tokens[0]) == 1
    neutral = draw(x, [(SP(temperature=0.0), 0, 0)], pen)  # default penalties change nothing
    assert int(neutral.tokens[0]) == int(draw(x, [(SP(temperature=0.0), 0, 0)]).tokens[0])


def test_make_sampling_arrays_pads_with_greedy_rows():
    a = make_sampling_arrays([(SP(temperature=0.5, top_k=3, logprobs=1), 2**40 + 5, 2, 9)], 4, 8)
    assert a.temperature.tolist() == [0.5, 0, 0, 0] and a.top_k.tolist() == [3, -1, -1, -1]
    assert a.seeds[0].tolist() == [2**8, 5] and a.steps.tolist() == [9, 0, 0, 0]
    assert a.sample_index.tolist() == [2, 0, 0, 0]
    assert a.want_logprobs.tolist() == [True, False, False, False]
    with pytest.raises(ValueError):
        make_sampling_arrays([(SP(), 0, 0, 0)] * 3, 2, 8)


def test_sample_index_gets_its_own_stream_not_the_next_seed():
    """Sample i of a request is keyed fold_in(key(seed), i): with seed s, sample 1 must not
    replay seed s+1's sample 0 (the old `seed + i` scheme did exactly that)."""
    x = np.zeros((64, 1000), np.float32)
    sample1 = draw(x, [(SP(), s, 1, step) for s in range(8) for step in range(8)]).tokens
    next_seed = draw(x, [(SP(), s + 1, 0, step) for s in range(8) for step in range(8)]).tokens
    assert np.mean(np.asarray(sample1) == np.asarray(next_seed)) < 0.1
    again = draw(x, [(SP(), s, 1, step) for s in range(8) for step in range(8)]).tokens
    np.testing.assert_array_equal(sample1, again)  # still a pure function of (seed, index, step)


def test_logprobs_are_raw_even_with_penalties():
    """OpenAI/vLLM report the model's log-softmax; penalties change the choice, not the report."""
    x = np.array([[3.0, 2.0, 0.0, -1.0]], np.float32)
    pen = Penalties(
        jnp.asarray([[1.0, 0, 0, 0]], jnp.float32), jnp.asarray([[True, False, False, False]])
    )
    out = draw(
        x,
        [(SP(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0, logprobs=4), 0, 0)],
        pen,
    )
    assert int(out.tokens[0]) == 1  # the penalty flipped the greedy choice...
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(x), -1))[0]
    np.testing.assert_allclose(float(out.logprobs[0]), ref[1], rtol=1e-6)  # ...but not its logprob
    assert np.asarray(out.top_ids)[0, :4].tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(np.asarray(out.top_logprobs)[0, :4], ref, rtol=1e-6)
