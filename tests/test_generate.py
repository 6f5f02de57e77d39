"""The pure jitted `generate`: the engine's tokens and finish reasons for greedy and seeded rows,
stops inside the loop, one compiled program per bucket, clear errors on bad input.

Compiles dominate the time: every `generate` call here shares one bucket (4 rows, 17 to 32 prompt
tokens in all, 16 new tokens), so the file compiles its program once, and the engine runs the same 4
prompts with at most one row ending early, so it needs only its prefill and 4-row decode steps."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams, generate
from minivllm_jax.reference.functional import generate_tokens_jit
from tests.conftest import TINY_LLAMA

PROMPTS = [[5, 6, 7], list(range(10, 22)), [9], list(range(40, 47))]  # lengths 3, 12, 1, 7
NEW = 12


@pytest.fixture(scope="module")
def llm(tiny_model_with_tokenizer):
    return LLM(
        str(tiny_model_with_tokenizer),
        warmup=False,
        use_tqdm=False,
        max_num_seqs=8,
        max_model_len=128,
    )


def run(llm: LLM, prompts, sampling=None, **kw):
    return generate(llm.params, llm.model_config, prompts, NEW, sampling, **kw)


def engine(llm: LLM, prompts, sampling):
    return [r.outputs[0] for r in llm.generate(prompts, sampling, use_tqdm=False)]


def assert_same(ours, theirs):
    assert [(o.token_ids, o.finish_reason) for o in ours] == [
        (t.token_ids, t.finish_reason) for t in theirs
    ]


def test_greedy_matches_engine(llm):
    ours = run(llm, PROMPTS)
    assert_same(ours, engine(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW)))
    assert all(len(o.token_ids) == NEW and o.finish_reason == "length" for o in ours)  # no EOS here


def test_seeded_sampling_matches_engine(llm):
    sampling = [
        SamplingParams(
            temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=NEW, ignore_eos=True
        ),
        SamplingParams(
            temperature=1.0,
            min_p=0.05,
            seed=2,
            max_tokens=NEW,
            ignore_eos=True,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
        ),
        SamplingParams(
            temperature=0.0, max_tokens=NEW, ignore_eos=True
        ),  # greedy rows mix with sampled ones
        SamplingParams(temperature=1.2, top_k=5, seed=2**40 + 3, max_tokens=NEW, ignore_eos=True),
    ]
    assert_same(run(llm, PROMPTS, sampling), engine(llm, PROMPTS, sampling))


def test_unseeded_rows_take_seeds_from_key(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    ours = run(llm, PROMPTS, sp, key=jax.random.key(3))
    assert ours == run(llm, PROMPTS, sp, key=3)  # an int is a key's seed; a call is reproducible
    assert ours != run(llm, PROMPTS, sp, key=4)
    bits = np.asarray(jax.random.bits(jax.random.key(3), (len(PROMPTS), 2), np.uint32))
    seeded = [
        dataclasses.replace(sp, seed=(int(hi) & 0x7FFFFFFF) << 32 | int(lo)) for hi, lo in bits
    ]
    assert_same(ours, engine(llm, PROMPTS, seeded))  # the documented derivation


def test_stops(llm):
    greedy = [o.token_ids for o in run(llm, PROMPTS)]
    sampling = [
        SamplingParams(
            temperature=0.0, stop_token_ids=[greedy[0][3]]
        ),  # first occurrence ends the row
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.0),  # EOS (passed below) stops it
        SamplingParams(temperature=0.0, ignore_eos=True),  # the same EOS does not
    ]
    eos = [greedy[2][4], greedy[3][2]]
    ours = run(llm, PROMPTS, sampling, eos_token_ids=eos)
    cut = greedy[0].index(greedy[0][3]) + 1
    assert (
        ours[0].token_ids == greedy[0][:cut] and ours[0].finish_reason == "stop"
    )  # stop token included
    assert ours[1].token_ids == greedy[1][:5] and ours[1].finish_reason == "length"
    cut = min(i for i, t in enumerate(greedy[2]) if t in eos) + 1
    assert ours[2].token_ids == greedy[2][:cut] and ours[2].finish_reason == "stop"
    assert ours[3].token_ids == greedy[3] and ours[3].finish_reason == "length"
    # The engine agrees (one row ends early, so it runs only the steps it ran before).
    plain = SamplingParams(temperature=0.0, max_tokens=NEW)
    sampling = [dataclasses.replace(sampling[0], max_tokens=NEW), plain, plain, plain]
    assert_same(run(llm, PROMPTS, sampling), engine(llm, PROMPTS, sampling))


def test_one_program_per_bucket(llm):
    before = generate_tokens_jit._cache_size()
    a = run(llm, [[3, 4, 5, 6, 7], [7] * 9, [8, 9, 10, 11]])
    after_first = generate_tokens_jit._cache_size()
    sampled = SamplingParams(temperature=0.7, seed=1, max_tokens=3, ignore_eos=True)
    b = run(llm, [[3] * 14, [6, 5], [11] * 4, [12] * 10], sampled)
    assert after_first - before <= 1  # zero when an earlier test made this bucket's program
    assert (
        generate_tokens_jit._cache_size() == after_first
    )  # other lengths, sizes and settings: no new program
    assert len(a) == 3 and len(b) == 4 and all(len(o.token_ids) == 3 for o in b)


@pytest.mark.parametrize(
    "prompts, kw, match",
    [
        ([], {}, "at least one prompt"),
        ([[1, 2], []], {}, "no prompt may be empty"),
        ([[1, TINY_LLAMA["vocab_size"]]], {}, "token ids in"),
        ([[-1]], {}, "token ids in"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens"),
        ([[1] * 510], {}, "max_position_embeddings"),
        ([[1]], {"sampling": SamplingParams(stop=["w5"])}, "LLM.generate"),
        ([[1]], {"sampling": SamplingParams(temperature=1.0, n=2)}, "n > 1"),
        ([[1]], {"sampling": SamplingParams(logprobs=2)}, "logprobs"),
        ([[1], [2]], {"sampling": [SamplingParams()]}, "1 SamplingParams for 2 prompts"),
    ],
)
def test_bad_input(llm, prompts, kw, match):
    kw = {"max_new_tokens": NEW, **kw}
    with pytest.raises(ValueError, match=match):
        generate(llm.params, llm.model_config, prompts, **kw)
