"""Beam search (`LLM.beam_search`): the same hypotheses as HF `generate(num_beams=k)` (SmolLM2 and
a tiny random model), its beams ordinary engine requests whose rounds the prefix cache keeps to
about a page of prefill a beam, every page given back, bad input refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax import LLM, BeamSearchParams, SamplingParams
from minivllm_jax.engine.decoding.beam_search import MAX_BEAM_WIDTH, BeamSearchState
from minivllm_jax.engine.kv.pages import PageManager
from minivllm_jax.engine.sequence import Sequence
from minivllm_jax.ops.kv_cache import SCRATCH_PAGE, copy_pages, init_kv_cache
from tests.conftest import tiny_model_config

CFG = tiny_model_config()


def hf_beams(
    model, prompt: list[int], k: int, max_tokens: int, length_penalty: float, early_stopping
) -> list:
    """HF's k hypotheses, best first, each as (prompt + generated tokens, score)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices != -1).sum(-1).tolist()  # the rest of each row is padding
    return [
        (seq[: len(prompt) + n].tolist(), float(score))
        for seq, n, score in zip(out.sequences, lengths, out.sequences_scores)
    ]


def assert_same_as_hf(ours, ref) -> None:
    assert [s.tokens for s in ours.sequences] == [tokens for tokens, _ in ref]
    np.testing.assert_allclose(
        [s.score for s in ours.sequences], [score for _, score in ref], rtol=1e-3, atol=1e-4
    )


def assert_all_pages_free(llm: LLM) -> None:
    bm = llm.engine.page_manager
    assert bm.num_free_pages == bm.num_usable_pages
    assert not any(bm.refcount)


# ---------------------------------------------------------------- params, pages, copy-on-write


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(beam_width=0),
        dict(beam_width=11),
        dict(beam_width=2.0),
        dict(max_tokens=0),
        dict(length_penalty=float("nan")),
        dict(early_stopping="sometimes"),
    ],
)
def test_bad_params_raise(kwargs):
    with pytest.raises(ValueError):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 8, **kwargs})


def test_copy_pages_copies_only_dst_pages():
    """int8 pages: the values and both scales move (float pages: the engine test below)."""
    cache = init_kv_cache(CFG, 8, 4, jnp.float32, "int8")
    rng = np.random.default_rng(0)
    cache = jax.tree.map(lambda x: jnp.asarray((rng.random(x.shape) * 99).astype(x.dtype)), cache)
    src, dst = (
        np.array([3, 5, SCRATCH_PAGE]),
        np.array([6, 2, SCRATCH_PAGE]),
    )  # the last pair is padding
    out = jax.jit(copy_pages)(cache, src, dst)
    for before, after in zip(jax.tree.leaves(cache), jax.tree.leaves(out)):
        before, after = np.asarray(before), np.asarray(after)
        np.testing.assert_array_equal(after[:, [6, 2]], before[:, [3, 5]])
        keep = [p for p in range(8) if p not in (6, 2)]
        np.testing.assert_array_equal(
            after[:, keep], before[:, keep]
        )  # sources and other pages untouched


def test_fork_copy_on_write_shares_full_pages_and_copies_the_partial_one():
    bm = PageManager(num_pages=12, page_size=4)
    parent = Sequence("r", list(range(10)), SamplingParams())
    bm.allocate_slots(parent)
    parent.num_computed_tokens = 10  # pages: full, full, 2 tokens
    child = Sequence("r", list(range(10)), SamplingParams())
    src, dst = bm.fork_copy_on_write(parent, child)
    assert child.pages[:2] == parent.pages[:2] and bm.refcount[parent.pages[0]] == 2
    assert (src, dst) == (parent.pages[2], child.pages[2]) and dst not in parent.pages
    assert child.num_computed_tokens == 10 and bm.num_free_pages == 11 - 4
    parent.output_token_ids.append(1)
    parent.num_computed_tokens = 12  # every page full: nothing to copy
    other = Sequence("r", list(range(10)) + [1, 2], SamplingParams())
    assert bm.fork_copy_on_write(parent, other) is None and other.pages == parent.pages
    for seq in (parent, child, other):
        bm.free_pages(seq)
    assert bm.num_free_pages == 11 and not any(bm.refcount)


# ---------------------------------------------------------------- a tiny random model


