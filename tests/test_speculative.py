"""Speculative decoding by n-gram prompt lookup: the proposer, the config, and the engine's
outputs with speculation equal to those without it (greedy and seeded sampling), with drafts
really verified and accepted; a chi-square test that sampled outputs keep the model's
distribution; pages freed and nothing compiled after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams
from minivllm_jax.config import SpeculativeConfig
from minivllm_jax.engine.decoding.speculative import accepted_length, propose_ngram
from tests.conftest import make_tiny_llama, save_tiny_tokenizer

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def test_propose_ngram_takes_the_longest_suffix_and_its_latest_occurrence():
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    assert propose_ngram([1, 2, 3, 4, 5, 9, 2, 3], cfg, 3) == [4, 5, 9]  # "2 3" occurred before
    assert propose_ngram([7, 3, 8, 1, 2, 3, 6, 2, 3], cfg, 3) == [
        6,
        2,
        3,
    ]  # the latest "2 3", not the first
    assert propose_ngram([5, 1, 2, 9, 1, 2, 7, 0, 1, 2], cfg, 2) == [7, 0]  # limited to max_tokens
    assert propose_ngram([4, 1, 2, 3, 8, 2, 3], cfg, 3) == [8, 2, 3]  # "2 3" beats a longer-ago "3"
    assert propose_ngram([1, 2, 3, 4], cfg, 3) == []  # nothing repeats
    strict = SpeculativeConfig(prompt_lookup_max=3, prompt_lookup_min=2)
    assert propose_ngram([1, 5, 6, 3], strict, 3) == [] and propose_ngram(
        [1, 3, 6, 1, 3], strict, 3
    ) == [6, 1, 3]
    assert propose_ngram([1, 2, 1], cfg, 0) == []


def test_accepted_length_counts_matching_draft_tokens_from_the_first():
    assert accepted_length([4, 5, 6], [4, 5, 7, 9]) == 2
    assert accepted_length([4, 5, 6], [3, 5, 6, 9]) == 0
    assert accepted_length([4, 5], [4, 5, 1]) == 2


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "eagle"}, "not supported"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min"),
        ({"method": "ngram", "draft_model": "x"}, "unknown speculative_config keys"),
        ({"num_speculative_tokens": 2}, "needs a 'method'"),
        ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ],
)
def test_bad_config_is_refused(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)


@pytest.fixture(scope="module")
def model_dir(tiny_model_with_tokenizer):
    return tiny_model_with_tokenizer


def _llm(path, spec=None, **kw) -> LLM:
    kw = {"max_num_seqs": 8, "max_model_len": 128, "max_num_batched_tokens": 32, **kw}
    return LLM(str(path), speculative_config=spec, use_tqdm=False, **kw)


# Repetitive prompts, so that lookups find drafts; every kind of request in one batch.
PROMPTS = [[3 + (j % (4 + i)) for j in range(12 + 3 * i)] for i in range(7)]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=25, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[40, 41, 42], ignore_eos=True),
    SamplingParams(temperature=1.0, seed=1, max_tokens=40, logprobs=2),
    SamplingParams(
        temperature=0.0, max_tokens=33, repetition_penalty=1.3, ignore_eos=True
    ),  # never speculates
    SamplingParams(temperature=0.0, max_tokens=1),
    SamplingParams(temperature=0.7, seed=9, n=2, max_tokens=20, stop=["w5 w6"], ignore_eos=True),
]


def _summary(outputs):
    return [
        [(c.token_ids, c.finish_reason, c.stop_reason, c.text, c.logprobs) for c in o.outputs]
        for o in outputs
    ]


def test_same_outputs_with_and_without_speculation(model_dir):
    expected = _summary(_llm(model_dir, warmup=False).generate(PROMPTS, PARAMS, use_tqdm=False))
    llm = _llm(model_dir, NGRAM)
    engine = llm.engine
    compiled, free = engine.stats().compiles, engine.page_manager.num_free_pages
    got = _summary(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    for want, have in zip(
        expected, got
    ):  # logprobs agree to float rounding: several tokens vs one a step
        assert [c[:4] for c in have] == [c[:4] for c in want]
        for w, h in zip(want, have):
            if w[4] is not None:
                for a, b in zip(w[4], h[4]):
                    assert a.keys() == b.keys() and np.allclose(
                        list(a.values()), list(b.values()), atol=1e-4
                    )
    assert (
        engine.stats().accepted_tokens > 0
        and engine.stats().draft_tokens > engine.stats().accepted_tokens
    )
    assert engine.stats().compiles == compiled  # the verify buckets are in the warm-up
    assert engine.page_manager.num_free_pages == free and sum(engine.page_manager.refcount) == 0


def test_speculation_backs_off_when_nothing_repeats(model_dir):
    """A sequence whose lookups miss stops looking for a while (so steps go back to async)."""
    llm = _llm(
        model_dir,
        {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 4,
        },
        warmup=False,
    )
    engine = llm.engine
    # Near-uniform samples over 128 tokens: a 4-gram practically never repeats.
    engine.add_request(
        list(range(3, 40)), SamplingParams(temperature=1.0, seed=0, max_tokens=40, ignore_eos=True)
    )
    engine.step()  # prefill
    seq = engine.scheduler.running[0]
    lookups = 0
    while engine.has_unfinished():
        lookups += engine.scheduler.wants_draft(seq) and not seq.is_finished
        engine.step()
    assert engine.stats().draft_tokens == 0 and 0 < lookups < 10 and seq.spec_backoff > 1


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size(model_dir):
    llm = _llm(model_dir, {**NGRAM, "disable_by_batch_size": 1}, warmup=False)
    engine, greedy = llm.engine, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in _llm(model_dir, warmup=False).generate(PROMPTS[:2], greedy, use_tqdm=False)
    ]
    assert [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    ] == expected
    assert engine.stats().draft_tokens == 0  # two ran together all along
    assert llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected[0]
    assert engine.stats().draft_tokens > 0  # alone, it speculates


def test_backoff_doubles_on_misses_and_resets_on_acceptance():
    from minivllm_jax.engine.decoding.speculative import MAX_BACKOFF
    from minivllm_jax.engine.scheduler import note_draft_result
    from minivllm_jax.engine.sequence import Sequence

    seq = Sequence("r", [1, 2], SamplingParams())
    waits = []
    for _ in range(9):
        note_draft_result(seq, 0)
        waits.append(seq.spec_resume_at - len(seq.output_token_ids))
    assert waits == [1, 2, 4, 8, 16, 32, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
    note_draft_result(seq, 2)
    assert seq.spec_backoff == 0


def _self_predicting_model(path):
    """A tiny Llama whose layers add nothing (o_proj and down_proj zero) and whose head is its
    embedding: the next token's distribution depends on the last token only and favours
    repeating it, so drafts of repeats are often, but not always, accepted."""
    import torch

    model = make_tiny_llama(path, tie_word_embeddings=True)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2.0)  # the repeat gets about 3/4 of the top-3 mass
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return model


def test_sampled_outputs_keep_the_model_distribution(tmp_path):
    """Chi-square over (first, second) output tokens of 1,200 seeded requests with top_k=3
    against the probabilities computed from the model: the second token is verified against
    a draft whenever the first repeats the prompt's token."""
    import torch
    from scipy.stats import chisquare

    path = tmp_path / "tiny"
    model = _self_predicting_model(path)
    prompt = [7] * 8
    llm = _llm(path, NGRAM, max_num_seqs=64, max_num_batched_tokens=256, warmup=False)
    n = 1200
    # max_tokens=3: a draft is only proposed for a token that is not the last one
    params = [
        SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True)
        for s in range(n)
    ]
    pairs = [
        tuple(o.outputs[0].token_ids[:2])
        for o in llm.generate([prompt] * n, params, use_tqdm=False)
    ]
    assert (
        llm.engine.stats().accepted_tokens > 100
        and llm.engine.stats().draft_tokens > llm.engine.stats().accepted_tokens
    )

    def top3(ids):  # the model's top-3 next tokens and their renormalized probabilities
        with torch.no_grad():
            p = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
        v, i = torch.topk(p, 3)
        return dict(zip(i.tolist(), (v / v.sum()).tolist()))

    expected = {
        (a, b): pa * pb for a, pa in top3(prompt).items() for b, pb in top3(prompt + [a]).items()
    }
    assert set(pairs) <= set(expected)
    observed = [pairs.count(pair) for pair in expected]
    assert chisquare(observed, [n * p for p in expected.values()]).pvalue > 0.001
