"""Beam search over HTTP (`use_beam_search`, vLLM's fields): the same hypotheses as `LLM.beam_search`
on both endpoints, requests arriving meanwhile held until it is done and then served as alone,
and every combination it would silently ignore refused with a 400 naming the field."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from minivllm_jax import LLM, BeamSearchParams, SamplingParams
from minivllm_jax.beam_search import BeamSearchOutput, BeamSearchSequence
from server.app import create_app
from server.engine_loop import AsyncEngine, QueueFull, RequestFailed
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, StreamRequest, parse_request
from tests.conftest import make_tiny_llama, save_tiny_tokenizer
from tests.test_server_units import FakeEngine, collect, params

C, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = [5, 17, 33, 9, 12]
MESSAGES = [{"role": "user", "content": "w7 w8 w9"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam") / "tiny"
    make_tiny_llama(path)
    save_tiny_tokenizer(path, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}w3")
    return LLM(str(path), max_num_seqs=4, max_model_len=64, page_size=8, num_pages=48, enable_prefix_caching=False,
               warmup=False, use_tqdm=False)  # fmt: skip


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def serve(llm, requests):
    """Start the app on `llm`, run `requests(client, state)`, stop the app; returns its result."""
    app = create_app(llm, model_name="tiny")
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await requests(client, app.state.minivllm)


def beam(prompt, **kw) -> dict:
    return {"prompt": prompt, "use_beam_search": True, **kw}


def greedy(prompt, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def assert_same_as_llm(body: dict, ref: BeamSearchOutput, prompt_len: int, chat: bool = False) -> None:
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(len(ref.sequences)))
    texts = [c["message"]["content"] if chat else c["text"] for c in choices]
    assert texts == [s.text for s in ref.sequences]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in ref.sequences]
    completion = sum(len(s.tokens) - prompt_len for s in ref.sequences)
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": completion,
                             "total_tokens": prompt_len + completion}  # fmt: skip


def test_both_endpoints_match_llm_beam_search(llm):
    chat_ids = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)  # as server/preprocess.py
    ref = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(3, 10, 0.5, "never"))[0]
    rest = llm.engine.config.max_model_len - len(chat_ids)  # chat without max_tokens: the rest of the context
    chat_ref = llm.beam_search({"prompt_token_ids": chat_ids}, BeamSearchParams(2, rest, 2.0, True))[0]

    async def requests(client, state):
        body = beam(PROMPT, n=3, best_of=3, max_tokens=10, length_penalty=0.5, early_stopping="never", temperature=0)
        completion = await client.post(C, json=body)
        chat = await client.post(CHAT, json={"messages": MESSAGES, "use_beam_search": True, "n": 2,
                                              "length_penalty": 2.0, "early_stopping": True})  # fmt: skip
        too_wide = await client.post(C, json=beam(PROMPT, n=11))
        too_long = await client.post(C, json=beam(PROMPT, max_tokens=60))
        streamed = await client.post(C, json=beam(PROMPT, stream=True))
        return completion, chat, too_wide, too_long, streamed, state.engine.num_in_flight

    completion, chat, too_wide, too_long, streamed, in_flight = run(serve(llm, requests))
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    assert_same_as_llm(completion.json(), ref, len(PROMPT))
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert_same_as_llm(chat.json(), chat_ref, len(chat_ids), chat=True)
    assert too_wide.status_code == 400 and too_wide.json()["error"]["param"] == "n"
    assert "beam width" in too_wide.json()["error"]["message"]
    err = too_long.json()["error"]
    assert too_long.status_code == 400 and (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    assert in_flight == 0
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_usable_pages


def test_requests_sent_during_a_beam_search_are_served_as_alone(llm):
    """A long request runs when the search arrives (the search waits for it); two more arrive while
    the search waits or runs (they wait for it). All four answer as if each had run alone."""
    prompts = [[40, 41, 3, 77, 8], [90, 12, 6], [64, 3, 3, 9]]
    lengths = [40, 12, 12]
    alone = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].outputs[0].text
             for p, n in zip(prompts, lengths)]  # fmt: skip
    ref = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(3, 16, ignore_eos=True))[0]

    async def requests(client, state):
        first = asyncio.ensure_future(client.post(C, json=greedy(prompts[0], lengths[0])))
        while state.engine.stats.running < 1 and not first.done():
            await asyncio.sleep(0.002)
        search = asyncio.ensure_future(client.post(C, json=beam(PROMPT, n=3, max_tokens=16, ignore_eos=True)))
        while state.engine.num_in_flight < 2:
            await asyncio.sleep(0.002)
        later = [asyncio.ensure_future(client.post(C, json=greedy(p, n))) for p, n in zip(prompts[1:], lengths[1:])]
        return await asyncio.gather(first, search, *later)

    first, search, *later = run(serve(llm, requests))
    assert [r.status_code for r in (first, search, *later)] == [200] * 4
    assert [r.json()["choices"][0]["text"] for r in (first, *later)] == alone
    assert_same_as_llm(search.json(), ref, len(PROMPT))


# ---------------------------------------------------------------------- the engine loop, on a fake engine


def test_adds_wait_for_the_search_which_waits_for_running_requests(monkeypatch):
    """Order on the engine thread: the running request finishes, then the search runs alone, then
    the add that arrived meanwhile; errors go to the search's caller only and the loop serves on."""
    engine = FakeEngine()
    events = []
    add_request = engine.add_request

    def logged_add(ids, p, *, request_id):
        events.append(request_id)
        return add_request(ids, p, request_id=request_id)

    monkeypatch.setattr(engine, "add_request", logged_add)
    results = iter([ValueError("max_tokens too long"), KeyError("host bug"), None])

    def fake_search(eng, prompts, p):
        events.append(("search", eng.has_unfinished()))
        error = next(results)
        if error is not None:
            raise error
        return [BeamSearchOutput([BeamSearchSequence(prompts[0] + [7], -1.0, -1.0, "x", "length")])]

    monkeypatch.setattr("server.engine_loop.beam_search", fake_search)
    loop_engine = AsyncEngine(engine, max_queue=3)
    loop_engine.start()
    search = BeamSearchParams(1, 1)

    async def main():
        running = await loop_engine.add([1, 2], params(5), "running")
        bad = asyncio.ensure_future(loop_engine.beam_search([3], search))
        later = asyncio.ensure_future(loop_engine.add([1, 3], params(2), "later"))
        await asyncio.sleep(0)  # both are submitted, in this order
        with pytest.raises(QueueFull):
            await loop_engine.beam_search([5], search)
        with pytest.raises(ValueError, match="max_tokens"):
            await bad
        later = await later
        with pytest.raises(RequestFailed, match="host bug"):
            await loop_engine.beam_search([4], search)
        good = await loop_engine.beam_search([6], search)
        await asyncio.gather(collect(running), collect(later))
        return good

    good = run(main())
    assert good.sequences[0].tokens == [6, 7]
    assert events == ["running", ("search", False), "later", ("search", False), ("search", False)]
    assert loop_engine.alive and loop_engine.num_in_flight == 0
    loop_engine.stop()


