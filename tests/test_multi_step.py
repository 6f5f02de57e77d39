"""Multi-step decode (`num_scheduler_steps=k`): k decode steps in one device program give the
same tokens, logprobs, finish reasons and text as one step at a time, and free every page."""

from __future__ import annotations

import pytest

from minivllm_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tiny_model_with_tokenizer):
    return tiny_model_with_tokenizer


def _llm(path, k: int, **kw) -> LLM:
    return LLM(
        str(path),
        max_num_seqs=8,
        max_model_len=96,
        max_num_batched_tokens=32,
        num_scheduler_steps=k,
        use_tqdm=False,
        **kw,
    )


PROMPTS = [[3 + (i * 7 + j) % 100 for j in range(5 + 3 * i)] for i in range(7)]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=25, ignore_eos=True),
    SamplingParams(
        temperature=0.0, max_tokens=40, stop_token_ids=[50, 60, 70, 80], ignore_eos=True
    ),
    SamplingParams(temperature=1.0, seed=1, max_tokens=40, logprobs=2),
    SamplingParams(
        temperature=0.0,
        max_tokens=33,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        ignore_eos=True,
    ),
    SamplingParams(temperature=0.0, max_tokens=1),
    SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=21, stop=["w9", "w11"]),
]


def _summary(outputs):
    return [
        [(c.token_ids, c.finish_reason, c.stop_reason, c.text, c.logprobs) for c in o.outputs]
        for o in outputs
    ]


@pytest.fixture(scope="module")
def single_step(model_dir):
    llm = _llm(model_dir, 1, warmup=False)
    return _summary(llm.generate(PROMPTS, PARAMS, use_tqdm=False))


@pytest.mark.parametrize("k", [4, 8])
def test_same_outputs_as_one_step_at_a_time(model_dir, single_step, k):
    llm = _llm(model_dir, k, warmup=k == 4)  # one warm-up shows every multi-step bucket is in it
    compiled = llm.engine.stats().compiles if k == 4 else None
    free = llm.engine.page_manager.num_free_pages
    assert _summary(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == single_step
    assert llm.engine.scheduler.num_multi_steps > 0  # the multi-step program really ran
    assert (
        compiled is None or llm.engine.stats().compiles == compiled
    )  # its buckets were all warmed up
    assert llm.engine.page_manager.num_free_pages == free  # pages written ahead are given back
    assert sum(llm.engine.page_manager.refcount) == 0


def test_stream_and_new_arrivals(model_dir):
    """Streams get their text in groups of up to k tokens; a request arriving while others run
    multi-step is still served the same tokens (multi-step pauses while it waits)."""
    llm = _llm(model_dir, 4, warmup=False)
    reference = _llm(model_dir, 1, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = "".join(llm.stream(PROMPTS[1], params))
    assert text == reference.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].text
    engine = llm.engine
    first = engine.add_request(PROMPTS[2], params)
    for _ in range(4):
        engine.step()
    second = engine.add_request(PROMPTS[3], params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    expected = reference.generate([PROMPTS[2], PROMPTS[3]], params, use_tqdm=False)
    assert [done[first], done[second]] == [o.outputs[0].token_ids for o in expected]


def test_rejects_bad_num_scheduler_steps(model_dir):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        _llm(model_dir, 0, warmup=False)
