"""One prompt path: the library (`LLM.apply_chat_template`, `LLMEngine.tokenize`), the server
(`Preprocessor`) and the CLI (`python -m minivllm_jax`) all build prompt ids with
`minivllm_jax.prompts`, so the same conversation or text gives the same ids everywhere; and bad
sampling values raise `ParamError` naming their field. No model, no JAX work: a tiny tokenizer."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from minivllm_jax import LLM, prompts
from minivllm_jax.__main__ import prompt_ids as cli_prompt_ids
from minivllm_jax.engine.engine import LLMEngine
from minivllm_jax.sampling_params import ContextLengthError, ParamError, SamplingParams
from server.preprocess import Preprocessor
from server.protocol import APIError
from tests.conftest import save_tiny_tokenizer

# Writes the BOS itself, as real templates do: a chat prompt must hold exactly one.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w9{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "w3 w4"},
    {"role": "user", "content": "w5 w6 w7"},
    {"role": "assistant", "content": "w8"},
    {"role": "user", "content": "w10"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts")
    save_tiny_tokenizer(path, add_bos=True, chat_template=TEMPLATE)  # BOS added to text, too
    return AutoTokenizer.from_pretrained(str(path))


def server_ids(tokenizer, prompt) -> list[int]:
    pre = Preprocessor(tokenizer, max_model_len=64, max_token_bytes=8)
    try:
        if prompt and isinstance(prompt[0], dict):
            return asyncio.run(pre.chat(prompt))
        return asyncio.run(pre.encode(prompt))
    finally:
        pre.close()


def engine_ids(tokenizer, prompt) -> list[int]:
    engine = SimpleNamespace(tokenizer=tokenizer, model_config=SimpleNamespace(vocab_size=128))
    return LLMEngine.tokenize(engine, prompt)[1]


def test_library_server_and_cli_give_the_same_ids_for_a_chat(tokenizer, monkeypatch):
    rendered = []
    render = prompts.render_chat
    monkeypatch.setattr(
        prompts, "render_chat", lambda *a, **k: rendered.append(1) or render(*a, **k)
    )
    library = LLM.apply_chat_template(SimpleNamespace(tokenizer=tokenizer), MESSAGES)
    server = server_ids(tokenizer, MESSAGES)
    hf = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    hf = list(hf["input_ids"] if hasattr(hf, "keys") else hf)
    assert library == server == hf
    assert library[0] == tokenizer.bos_token_id and library.count(tokenizer.bos_token_id) == 1
    assert rendered == [1, 1]  # each went through `prompts.render_chat`
    user = [{"role": "user", "content": "w5 w6"}]
    cli = cli_prompt_ids(tokenizer, "w5 w6", raw=False)
    assert cli == LLM.apply_chat_template(SimpleNamespace(tokenizer=tokenizer), user)
    assert cli == server_ids(tokenizer, user) and len(rendered) == 5


def test_library_server_and_cli_give_the_same_ids_for_text(tokenizer):
    text = "w5 w6 w7"
    ids = prompts.encode_text(tokenizer, text)
    assert ids == [tokenizer.bos_token_id, 5, 6, 7]  # the tokenizer's own BOS rule
    assert engine_ids(tokenizer, text) == server_ids(tokenizer, text) == ids
    assert cli_prompt_ids(tokenizer, text, raw=True) == ids
    assert engine_ids(tokenizer, [5, 6]) == server_ids(tokenizer, [5, 6]) == [5, 6]


def test_bad_prompts_name_their_field(tokenizer):
    with pytest.raises(ParamError) as e:
        prompts.chat_ids(tokenizer, [])
    assert e.value.field == "messages"
    with pytest.raises(ParamError) as e:
        prompts.chat_ids(tokenizer, [{"role": "user"}])
    assert e.value.field == "messages" and "content" in str(e.value)
    with pytest.raises(ParamError) as e:
        engine_ids(tokenizer, [5, 128])
    assert e.value.field == "prompt" and "128" in str(e.value)
    with pytest.raises(ContextLengthError) as e:
        prompts.check_token_ids([5] * 65, 128, limit=64)
    assert e.value.field == "prompt"
    with pytest.raises(ContextLengthError) as e:  # refused from a prefix, not the whole text
        prompts.encode_text(tokenizer, "w5 " * 10_000, limit=64)
    assert e.value.field == "prompt" and "first" in str(e.value)
    with pytest.raises(APIError) as api:  # the server's 400 for it
        server_ids(tokenizer, "w5 " * 10_000)
    assert (api.value.status, api.value.param, api.value.code) == (
        400,
        "prompt",
        "context_length_exceeded",
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"n": 2, "temperature": 0.0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": -1}, "seed"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"kv_compression": {"no_such_key": 1}}, "kv_compression"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs"),
    ],
)
def test_sampling_params_errors_carry_their_field(kwargs, field):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and isinstance(e.value, ValueError)
    assert str(e.value).startswith(field)
    copy = pickle.loads(pickle.dumps(e.value))  # crosses process boundaries with its field
    assert (copy.field, str(copy)) == (field, str(e.value))


def test_the_edges_of_each_range_are_accepted():
    edges = SamplingParams(top_p=1.0, top_k=-1, temperature=0.0, max_tokens=1, logprobs=0, seed=0)
    assert edges.top_k == -1 and edges.logprobs == 0
