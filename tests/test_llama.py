"""Model math parity with HF transformers (PyTorch) on tiny random Llama configs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from convert import read_checkpoint
from minivllm_jax.batch import single_sequence_batch
from minivllm_jax.config import ModelConfig
from minivllm_jax.greedy import greedy_generate
from minivllm_jax.kv_cache import init_kv_cache
from minivllm_jax.models.llama import forward_jit
from tests.conftest import make_tiny_llama

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

VARIANTS = {
    "untied-gqa": dict(tie_word_embeddings=False, num_key_value_heads=2),
    "tied-mha": dict(tie_word_embeddings=True, num_key_value_heads=4),
    "attention-bias": dict(attention_bias=True, mlp_bias=True),
    "llama3-rope": dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "linear-rope-headdim": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, head_dim=32),
}


@pytest.fixture(params=sorted(VARIANTS), scope="module")
def variant(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_llama(path, seed=len(request.param), **VARIANTS[request.param])
    hf_config, params = read_checkpoint(path, progress=False)
    return hf, ModelConfig.from_hf(hf_config), params


def test_config_reads_variant(variant):
    hf, cfg, _ = variant
    assert cfg.num_layers == hf.config.num_hidden_layers
    assert cfg.num_kv_heads == hf.config.num_key_value_heads
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert cfg.head_dim == hf.config.head_dim


def test_full_sequence_logits_match_hf(variant):
    hf, cfg, params = variant
    ids = np.random.RandomState(0).randint(3, cfg.vocab_size, size=40)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None])).logits[0].numpy()
    cache = init_kv_cache(cfg, num_pages=12, page_size=4, dtype=jnp.float32)
    batch = single_sequence_batch(ids, 0, list(range(1, 11)), page_size=4)
    logits, _ = forward_jit(params, cache, batch, cfg, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=1e-4, rtol=0)


def test_incremental_decode_matches_full_forward(variant):
    """Prefill a prefix, then feed tokens one at a time through the paged cache."""
    hf, cfg, params = variant
    ids = np.random.RandomState(1).randint(3, cfg.vocab_size, size=24)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None])).logits[0].numpy()
    pages = [5, 2, 9, 3, 7, 4]  # deliberately out of order: the block table decides
    cache = init_kv_cache(cfg, num_pages=10, page_size=4, dtype=jnp.float32)
    logits, cache = forward_jit(params, cache, single_sequence_batch(ids[:13], 0, pages, 4), cfg)
    np.testing.assert_allclose(np.asarray(logits[0]), ref[12], atol=1e-4, rtol=0)
    for t in range(13, len(ids)):
        logits, cache = forward_jit(params, cache, single_sequence_batch(ids[t : t + 1], t, pages, 4), cfg)
        np.testing.assert_allclose(np.asarray(logits[0]), ref[t], atol=1e-4, rtol=0)


def test_greedy_32_tokens_match_hf_generate(variant):
    hf, cfg, params = variant
    prompt = np.random.RandomState(2).randint(3, cfg.vocab_size, size=11)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(prompt[None]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    expected = out[0, len(prompt) :].tolist()
    assert greedy_generate(params, cfg, prompt.tolist(), 32, page_size=4) == expected


def test_scratch_page_is_untouched_by_real_tokens(variant):
    _, cfg, params = variant
    cache = init_kv_cache(cfg, num_pages=4, page_size=4, dtype=jnp.float32)
    _, cache = forward_jit(params, cache, single_sequence_batch(np.arange(3, 10), 0, [2, 3], 4), cfg)
    assert float(jnp.abs(cache.k[:, 0]).max()) == 0.0
    assert float(jnp.abs(cache.k[:, 2]).max()) > 0.0


def test_ragged_decode_attention_equals_block_table_attention():
    """The flat page list (decode steps) and the padded block table give the same attention."""
    import jax

    from minivllm_jax.batch import StepBatch
    from minivllm_jax.kv_cache import KVCache
    from minivllm_jax.models.llama import paged_attention

    rng = np.random.default_rng(0)
    L, num_pages, kvh, ps, hd, heads = 2, 40, 2, 4, 8, 4
    context = np.array([1, 9, 0, 16, 23], np.int32)  # row 2 is a padded row (no past tokens)
    B = len(context)
    k, v = (rng.standard_normal((L, num_pages, kvh, *dims)).astype(np.float32) for dims in ((hd, ps), (ps, hd)))
    cache = KVCache(jnp.asarray(k), jnp.asarray(v))
    pages = rng.permutation(np.arange(1, num_pages))
    counts = -(-context // ps)
    table = np.zeros((B, counts.max() + 2), np.int32)  # wider than needed, as a bucket would be
    ids, owners, lens, used = [], [], [], 0
    for b, n in enumerate(counts):
        table[b, :n] = pages[used : used + n]
        ids += list(pages[used : used + n])
        owners += [b] * n
        lens += [min(ps, context[b] - j * ps) for j in range(n)]
        used += n
    pad = 3  # list padding: scratch page, length 0, owned by the last row
    ids, owners, lens = (np.array(x + [fill] * pad, np.int32) for x, fill in ((ids, 0), (owners, B - 1), (lens, 0)))
    q = jnp.asarray(rng.standard_normal((B, 1, heads, hd)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((B, 1, kvh, hd)), jnp.float32) for _ in range(2))
    zeros = np.zeros((B, 1), np.int32)
    common = dict(tokens=zeros, positions=zeros, slot_mapping=zeros, context_lens=context, query_lens=np.ones(B, np.int32))
    tabled = StepBatch(block_tables=table, **common)
    listed = StepBatch(block_tables=np.zeros((B, 0), np.int32), page_ids=ids, page_rows=owners, page_lens=lens, **common)
    for layer in range(L):
        want = jax.jit(paged_attention)(q, k_new, v_new, cache, jnp.int32(layer), tabled)
        got = jax.jit(paged_attention)(q, k_new, v_new, cache, jnp.int32(layer), listed)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
