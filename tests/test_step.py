"""The fused device step (`minivllm_jax/engine/step.py`): sampling inside the step program and the
device-resident penalty history, which must equal what the host knows of every sequence
through chunking, prefix-cache hits, forks and preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm_jax import LLM, SamplingParams
from minivllm_jax.engine.engine import LLMEngine
from tests.conftest import TINY_LLAMA

VOCAB = TINY_LLAMA["vocab_size"]


@pytest.fixture(scope="module")
def llm(tiny_model_with_tokenizer):
    return LLM(
        str(tiny_model_with_tokenizer),
        max_num_seqs=4,
        max_model_len=160,
        page_size=16,
        num_pages=25,
        max_num_batched_tokens=48,
        use_tqdm=False,
    )


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def assert_history_matches_host(engine: LLMEngine) -> int:
    """Every running penalty sequence's device row equals its fed tokens; returns how many."""
    state = engine.runner.state.penalty_state
    seen, counts = np.asarray(state.seen), np.asarray(state.output_counts)
    checked = 0
    for seq in engine.scheduler.running:
        if seq.penalty_slot is None or not seq.penalty_loaded:
            continue
        fed = seq.token_ids[: seq.num_computed_tokens]
        want_seen = np.zeros(VOCAB, bool)
        want_seen[fed] = True
        want_counts = np.bincount(fed[len(seq.prompt_token_ids) :], minlength=VOCAB)
        np.testing.assert_array_equal(seen[seq.penalty_slot], want_seen, err_msg=repr(seq))
        np.testing.assert_array_equal(counts[seq.penalty_slot], want_counts, err_msg=repr(seq))
        checked += 1
    return checked


def test_penalty_history_follows_chunks_cache_hits_forks_and_preemption(llm):
    engine = llm.engine
    prefix = ids(1, 40)
    pen = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, ignore_eos=True)
    llm.generate(
        [prefix + ids(2, 3)], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False
    )  # cache it
    requests = [
        (
            prefix + ids(3, 30),
            SamplingParams(temperature=0.0, max_tokens=40, **pen),
        ),  # prefix-cache hit
        (
            ids(4, 100),
            SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=40, **pen),
        ),  # chunked, forked
        (
            ids(6, 60),
            SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
        ),  # no penalties
        (ids(7, 20), SamplingParams(temperature=0.8, seed=9, max_tokens=60, **pen)),
    ]
    preemptions = engine.scheduler.num_preemptions
    for prompt, params in requests:
        engine.add_request(prompt, params)
    checked = 0
    while engine.has_unfinished():
        engine.step()
        checked += assert_history_matches_host(engine)
    assert checked > 50
    assert engine.scheduler.num_preemptions > preemptions  # 24 pages are too few for all of them
    assert sorted(engine.scheduler.free_penalty_slots) == list(
        range(engine.config.scheduler.max_num_seqs)
    )
    assert engine.page_manager.num_free_pages == engine.page_manager.num_usable_pages


def test_greedy_repetition_penalty_matches_hf(llm, tiny_model_with_tokenizer):
    """HF's repetition penalty covers prompt and output tokens, as ours does."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(
        str(tiny_model_with_tokenizer), dtype=torch.float32
    ).eval()
    for seed in (11, 12):
        prompt = ids(seed, 50)
        ours = (
            llm.generate(
                [prompt],
                SamplingParams(
                    temperature=0.0, repetition_penalty=1.5, max_tokens=24, ignore_eos=True
                ),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .token_ids
        )
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=24,
                do_sample=False,
                repetition_penalty=1.5,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert ours == ref


def test_one_program_per_bucket_no_separate_sampler(llm):
    """The warm-up compiles one program per step shape plus the penalty-row loader, and a run
    mixing greedy, sampled, penalized and logprob rows compiles nothing more."""
    cfg = llm.engine.config
    assert llm.engine.stats().compiles == len(cfg.scheduler.step_shapes()) + 1
    before = llm.engine.stats().compiles
    llm.generate(
        [ids(20, 30), ids(21, 70)],
        [
            SamplingParams(temperature=0.0, logprobs=3, max_tokens=8),
            SamplingParams(temperature=1.0, frequency_penalty=1.0, max_tokens=8),
        ],
        use_tqdm=False,
    )
    assert llm.engine.stats().compiles == before
