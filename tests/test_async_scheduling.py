"""Async scheduling: step N+1 is dispatched before step N's tokens are read (they are fed back
on the device as placeholders). It must give exactly the outputs of the synchronous engine for
every sampling option, under preemption and prefix caching, with stops that waste a row; it
must free every page and compile nothing new; a step that fails while running (seen when its
tokens are read) fails only its own suspects."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams
from tests.conftest import TINY_LLAMA

VOCAB = TINY_LLAMA["vocab_size"]
NUM_PAGES = 24  # a 160-token sequence needs 20: this workload preempts
MARK = 99  # a prompt holding this token fails when its step is read


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def make_llm(path, async_scheduling: bool) -> LLM:
    return LLM(
        str(path),
        max_num_seqs=6,
        max_model_len=160,
        page_size=8,
        num_pages=NUM_PAGES,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
        use_tqdm=False,
    )


@pytest.fixture(scope="module")
def engines(tiny_model_with_tokenizer):
    return make_llm(tiny_model_with_tokenizer, True), make_llm(tiny_model_with_tokenizer, False)


SHARED = ids(1, 20)  # a prefix several prompts share (prefix-cache hits)
WORKLOAD = [
    (SHARED + ids(2, 5), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
    (
        SHARED + ids(3, 9),
        SamplingParams(
            temperature=0.8, top_p=0.9, top_k=20, seed=5, max_tokens=25, ignore_eos=True
        ),
    ),
    (ids(4, 50), SamplingParams(temperature=1.0, n=2, seed=9, max_tokens=20, ignore_eos=True)),
    (
        ids(5, 12),
        SamplingParams(
            temperature=0.7,
            seed=3,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
            max_tokens=28,
            ignore_eos=True,
        ),
    ),
    (ids(6, 7), SamplingParams(temperature=0.0, logprobs=2, max_tokens=15, ignore_eos=True)),
    (
        SHARED + ids(7, 3),
        SamplingParams(temperature=1.0, seed=11, stop_token_ids=list(range(3, 40)), max_tokens=40),
    ),
    (
        ids(8, 30),
        SamplingParams(temperature=1.0, seed=2, stop=["w5", "w6", "w7", "w8"], max_tokens=40),
    ),
    (ids(9, 64), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
]


def summary(outputs):
    return [
        [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs) for o in out.outputs]
        for out in outputs
    ]


def test_async_outputs_equal_sync(engines):
    fast, sync = engines
    placeholders = []
    prepare = fast.engine.runner.prepare

    def spy(batch):
        step = prepare(batch)
        placeholders.append(int((np.asarray(step.tokens) < 0).sum()))
        return step

    fast.engine.runner.prepare = spy
    try:
        compiles = fast.engine.stats().compiles, sync.engine.stats().compiles
        preemptions = fast.engine.scheduler.num_preemptions, sync.engine.scheduler.num_preemptions
        got = fast.generate([p for p, _ in WORKLOAD], [s for _, s in WORKLOAD], use_tqdm=False)
        want = sync.generate([p for p, _ in WORKLOAD], [s for _, s in WORKLOAD], use_tqdm=False)
    finally:
        fast.engine.runner.__dict__.pop("prepare", None)
    assert summary(got) == summary(want)
    assert sum(placeholders) > len(placeholders) // 2  # most steps fed tokens back on the device
    assert {o.finish_reason for out in got for o in out.outputs} == {"length", "stop"}
    assert fast.engine.scheduler.num_preemptions > preemptions[0]  # the workload did preempt
    assert sync.engine.scheduler.num_preemptions > preemptions[1]
    for llm, before in zip(engines, compiles):
        assert llm.engine.stats().compiles == before
        assert llm.engine.page_manager.num_free_pages == NUM_PAGES - 1
        assert llm.engine.requests == {} and not llm.engine.has_unfinished()


def test_streamed_outputs_never_show_placeholders(engines):
    fast, _ = engines
    engine = fast.engine
    engine.add_request(
        ids(12, 10), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), request_id="s"
    )
    seen = []
    while engine.has_unfinished():
        seen += [o.outputs[0].token_ids for o in engine.step() if o.request_id == "s"]
    assert all(t >= 0 for tokens in seen for t in tokens)
    assert [len(t) for t in seen] == list(range(1, 13))  # one more token per output, none skipped


def test_step_failing_while_running_fails_only_its_suspects(engines, monkeypatch):
    fast, sync = engines
    engine = fast.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    good = [ids(20 + i, 9 + 5 * i) for i in range(2)]
    expected = [o.outputs[0].token_ids for o in sync.generate(good, greedy, use_tqdm=False)]
    real_run, failed = engine.runner.run, []

    def run(batch):
        pending = real_run(batch)
        if (
            any(MARK in seq.prompt_token_ids for seq in batch.seqs[batch.num_decodes :])
            and not failed
        ):
            failed.append({s.request_id for s in batch.seqs})

            def fetch():
                raise RuntimeError("injected failure while running")

            return SimpleNamespace(fetch=fetch)
        return pending

    monkeypatch.setattr(engine.runner, "run", run)
    a, b = (engine.add_request(p, greedy) for p in good)
    done = {}
    for _ in range(3):  # a and b decode
        done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.add_request([MARK] + ids(30, 6), greedy, request_id="bad")
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert failed and {a, b, "bad"} <= failed[0]
    assert "injected failure while running" in done["bad"].error
    assert done[a].error is None and done[b].error is None
    assert [
        done[a].outputs[0].token_ids,
        done[b].outputs[0].token_ids,
    ] == expected  # recomputed, not lost
    assert engine.page_manager.num_free_pages == NUM_PAGES - 1
