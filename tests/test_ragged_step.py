"""The ragged step end to end on the tiny random Llama: every step mixes decodes and prompt
chunks, and a sequence's tokens do not depend on what else is in its steps (batch
invariance under mixed steps), greedy and seeded; the SLO-aware budget keeps decodes in every
step while a long prompt prefills; held admissions wait for `max_batch_wait_ms`."""

from __future__ import annotations

import time

import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams
from tests.conftest import TINY_LLAMA

VOCAB = TINY_LLAMA["vocab_size"]


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


@pytest.fixture(scope="module")
def llm(tiny_model_with_tokenizer):
    return LLM(
        str(tiny_model_with_tokenizer),
        max_num_seqs=8,
        max_model_len=320,
        page_size=16,
        num_pages=200,
        max_num_batched_tokens=64,
        use_tqdm=False,
    )


def run_with_traffic(llm, target_prompt, target_params, others):
    """Decode `target` while `others` (prompt, params, step to arrive at) join; returns its tokens
    and the steps it shared with prompt chunks."""
    engine = llm.engine
    batches = []
    run = engine.runner.run

    def recorded(batch):  # with the cached context of each prompt chunk, read before the step
        batches.append((batch, [s.num_computed_tokens for s in batch.seqs[batch.num_decodes :]]))
        return run(batch)

    engine.runner.run = recorded
    try:
        rid = engine.add_request(target_prompt, target_params)
        done, step, pending = None, 0, sorted(others, key=lambda o: o[2])
        while engine.has_unfinished():
            while pending and pending[0][2] <= step:
                prompt, params, _ = pending.pop(0)
                engine.add_request(prompt, params)
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    done = out
            step += 1
    finally:
        engine.runner.__dict__.pop("run", None)
    mixed = [
        (b, ctx)
        for b, ctx in batches
        if any(s.request_id == rid for s in b.seqs[: b.num_decodes]) and b.num_decodes < len(b.seqs)
    ]
    return done.outputs[0].token_ids, mixed


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=40, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_tokens_do_not_depend_on_mixed_step_mates(llm, params):
    prompt = ids(1, 30)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    before = llm.engine.stats().compiles
    others = [
        (
            ids(10 + i, n),
            SamplingParams(temperature=0.5, seed=i, max_tokens=12, ignore_eos=True),
            at,
        )
        for i, (n, at) in enumerate([(150, 2), (20, 3), (70, 5), (9, 5), (200, 12)])
    ]
    mixed_tokens, mixed = run_with_traffic(llm, prompt, params, others)
    assert len(mixed) >= 3  # it decoded beside prompt chunks, some of them chunk continuations
    assert any(c > 0 for _, ctx in mixed for c in ctx)
    assert mixed_tokens == alone
    assert llm.engine.stats().compiles == before


def test_streams_keep_decoding_while_a_long_prompt_prefills(llm):
    engine = llm.engine
    streams = [
        engine.add_request(
            ids(30 + i, 12), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        )
        for i in range(3)
    ]
    seen = set()
    while len(seen) < 3:
        seen |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    batches = []
    run = engine.runner.run
    engine.runner.run = lambda b: batches.append(b) or run(b)
    try:
        long_id = engine.add_request(
            ids(40, 250), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        )
        while not any(o.request_id == long_id and o.outputs[0].token_ids for o in engine.step()):
            pass
    finally:
        engine.runner.__dict__.pop("run", None)
    prompt_steps = [b for b in batches if b.num_decodes < len(b.seqs)]
    assert sum(b.num_tokens - b.num_decodes for b in prompt_steps) == 250
    # Every step decodes the three streams first (with async scheduling the last step recorded
    # is dispatched before the long prompt's first token is read: it decodes that one too).
    assert all(
        b.num_decodes >= 3 and {s.request_id for s in b.seqs[:3]} == set(streams) for b in batches
    )
    assert all(b.num_decodes == 3 for b in batches[:-1])
    while engine.has_unfinished():
        engine.step()


def test_held_admissions_wait_for_max_batch_wait(tiny_model_with_tokenizer):
    llm = LLM(
        str(tiny_model_with_tokenizer),
        max_num_seqs=4,
        max_model_len=128,
        page_size=16,
        num_pages=40,
        max_num_batched_tokens=64,
        max_batch_wait_ms=150,
        use_tqdm=False,
    )
    engine = llm.engine
    start = time.monotonic()
    engine.add_request(ids(50, 10), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert engine.step() == [] and not engine.scheduler.running  # held: nothing ran
    while not engine.step():
        pass
    assert time.monotonic() - start >= 0.15  # its first token came after the hold
    while engine.has_unfinished():
        engine.step()
