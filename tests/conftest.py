"""Shared fixtures: tiny random-weight HF Llama models saved to a tmp dir (no hub downloads)."""

from __future__ import annotations

import os

# Tests run on the CPU and must not grab all memory up front or warn about missing GPUs.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_llama(path, seed: int = 0, **overrides):
    """Save a random tiny `LlamaForCausalLM` to `path`; returns the torch model (eval, float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).eval()
    model.save_pretrained(path)
    return model


def save_tiny_tokenizer(path) -> None:
    """A word-level tokenizer over the tiny vocab (128 ids: `<unk>`, `<s>`, `</s>`, `w3`..`w127`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_LLAMA["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_model_with_tokenizer(tmp_path_factory):
    """A tiny random Llama folder with a tokenizer, so `LLM(path)` can serve it (benchmark smoke tests)."""
    path = tmp_path_factory.mktemp("tiny-with-tokenizer") / "tiny"
    make_tiny_llama(path)
    save_tiny_tokenizer(path)
    return path


@pytest.fixture
def tiny_llama_dir(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny")
    return tmp_path / "tiny", model
