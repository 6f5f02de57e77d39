"""Weight-only quantization: error bounds of the schemes, exact int4 packing, the params policy
and memory, and the engine on quantized weights (greedy agreement with fp32, no recompiles)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams
from minivllm_jax.models.llama import init_params, unstack_layers
from minivllm_jax.quantization import (
    dequantize,
    pack_int4,
    param_bytes,
    quantize_int4,
    quantize_int8,
    quantize_params,
    unpack_int4,
)
from tests.conftest import make_tiny_llama, save_tiny_tokenizer


def test_int8_error_is_at_most_half_a_step_per_channel():
    w = np.random.default_rng(0).standard_normal((96, 40)).astype(np.float32) * np.linspace(0.01, 3, 40)
    p = quantize_int8(w)
    assert p["qweight"].dtype == np.int8 and p["scales"].shape == (40,)
    err = np.abs(np.asarray(dequantize(p)) - w)
    assert np.all(err <= np.asarray(p["scales"]) / 2 + 1e-6)
    assert np.abs(np.asarray(p["qweight"])).max() == 127  # each column's largest weight uses the full range


def test_int4_packing_round_trips_exactly():
    q = np.random.default_rng(1).integers(0, 16, (64, 24)).astype(np.uint8)
    packed = pack_int4(q)
    assert packed.shape == (32, 24) and packed.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(unpack_int4(jax.numpy.asarray(packed))), q)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step_per_group(group_size):
    w = np.random.default_rng(2).standard_normal((256, 16)).astype(np.float32)
    p = quantize_int4(w, group_size)
    assert p["qweight4"].shape == (128, 16) and p["scales"].shape == (256 // group_size, 16)
    err = np.abs(np.asarray(dequantize(p)) - w).reshape(256 // group_size, group_size, 16)
    assert np.all(err <= np.asarray(p["scales"])[:, None] / 2 + 1e-6)


def test_bad_schemes_and_shapes_are_refused():
    w = np.zeros((48, 8), np.float32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_int4(w, 16)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_int4(w, 32)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        quantize_params({"layers": ()}, "int3")


def test_policy_quantizes_every_projection_and_shrinks_them():
    from minivllm_jax.config import ModelConfig

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256)  # fmt: skip
    params = unstack_layers(init_params(cfg, jax.random.PRNGKey(0)))
    expected = {  # bytes of one [in, out] projection: weights, then scales (and int4's minimums)
        "int8": lambda n_in, n_out: n_in * n_out + 4 * n_out,
        "int4": lambda n_in, n_out: n_in * n_out // 2 + 2 * 4 * (n_in // 32) * n_out,
    }
    for scheme, size in expected.items():
        q = quantize_params(params, scheme)
        assert param_bytes(q["embed_tokens"]) == param_bytes(params["embed_tokens"])  # kept, per the policy
        for lp, qp in zip(params["layers"], q["layers"]):
            for name, proj in lp.items():
                if not (isinstance(proj, dict) and "kernel" in proj):
                    assert param_bytes(qp[name]) == param_bytes(proj)  # norms stay as they are
                    continue
                assert "kernel" not in qp[name]  # no full-precision copy
                assert param_bytes(qp[name]) == size(*proj["kernel"].shape) + param_bytes(proj.get("bias", ()))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant") / "tiny"
    make_tiny_llama(path)
    save_tiny_tokenizer(path)
    return str(path)


def _greedy(model: str, quantization: str | None):
    llm = LLM(model, quantization=quantization, max_num_seqs=2, max_model_len=128, num_pages=64,
              max_num_batched_tokens=32, use_tqdm=False)  # fmt: skip
    compiles = llm.engine.runner.num_compiles
    prompts = [[3 + (7 * i + j) % 120 for j in range(5 + 3 * i)] for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert llm.engine.runner.num_compiles == compiles  # quantized weights add no program after warm-up
    return [o.outputs[0].token_ids for o in outs]


def test_engine_int8_greedy_agrees_with_fp32_and_int4_runs(tiny_model):
    """int8 keeps the greedy choice on at least 90% of positions of a random tiny model (its
    logits are close together, so a real model does better); int4 generates the requested
    tokens through the same programs."""
    fp32 = _greedy(tiny_model, None)
    int8 = _greedy(tiny_model, "int8")
    agree = np.mean([a == b for x, y in zip(fp32, int8) for a, b in zip(x, y)])
    assert agree >= 0.9, agree
    int4 = _greedy(tiny_model, "int4")
    assert [len(x) for x in int4] == [24] * 6


def test_llm_refuses_an_unknown_quantization(tiny_model):
    with pytest.raises(ValueError, match="unknown quantization 'fp8'"):
        LLM(tiny_model, quantization="fp8", use_tqdm=False)