# ---------------------------------------------------------------------- request validation


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, {"stream": True}, "stream"),
    (CompletionRequest, {"logprobs": 2}, "logprobs"),
    (CompletionRequest, {"stop": ["w5"]}, "stop"),
    (CompletionRequest, {"stop_token_ids": [7]}, "stop_token_ids"),
    (CompletionRequest, {"seed": 1}, "seed"),
    (CompletionRequest, {"temperature": 0.7}, "temperature"),
    (CompletionRequest, {"top_p": 0.9}, "top_p"),
    (CompletionRequest, {"repetition_penalty": 1.2}, "repetition_penalty"),
    (CompletionRequest, {"skip_special_tokens": False}, "skip_special_tokens"),
    (CompletionRequest, {"n": 3, "best_of": 4}, "best_of"),
    (CompletionRequest, {"n": 17}, "n"),
    (CompletionRequest, {"early_stopping": "sometimes"}, "early_stopping"),
    (CompletionRequest, {"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
    (ChatCompletionRequest, {"logprobs": True}, "logprobs"),
    (ChatCompletionRequest, {"stream": True, "stream_options": {"include_usage": True}}, "stream"),
    (StreamRequest, {}, "use_beam_search"),  # the WebSocket streams
])  # fmt: skip
def test_combinations_beam_search_would_ignore_are_400(model, body, param):
    base = {"messages": MESSAGES} if model is ChatCompletionRequest else {"prompt": "w5"}
    with pytest.raises(APIError) as e:
        parse_request(model, {**base, "use_beam_search": True, **body})
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_beam_search_params_follow_the_request():
    req = parse_request(CompletionRequest, {"prompt": "w5", "use_beam_search": True, "n": 4, "best_of": 4,
                                            "max_tokens": 9, "length_penalty": 0.5, "early_stopping": "never",
                                            "ignore_eos": True, "stop": [], "temperature": 1.0})  # fmt: skip
    assert req.beam_search_params(50) == BeamSearchParams(4, 9, 0.5, "never", True)
    chat = parse_request(ChatCompletionRequest, {"messages": MESSAGES, "use_beam_search": True, "temperature": 0})
    assert chat.beam_search_params(50) == BeamSearchParams(1, 50)
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, {"prompt": "w5", "use_beam_search": True, "n": 11}).beam_search_params(50)
    assert e.value.param == "n" and "beam width" in e.value.message