@pytest.fixture(scope="module")
def tiny(tiny_model_with_tokenizer):
    """18 usable pages of 8 tokens (k=3 beams of up to 23 tokens: two prompts at a time), 4 rows a step."""
    import transformers

    path = str(tiny_model_with_tokenizer)
    llm = LLM(
        path,
        max_num_seqs=4,
        max_model_len=64,
        page_size=8,
        num_pages=19,
        warmup=False,
        use_tqdm=False,
    )
    return llm, transformers.AutoModelForCausalLM.from_pretrained(path).eval()


TINY_PROMPTS = [
    [5, 17, 33, 9, 12],
    [40, 41, 3, 77, 8, 9, 100, 4, 5, 6, 7],
    [90, 12],
    [64, 3, 3, 3, 3, 3, 3, 3, 3],
]


@pytest.mark.parametrize("k, length_penalty, early_stopping", [(3, 1.0, False), (2, 2.0, True)])
def test_tiny_matches_hf_batched_split_and_grouped(tiny, k, length_penalty, early_stopping):
    """Four prompts at once: 12 beams over 4-row steps, in groups whose pages fit, as HF gives
    each prompt alone; every page is free afterwards."""
    llm, hf = tiny
    params = BeamSearchParams(k, 12, length_penalty, early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in TINY_PROMPTS], params)
    for prompt, out in zip(TINY_PROMPTS, outs):
        assert_same_as_hf(out, hf_beams(hf, prompt, k, 12, length_penalty, early_stopping))
    assert_all_pages_free(llm)


def test_runner_copy_pages_copies_on_the_engine_cache(tiny):
    llm, _ = tiny
    runner = llm.engine.runner
    rng = np.random.default_rng(1)
    runner.cache = jax.tree.map(
        lambda x: jnp.asarray(rng.random(x.shape, np.float32)), runner.cache
    )
    before = [np.asarray(x) for x in jax.tree.leaves(runner.cache)]
    src, dst = (
        [1, 2, 3, 4, 5],
        [6, 7, 8, 9, 10],
    )  # more pairs than one call's arrays hold (max_num_seqs=4)
    runner.page_mover.copy_pages(src, dst)
    for old, new in zip(before, jax.tree.leaves(runner.cache)):
        new = np.asarray(new)
        np.testing.assert_array_equal(new[:, dst], old[:, src])
        np.testing.assert_array_equal(new[:, 11:], old[:, 11:])
        np.testing.assert_array_equal(new[:, :6], old[:, :6])
    llm.engine.page_manager.clear_cache()  # the prefix cache's pages no longer hold what it thinks


def test_refuses_busy_engine_and_bad_prompts(tiny):
    llm, _ = tiny
    request = llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="idle engine"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(2, 4))
    llm.engine.abort(request)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([list(range(3, 60))], BeamSearchParams(2, 16))
    with pytest.raises(ValueError, match="prompt"):
        llm.beam_search({"text": "w5 w6"}, BeamSearchParams(2, 4))
    with pytest.raises(ValueError):
        llm.beam_search([[5, 999]], BeamSearchParams(2, 4))  # token id out of the vocab
    llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False
    )  # may leave a wasted step in flight
    out = llm.beam_search(
        "w5 w6 w7", BeamSearchParams(2, 4, ignore_eos=True)
    )  # a text prompt, after a generate
    assert (
        len(out) == 1
        and len(out[0].sequences) == 2
        and all(len(s.tokens) == 3 + 4 for s in out[0].sequences)
    )
    assert_all_pages_free(llm)


def test_widest_beam_matches_hf_though_its_beams_do_not_fit_the_cache_at_once(tiny):
    """k = MAX_BEAM_WIDTH: 20 candidates a beam (all MAX_LOGPROBS), 10 beams of up to 2 pages each
    against 18 usable pages: the scheduler runs a round's requests as their pages allow."""
    llm, hf = tiny
    prompt = [5, 6, 7]
    out = llm.beam_search([prompt], BeamSearchParams(MAX_BEAM_WIDTH, 12))[0]
    assert_same_as_hf(out, hf_beams(hf, prompt, MAX_BEAM_WIDTH, 12, 1.0, False))
    assert_all_pages_free(llm)


