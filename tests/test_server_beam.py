"""Beam search over HTTP (`use_beam_search`, vLLM's fields): the same hypotheses as `LLM.beam_search`
on both endpoints; its beams share the batch with other requests (a stream started beside it
makes progress, nothing waits for it); a cancelled search aborts its round and starts no other;
width and concurrent beams are capped; every combination it would silently ignore is a 400."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from minivllm_jax import LLM, BeamSearchParams, SamplingParams
from minivllm_jax.engine.decoding.beam_search import BeamSearchOutput
from server.app import create_app
from server.engine_loop import AsyncEngine, QueueFull
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    StreamRequest,
    parse_request,
)
from tests.conftest import make_tiny_llama, save_tiny_tokenizer
from tests.test_server_units import collect, params

C, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = [5, 17, 33, 9, 12]
MESSAGES = [{"role": "user", "content": "w7 w8 w9"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam") / "tiny"
    make_tiny_llama(path)
    save_tiny_tokenizer(
        path, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}w3"
    )
    return LLM(
        str(path),
        max_num_seqs=4,
        max_model_len=64,
        page_size=8,
        num_pages=48,
        enable_prefix_caching=False,
        warmup=False,
        use_tqdm=False,
    )


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def serve(llm, requests):
    """Start the app on `llm`, run `requests(client, state)`, stop the app; returns its result."""
    app = create_app(llm, model_name="tiny")
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://t") as client,
    ):
        return await requests(client, app.state.minivllm)


def beam(prompt, **kw) -> dict:
    return {"prompt": prompt, "use_beam_search": True, **kw}


def greedy(prompt, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def assert_same_as_llm(
    body: dict, ref: BeamSearchOutput, prompt_len: int, chat: bool = False
) -> None:
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(len(ref.sequences)))
    texts = [c["message"]["content"] if chat else c["text"] for c in choices]
    assert texts == [s.text for s in ref.sequences]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in ref.sequences]
    completion = sum(len(s.tokens) - prompt_len for s in ref.sequences)
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
    }


def test_both_endpoints_match_llm_beam_search(llm):
    chat_ids = llm.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True
    )
    chat_ids = list(
        chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    )  # as server/preprocess.py
    ref = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(3, 10, 0.5, "never"))[0]
    rest = llm.engine.config.max_model_len - len(
        chat_ids
    )  # chat without max_tokens: the rest of the context
    chat_ref = llm.beam_search(
        {"prompt_token_ids": chat_ids}, BeamSearchParams(2, rest, 2.0, True)
    )[0]

    async def requests(client, state):
        body = beam(
            PROMPT,
            n=3,
            best_of=3,
            max_tokens=10,
            length_penalty=0.5,
            early_stopping="never",
            temperature=0,
        )
        completion = await client.post(C, json=body)
        chat = await client.post(
            CHAT,
            json={
                "messages": MESSAGES,
                "use_beam_search": True,
                "n": 2,
                "length_penalty": 2.0,
                "early_stopping": True,
            },
        )
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
    assert too_long.status_code == 400 and (err["param"], err["code"]) == (
        "max_tokens",
        "context_length_exceeded",
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    assert in_flight == 0
    bm = llm.engine.page_manager
    assert bm.num_free_pages == bm.num_usable_pages


def test_a_stream_started_beside_a_beam_search_progresses_and_both_answer_as_alone(llm):
    """The search is admitted first; a stream started then gets its first token before the search
    ends (16 rounds, each at least a step, against a stream the scheduler admits within a step or
    two), and each answers as if it had run alone."""
    prompt, length = [40, 41, 3, 77, 8], 24
    greedy_params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
    alone = llm.generate([prompt], greedy_params)[0].outputs[0].token_ids
    ref = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(3, 16, ignore_eos=True))[0]

    async def requests(client, state):
        search = asyncio.ensure_future(
            client.post(C, json=beam(PROMPT, n=3, max_tokens=16, ignore_eos=True))
        )
        while state.engine.beam_rows == 0:  # admitted: its rounds are under way
            await asyncio.sleep(0.002)
        stream = await state.engine.add(prompt, greedy_params, "beside")
        search_done_at_first_token, last = None, None
        async for out in stream:
            if search_done_at_first_token is None and out.outputs[0].token_ids:
                search_done_at_first_token = search.done()
            last = out
        return search_done_at_first_token, last, await search, state.engine

    search_done_at_first_token, last, search, engine = run(serve(llm, requests))
    assert search_done_at_first_token is False
    assert last.outputs[0].token_ids == alone
    assert search.status_code == 200
    assert_same_as_llm(search.json(), ref, len(PROMPT))
    assert engine.num_in_flight == 0 and engine.beam_rows == 0


def gate_beam_rounds(llm, monkeypatch) -> tuple[threading.Event, threading.Event, list[str]]:
    """Make the tiny engine's first step holding a beam row wait for `release` (so a round is
    surely in flight), and record every request id added. Returns (in_round, release, added)."""
    in_round, release, added = threading.Event(), threading.Event(), []
    step, add_request = llm.engine.step, llm.engine.add_request

    def gated_step(*a, **kw):
        if not release.is_set() and any(rid.startswith("beam-") for rid in llm.engine.requests):
            in_round.set()
            release.wait(30)
        return step(*a, **kw)

    def logged_add(ids, p, **kw):
        added.append(kw["request_id"])
        return add_request(ids, p, **kw)

    monkeypatch.setattr(llm.engine, "step", gated_step)
    monkeypatch.setattr(llm.engine, "add_request", logged_add)
    return in_round, release, added


@pytest.fixture
def gated_engine(llm, monkeypatch):
    """An `AsyncEngine` on the tiny engine gated by `gate_beam_rounds`. Yields (engine, in_round,
    release, added)."""
    in_round, release, added = gate_beam_rounds(llm, monkeypatch)
    engine = AsyncEngine(llm.engine, max_beam_rows=4)
    engine.start()
    yield engine, in_round, release, added
    release.set()
    engine.stop()


def test_a_cancelled_search_aborts_its_round_and_starts_no_other(llm, gated_engine):
    """Cancelled (as the app cancels it when the client disconnects) while its first round is in
    the engine: that round's requests are aborted, no second round is added, its beam rows and
    queue slot are given back, and the engine serves on with every page free. Meanwhile a second
    search past `max_beam_rows` was a QueueFull (429)."""
    engine, in_round, release, added = gated_engine

    async def main():
        search = asyncio.ensure_future(
            engine.beam_search(PROMPT, BeamSearchParams(3, 16, ignore_eos=True))
        )
        assert await asyncio.to_thread(in_round.wait, 30)
        with pytest.raises(QueueFull, match="max_beam_rows"):
            await engine.beam_search(PROMPT, BeamSearchParams(2, 4))
        search.cancel()
        with pytest.raises(asyncio.CancelledError):
            await search
        rows_at_cancel = list(added)
        release.set()
        after = await engine.add(
            [5, 6, 7], params(4), "after"
        )  # its add runs after the round's aborts
        await collect(after)
        return rows_at_cancel

    rows_at_cancel = run(main())
    beam_rows = [rid for rid in added if rid.startswith("beam-")]
    assert (
        beam_rows == rows_at_cancel and len(beam_rows) == 1
    )  # round 0: the one beam of the prompt
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    assert engine.num_in_flight == 0 and engine.beam_rows == 0 and engine.alive
    bm = llm.engine.page_manager
    assert bm.num_free_pages == bm.num_usable_pages


def test_a_search_whose_client_left_never_holds_other_requests(llm):
    """A long request runs; a search arrives and its client leaves at once; a short request sent
    next finishes while the long one still runs (nothing waits for the engine to drain)."""

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            long = await engine.add([40, 41, 3], params(40), "long")
            search = asyncio.ensure_future(engine.beam_search(PROMPT, BeamSearchParams(2, 8)))
            await asyncio.sleep(0)  # submitted
            search.cancel()
            short = await engine.add([90, 12], params(3), "short")
            order = []

            async def finish(name, stream):
                await collect(stream)
                order.append(name)

            await asyncio.gather(finish("long", long), finish("short", short))
            with pytest.raises(asyncio.CancelledError):
                await search
            return order, engine.num_in_flight, engine.beam_rows
        finally:
            engine.stop()

    order, in_flight, rows = run(main())
    assert order == ["short", "long"] and in_flight == 0 and rows == 0
    assert not llm.engine.requests


# ---------------------------------------------------------------------- request validation


@pytest.mark.parametrize(
    "model, body, param",
    [
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
        (
            ChatCompletionRequest,
            {"stream": True, "stream_options": {"include_usage": True}},
            "stream",
        ),
        (StreamRequest, {}, "use_beam_search"),  # the WebSocket streams
    ],
)
def test_combinations_beam_search_would_ignore_are_400(model, body, param):
    base = {"messages": MESSAGES} if model is ChatCompletionRequest else {"prompt": "w5"}
    with pytest.raises(APIError) as e:
        parse_request(model, {**base, "use_beam_search": True, **body})
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_beam_search_params_follow_the_request():
    req = parse_request(
        CompletionRequest,
        {
            "prompt": "w5",
            "use_beam_search": True,
            "n": 4,
            "best_of": 4,
            "max_tokens": 9,
            "length_penalty": 0.5,
            "early_stopping": "never",
            "ignore_eos": True,
            "stop": [],
            "temperature": 1.0,
        },
    )
    assert req.beam_search_params(50) == BeamSearchParams(4, 9, 0.5, "never", True)
    chat = parse_request(
        ChatCompletionRequest, {"messages": MESSAGES, "use_beam_search": True, "temperature": 0}
    )
    assert chat.beam_search_params(50) == BeamSearchParams(1, 50)
    with pytest.raises(APIError) as e:
        parse_request(
            CompletionRequest, {"prompt": "w5", "use_beam_search": True, "n": 11}
        ).beam_search_params(50)
    assert e.value.param == "n" and "beam width" in e.value.message


def test_a_client_that_disconnects_cancels_its_search_over_http(llm, monkeypatch):
    """A real uvicorn on a loopback port: the client sends a beam search and closes its socket
    while the first round is in the engine; the app cancels the search (its beam rows are given
    back before the round may finish), the round's requests are aborted and no other round is
    added."""
    import socket
    import time

    import uvicorn

    in_round, release, added = gate_beam_rounds(llm, monkeypatch)

    def until(predicate, what: str) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    app = create_app(llm, model_name="tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        until(
            lambda: server.started and app.state.minivllm.engine is not None, "the server to start"
        )
        engine = app.state.minivllm.engine
        body = httpx.Request(
            "POST", "/", json=beam(PROMPT, n=3, max_tokens=16, ignore_eos=True)
        ).content
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(
            f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert in_round.wait(30)
        client.close()
        until(
            lambda: engine.beam_rows == 0, "the search to be cancelled"
        )  # while its round is still held
        release.set()
        until(
            lambda: not llm.engine.has_unfinished() and not llm.engine.requests,
            "the engine to go idle",
        )
        assert engine.num_in_flight == 0
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
    beam_rows = [rid for rid in added if rid.startswith("beam-")]
    assert len(beam_rows) == 1 and beam_rows[0].endswith(
        ".0.0"
    )  # round 0's one beam, and nothing after it
    bm = llm.engine.page_manager
    assert bm.num_free_pages == bm.num_usable_pages
