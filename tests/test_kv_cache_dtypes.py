"""KV page dtypes. int8 pages (`kv_cache_dtype="int8"`): what is stored, what it costs, and that
the engine on them keeps fp32's greedy choices on most positions while its results stay
independent of batching, chunking and the prefix cache (new tokens are attended as the cache
stores them). bfloat16/float16 models: pages stored as the values' bits, read back exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams
from minivllm_jax.args import EngineArgs
from minivllm_jax.ops.kv_cache import as_stored, init_kv_cache, kv_bytes_per_token, write_kv
from tests.conftest import tiny_model_config

CFG = tiny_model_config()


def test_write_kv_stores_int8_with_a_scale_per_token_and_head():
    """Each token's head vector comes back within half a quantization step (max |x| / 254),
    exactly as `as_stored` rounds it, and the scratch page and other slots are untouched."""
    rng = np.random.default_rng(0)
    cache = init_kv_cache(CFG, num_pages=6, page_size=4, dtype=jnp.float32, kv_cache_dtype="int8")
    assert cache.quantized and cache.k.dtype == cache.v.dtype == jnp.int8
    assert cache.k_scale.shape == cache.v_scale.shape == (2, 6, 2, 4)
    slots = np.array([4 * 2 + 1, 4 * 5 + 3, 4 * 3 + 0])  # (page 2, offset 1), (5, 3), (3, 0)
    new_k, new_v = (rng.standard_normal((2, 1, 3, 2, 16)).astype(np.float32) for _ in range(2))
    cache = write_kv(cache, jnp.asarray(new_k), jnp.asarray(new_v), jnp.asarray(slots[None]))
    for i, slot in enumerate(slots):
        page, off = divmod(int(slot), 4)
        k = (
            np.asarray(cache.k[:, page, :, :, off], np.float32)
            * np.asarray(cache.k_scale[:, page, :, off])[..., None]
        )
        v = (
            np.asarray(cache.v[:, page, :, off], np.float32)
            * np.asarray(cache.v_scale[:, page, :, off])[..., None]
        )
        for got, want in ((k, new_k[:, 0, i]), (v, new_v[:, 0, i])):
            step = np.abs(want).max(-1, keepdims=True) / 127.0
            assert np.all(np.abs(got - want) <= step / 2 + 1e-7)
            np.testing.assert_array_equal(got, np.asarray(as_stored(cache, jnp.asarray(want))))
    untouched = np.ones(6 * 4, bool)
    untouched[slots] = False
    assert (
        not np.asarray(cache.k)
        .reshape(2, 6, 2, 16, 4)
        .transpose(0, 1, 4, 2, 3)
        .reshape(2, 24, -1)[:, untouched]
        .any()
    )


def test_kv_bytes_per_token_counts_values_and_scales():
    f32 = kv_bytes_per_token(CFG, jnp.float32)
    int8 = kv_bytes_per_token(CFG, jnp.float32, "int8")
    assert f32 == 2 * 2 * 2 * 16 * 4 and int8 == 2 * 2 * 2 * (16 + 4)
    cache = init_kv_cache(CFG, num_pages=6, page_size=4, dtype=jnp.float32, kv_cache_dtype="int8")
    stored = sum(x.nbytes for x in (cache.k, cache.v, cache.k_scale, cache.v_scale))
    assert stored == int8 * 6 * 4


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_float_pages_hold_the_bits_of_the_values_written(dtype):
    rng = np.random.default_rng(1)
    cache = init_kv_cache(CFG, num_pages=6, page_size=4, dtype=dtype)
    assert cache.k.dtype == cache.v.dtype == jnp.uint16 and not cache.quantized
    new_k, new_v = (jnp.asarray(rng.standard_normal((2, 1, 2, 2, 16)), dtype) for _ in range(2))
    cache = write_kv(cache, new_k, new_v, jnp.asarray([[9, 22]]))  # (page 2, offset 1), (5, 2)
    got_k = jax.lax.bitcast_convert_type(
        cache.k[:, jnp.asarray([2, 5]), :, :, jnp.asarray([1, 2])], dtype
    )
    got_v = jax.lax.bitcast_convert_type(
        cache.v[:, jnp.asarray([2, 5]), :, jnp.asarray([1, 2])], dtype
    )
    np.testing.assert_array_equal(
        np.asarray(got_k, np.float32), np.asarray(new_k[:, 0].swapaxes(0, 1), np.float32)
    )
    np.testing.assert_array_equal(
        np.asarray(got_v, np.float32), np.asarray(new_v[:, 0].swapaxes(0, 1), np.float32)
    )


def test_bad_kv_cache_dtype_is_a_clear_error(tmp_path):
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype must be one of \('auto', 'int8'\), got 'fp8'"
    ):
        EngineArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(tmp_path / "not-loaded"), kv_cache_dtype="int4")  # refused before any loading


@pytest.fixture(scope="module")
def tiny_model(tiny_model_with_tokenizer):
    return str(tiny_model_with_tokenizer)


PROMPTS = [[3 + (7 * i + j) % 120 for j in range(5 + 11 * i)] for i in range(6)]  # 5..60 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _llm(model: str, kv_cache_dtype: str, **kw) -> LLM:
    args = dict(
        max_num_seqs=4, max_model_len=128, num_pages=64, max_num_batched_tokens=32, use_tqdm=False
    )
    return LLM(model, kv_cache_dtype=kv_cache_dtype, **{**args, **kw})


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_engine_on_int8_pages_agrees_with_fp32_and_is_invariant(tiny_model):
    """Greedy tokens on int8 pages equal fp32's on at least 90% of positions (a random tiny
    model's logits are close together; the bench reports SmolLM2's), with no program after
    warm-up; and they are the same alone or batched, with a 16- or 64-token step budget
    (different chunking) and with the prefix cache on or off."""
    fp32 = _tokens(_llm(tiny_model, "auto"), PROMPTS)
    llm = _llm(tiny_model, "int8")
    compiles = llm.engine.runner.num_compiles
    batched = _tokens(llm, PROMPTS)
    assert llm.engine.runner.num_compiles == compiles
    assert llm.engine.runner.cache.k.dtype == jnp.int8
    agree = np.mean([a == b for x, y in zip(fp32, batched) for a, b in zip(x, y)])
    assert agree >= 0.9, agree
    assert [_tokens(llm, [p])[0] for p in PROMPTS] == batched
    assert _tokens(llm, PROMPTS) == batched  # the second time the prompts hit the prefix cache
    assert _tokens(_llm(tiny_model, "int8", max_num_batched_tokens=16), PROMPTS) == batched
    assert (
        _tokens(
            _llm(tiny_model, "int8", max_num_batched_tokens=64, enable_prefix_caching=False),
            PROMPTS,
        )
        == batched
    )
    assert llm.engine.page_manager.num_free_pages == llm.engine.config.cache.num_pages - 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_engine_in_16_bit_floats_agrees_with_fp32(tiny_model, dtype):
    """A 16-bit model (weights, activations, pages) keeps fp32's greedy choice on at least 80% of
    positions of the random tiny model, and int8 pages work with it too. Not warmed up: 16-bit
    programs take XLA:CPU about 10 s each to compile, and warm-up covers every dtype alike (the
    int8 test above checks that nothing compiles after it)."""
    fp32 = _tokens(_llm(tiny_model, "auto"), PROMPTS)
    for kv in ("auto", "int8"):
        llm = _llm(tiny_model, kv, dtype=dtype, warmup=False)
        assert llm.engine.runner.cache.k.dtype == (jnp.uint16 if kv == "auto" else jnp.int8)
        got = _tokens(llm, PROMPTS)
        agree = np.mean([a == b for x, y in zip(fp32, got) for a, b in zip(x, y)])
        assert agree >= 0.8, (kv, agree)