def test_prefix_cache_keeps_a_round_to_about_a_page_of_prefill_a_beam(tiny, monkeypatch):
    """Each round's request (prompt + beam) finds every full page but its last in the prefix
    cache, so it prefills at most page_size tokens, not its whole length."""
    llm, _ = tiny
    engine = llm.engine
    lengths = []
    add_request = engine.add_request
    monkeypatch.setattr(
        engine,
        "add_request",
        lambda ids, *a, **kw: lengths.append(len(ids)) or add_request(ids, *a, **kw),
    )
    before = engine.stats().prompt_tokens
    prompt = [
        40,
        41,
        3,
        77,
        8,
        9,
        100,
        4,
        5,
        6,
        7,
        50,
        51,
        52,
        53,
        54,
        55,
        56,
        57,
        58,
    ]  # 2.5 pages of 8
    llm.beam_search([prompt], BeamSearchParams(2, 12, ignore_eos=True))
    prefilled = engine.stats().prompt_tokens - before
    page = engine.config.cache.page_size
    assert len(lengths) > 12  # 12 rounds, two beams after the first
    assert (
        prefilled <= sum(min(n, page) for n in lengths[1:]) + lengths[0]
    )  # the first round computes the prompt
    assert prefilled < sum(lengths) / 2
    assert_all_pages_free(llm)


def test_state_is_engine_free_and_ranks_as_hf():
    """`BeamSearchState` on hand-made log-probs (k=2, EOS=2): an EOS candidate in the top k ends a
    hypothesis scored by its length; the search stops once no running beam can beat the worst
    finished one."""
    state = BeamSearchState([9], BeamSearchParams(2, 8), frozenset({2}))
    lp = np.log
    assert state.num_candidates == 4 and state.beams() == [[9]]
    state.advance([{2: lp(0.5), 5: lp(0.3), 6: lp(0.1), 7: lp(0.05), 8: lp(0.05)}])
    assert [h[1] for h in state.finished] == [[9, 2]] and state.beams() == [[9, 5], [9, 6]]
    state.advance([{2: lp(0.9), 5: lp(0.1)}, {2: lp(0.9), 6: lp(0.1)}])
    assert state.done and [h[1] for h in state.finished] == [
        [9, 5, 2],
        [9, 2],
    ]  # log(.27) / 2 > log(.5) / 1
    out = state.hypotheses(lambda ids: " ".join(map(str, ids)), frozenset({2}))
    assert [(s.text, s.finish_reason) for s in out.sequences] == [("5", "stop"), ("", "stop")]
    np.testing.assert_allclose(out.sequences[0].score, (lp(0.3) + lp(0.9)) / 2, rtol=1e-5)
    with pytest.raises(RuntimeError):
        state.advance([{}])


# ---------------------------------------------------------------- SmolLM2 against HF


@pytest.fixture(scope="module")
def smollm2():
    """4 rows a step, the prefix cache on (as served): each round prefills a page or less a beam."""
    return LLM("smollm2-135m", max_num_seqs=4, max_model_len=256, warmup=False, use_tqdm=False)


def smollm2_prompts(llm: LLM) -> list[list[int]]:
    """Two plain prompts and a chat one whose beams end with EOS within the limit."""
    chat = llm.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    return [llm.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")] + [
        chat
    ]


def hf_beams_batched(
    model, prompts: list[list[int]], k: int, max_tokens: int, length_penalty: float, early_stopping
) -> list[list]:
    """`hf_beams` of every prompt in one left-padded batch (HF's beam search keeps each prompt's
    beams apart; one call costs about what one prompt does)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices != -1).sum(-1).tolist()
    rows = [
        (p + out.sequences[r, width : width + lengths[r]].tolist(), float(out.sequences_scores[r]))
        for r, p in enumerate(p for p in prompts for _ in range(k))
    ]
    return [rows[i * k : (i + 1) * k] for i in range(len(prompts))]


@pytest.mark.requires_smollm2
@pytest.mark.parametrize(
    "k, length_penalty, early_stopping",
    [(2, 1.0, False), (4, 1.0, True), (4, 2.0, False), (2, 0.5, "never")],
)
def test_smollm2_matches_hf_generate(smollm2, smollm2_hf, k, length_penalty, early_stopping):
    """All k hypotheses of each prompt, in order, token for token; the prompts run together."""
    import torch

    torch.set_num_threads(2)
    prompts = smollm2_prompts(smollm2)
    outs = smollm2.beam_search(prompts, BeamSearchParams(k, 16, length_penalty, early_stopping))
    for out, ref in zip(
        outs, hf_beams_batched(smollm2_hf, prompts, k, 16, length_penalty, early_stopping)
    ):
        assert_same_as_hf(out, ref)
    ended = [s for s in outs[-1].sequences if s.finish_reason == "stop"]
    assert (
        ended or length_penalty > 1
    )  # the EOS path was taken (a length penalty of 2 favours the long ones)
    for s in ended:
        assert s.tokens[-1] == 2 and s.text == smollm2.tokenizer.decode(
            s.tokens[len(prompts[-1]) : -1]
        )
    assert_all_pages_free(smollm2)
