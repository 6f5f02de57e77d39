"""Engine correctness on a tiny random model: BOS on text prompts, n > 1 samples sharing the
prompt's pages, per-sample seeds."""

from __future__ import annotations

import asyncio

import pytest

from minivllm_jax import LLM, SamplingParams
from minivllm_jax.engine.engine import LLMEngine
from tests.conftest import make_tiny_llama, save_tiny_tokenizer

PAGE = 16


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("bos") / "tiny"
    make_tiny_llama(path)
    # Adds BOS to text, like Llama-2/3; the chat template writes the BOS itself.
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    save_tiny_tokenizer(path, add_bos=True, chat_template=template)
    return LLM(
        str(path),
        max_num_seqs=8,
        max_model_len=192,
        page_size=PAGE,
        num_pages=96,
        max_num_batched_tokens=128,
        use_tqdm=False,
        warmup=False,  # compiles what it runs: no test here counts programs
    )


def test_text_prompts_get_bos_chat_gets_one_ids_are_taken_as_given(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    text, ids, chat = llm.generate(["w5 w6", [5, 6]], greedy, use_tqdm=False) + llm.chat(
        [{"role": "user", "content": "w7"}], greedy, use_tqdm=False
    )
    assert text.prompt_token_ids == [1, 5, 6]
    assert ids.prompt_token_ids == [5, 6]
    assert chat.prompt_token_ids == [1, 7]  # the template's BOS, and no second one


def test_server_preprocessor_follows_the_same_rule(llm):
    from server.preprocess import Preprocessor

    pre = Preprocessor(llm.tokenizer, 192, 8)
    try:
        assert asyncio.run(pre.encode("w5 w6")) == [1, 5, 6]
        assert asyncio.run(pre.encode([5, 6])) == [5, 6]
        assert asyncio.run(pre.chat([{"role": "user", "content": "w7"}])) == [1, 7]
    finally:
        pre.close()


def run_tracking_pages(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    """Generate by stepping the engine by hand; returns (output, most pages in use at once)."""
    rid = engine.add_request(prompt, params)
    peak, final = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
        peak = max(peak, engine.page_manager.num_usable_pages - engine.page_manager.num_free_pages)
    return final, peak


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_samples_prefill_the_prompt_once_and_share_its_pages(llm, prefix_caching):
    """n=4: pages in use = the prompt's full pages once + each sample's own pages, not 4x all,
    also without the prefix cache (sharing is a fork, not a lucky cache hit); every sample
    reads the shared pages right (top_k=1 makes each sample the greedy text)."""
    e = llm.engine
    config = e.config.replace(enable_prefix_caching=prefix_caching, max_num_batched_tokens=512)
    engine = LLMEngine(
        e.model_config, config, e.runner.params, llm.tokenizer, eos_token_ids=e.eos_token_ids
    )
    prompt = [3 + (i * 7) % 120 for i in range(100)]  # 6 full pages + 4 tokens
    params = SamplingParams(temperature=1.0, top_k=1, n=4, max_tokens=20, ignore_eos=True)
    out, peak = run_tracking_pages(engine, prompt, params)
    full = (len(prompt) - 1) // PAGE
    own = -(-(len(prompt) + 20) // PAGE) - full  # pages past the shared ones, per sample
    assert peak <= full + 4 * own
    # The prompt was computed once, plus under a page of tail per extra sample.
    assert engine.stats().prompt_tokens <= len(prompt) + 3 * PAGE
    single = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    assert [c.token_ids for c in out.outputs] == [single[0].outputs[0].token_ids] * 4
    assert engine.page_manager.num_free_pages == engine.page_manager.num_usable_pages


def test_sample_seeds_are_folded_not_added(llm):
    """seed=s, n=2: sample 0 equals seed=s alone; sample 1 is not seed=s+1's sample 0."""
    prompt = [3 + (i * 5) % 120 for i in range(40)]
    p = dict(temperature=1.0, max_tokens=24, ignore_eos=True)
    pair, alone, next_seed = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(seed=11, n=2, **p),
            SamplingParams(seed=11, **p),
            SamplingParams(seed=12, **p),
        ],
        use_tqdm=False,
    )
    assert pair.outputs[0].token_ids == alone.outputs[0].token_ids
    assert pair.outputs[1].token_ids != next_seed.outputs[0].token_ids
    assert pair.outputs[1].token_ids != pair.outputs[0].token_ids


def test_a_page_pool_smaller_than_one_sequence_is_refused(llm):
    """192 tokens in pages of 16 need 12 pages plus the scratch page: 12 pages cannot serve."""
    engine = llm.engine
    engine.config.replace(num_pages=13).check_model(engine.model_config)
    with pytest.raises(
        ValueError, match=r"num_pages=12 cannot hold one max_model_len=192 .*12 pages"
    ):
        engine.config.replace(num_pages=12).check_model(engine.model_config)
