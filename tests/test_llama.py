"""Model math parity with HF transformers (PyTorch) on tiny random Llama configs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from convert import read_checkpoint
from minivllm_jax.config import ModelConfig
from minivllm_jax.engine.step import StepSpec, forward_jit
from minivllm_jax.models.decoder import forward
from minivllm_jax.models.hf_config import config_from_hf
from minivllm_jax.models.params import ServingParams, init_params, unstack_layers
from minivllm_jax.ops.batch import single_sequence_batch
from minivllm_jax.ops.kv_cache import init_kv_cache
from minivllm_jax.reference.greedy import greedy_generate
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
    return hf, config_from_hf(hf_config), unstack_layers(params)  # as the runner holds them


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
    logits, cache = forward_jit(params, cache, batch, StepSpec(cfg), all_logits=True)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)


def test_per_layer_params_are_read_in_place():
    """The layer loop must not slice weights out of a stacked array: XLA copies such a slice on
    every step (about half of a batch-1 decode step on this CPU)."""
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=80,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    params = init_params(cfg, jax.random.PRNGKey(0))
    serving = unstack_layers(params)
    assert isinstance(serving, ServingParams) and len(serving.layers) == cfg.num_layers
    with pytest.raises(TypeError, match="takes stored params"):
        unstack_layers(serving)  # the types say which layout a function takes
    cache = init_kv_cache(cfg, num_pages=4, page_size=4, dtype=jnp.float32)
    batch = single_sequence_batch(np.arange(3, 6), 0, [1], 4)
    mlp_kernels = {"f32[48,80]", "f32[80,48]", "f32[48,160]"}  # shapes nothing else in the step has

    def weight_copies(model, p) -> int:  # instructions that compute a weight-shaped array
        hlo = jax.jit(model).lower(p, cache, batch).compile().as_text()
        ops = [line.split(" = ", 1)[1].split(" ", 1) for line in hlo.splitlines() if " = " in line]
        copies = ("fusion(", "slice(", "dynamic-slice(", "copy(")
        return sum(
            shape.split("{")[0] in mlp_kernels and rest.startswith(copies) for shape, rest in ops
        )

    # The check sees the copies that slicing the stacked layout inside the program makes.
    assert weight_copies(lambda p, c, b: forward(unstack_layers(p), c, b, cfg), params) > 0
    assert weight_copies(lambda p, c, b: forward(p, c, b, cfg), serving) == 0


def test_incremental_decode_matches_full_forward(variant):
    """Prefill a prefix, then feed tokens one at a time through the paged cache."""
    hf, cfg, params = variant
    ids = np.random.RandomState(1).randint(3, cfg.vocab_size, size=24)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None])).logits[0].numpy()
    pages = [5, 2, 9, 3, 7, 4]  # deliberately out of order: the block table decides
    cache = init_kv_cache(cfg, num_pages=10, page_size=4, dtype=jnp.float32)
    logits, cache = forward_jit(
        params, cache, single_sequence_batch(ids[:13], 0, pages, 4), StepSpec(cfg)
    )
    np.testing.assert_allclose(np.asarray(logits[0]), ref[12], atol=1e-4, rtol=0)
    for t in range(13, len(ids)):
        logits, cache = forward_jit(
            params, cache, single_sequence_batch(ids[t : t + 1], t, pages, 4), StepSpec(cfg)
        )
        np.testing.assert_allclose(np.asarray(logits[0]), ref[t], atol=1e-4, rtol=0)


def test_greedy_32_tokens_match_hf_generate(variant):
    hf, cfg, params = variant
    prompt = np.random.RandomState(2).randint(3, cfg.vocab_size, size=11)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(prompt[None]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = out[0, len(prompt) :].tolist()
    assert greedy_generate(params, cfg, prompt.tolist(), 32, page_size=4) == expected


def test_scratch_page_is_untouched_by_real_tokens(variant):
    _, cfg, params = variant
    cache = init_kv_cache(cfg, num_pages=4, page_size=4, dtype=jnp.float32)
    _, cache = forward_jit(
        params, cache, single_sequence_batch(np.arange(3, 10), 0, [2, 3], 4), StepSpec(cfg)
    )
    assert float(jnp.abs(cache.k[:, 0]).max()) == 0.0
    assert float(jnp.abs(cache.k[:, 2]).max()) > 0.0
