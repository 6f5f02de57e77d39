"""Fault isolation: a failed device step fails only the requests that brought prompt work into
it (its decodes run again; the engine rebuilds a lost KV cache and recomputes everyone else), the server ends just those streams with an error, a
crashed engine loop restarts within a budget, and a stream that is not read holds O(1)
outputs. The engine runs a tiny random Llama; faults are injected by wrapping `runner.run`."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from types import SimpleNamespace

import httpx
import jax
import pytest
from starlette.testclient import TestClient

from minivllm_jax import LLM, SamplingParams
from minivllm_jax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server.app import create_app
from server.engine_loop import AsyncEngine, RequestFailed, RequestStream
from tests.test_server_units import FakeEngine, FakeTokenizer, expected_text

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MARK = 99  # a prompt holding this token id hits the injected fault; no other prompt does
GOOD = [
    [3 + (7 * i + 5 * k) % 90 for i in range(n)] for k, n in enumerate((5, 20, 37))
]  # ids 3..92
LATE = [3 + (11 * i) % 89 for i in range(40)]
BAD = [MARK, 40, 41, 42]
NUM_PAGES = 64


@pytest.fixture(scope="module")
def llm(tiny_model_with_tokenizer):
    return LLM(
        str(tiny_model_with_tokenizer),
        max_num_seqs=4,
        max_model_len=128,
        num_pages=NUM_PAGES,
        use_tqdm=False,
        warmup=False,  # compiles what it runs: no test here counts programs
    )


def alone(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> RequestOutput:
    return llm.generate([prompt], params, use_tqdm=False)[0]


def inject_fault(
    engine, monkeypatch, *, lose_cache: bool = False, delay_s: float = 0.0
) -> list[SimpleNamespace]:
    """Make `runner.run` raise for any batch holding a MARK prompt (after deleting the donated
    cache buffers if `lose_cache`); returns each failed batch's request ids, the prompts that
    brought prompt work into it (the suspects), and how many sequences were running then."""
    real, failed = engine.runner.run, []

    def run(batch):
        time.sleep(delay_s)  # lets the server tests send requests while others decode
        if any(MARK in seq.prompt_token_ids for seq in batch.seqs):
            seqs = batch.seqs
            failed.append(
                SimpleNamespace(
                    ids={s.request_id for s in seqs},
                    running=len(engine.scheduler.running),
                    suspects=[s.prompt_token_ids for s in seqs[batch.num_decodes :]],
                )
            )
            if lose_cache:
                for leaf in jax.tree.leaves(engine.runner.cache):
                    leaf.delete()
            raise RuntimeError("injected device fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    return failed


def drain(engine, done: dict[str, RequestOutput], steps: int | None = None) -> None:
    """Step until nothing is left (or `steps` times), keeping each request's final output."""
    while engine.has_unfinished() and steps != 0:
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out
        steps = None if steps is None else steps - 1


# ---------------------------------------------------------------------- point 8: the engine


def test_failed_step_fails_only_its_batch(llm, monkeypatch):
    engine = llm.engine
    expected = [alone(llm, p).outputs[0].token_ids for p in GOOD]
    preemptions = engine.scheduler.num_preemptions
    failed = inject_fault(engine, monkeypatch)

    a, b = engine.add_request(GOOD[0], GREEDY), engine.add_request(GOOD[1], GREEDY)
    done: dict[str, RequestOutput] = {}
    drain(engine, done, steps=3)  # a and b are decoding now
    # n=2 (every sample of a request fails together); c queues behind it and may share its batch.
    engine.add_request(
        BAD, SamplingParams(temperature=1.0, n=2, max_tokens=8, seed=1), request_id="bad"
    )
    c = engine.add_request(GOOD[2], GREEDY)
    drain(engine, done)

    # The failed steps also carried a's and b's decodes (every step does): they ran again.
    assert {a, b} <= set().union(*(f.ids for f in failed))
    in_failed = {rid for rid, out in done.items() if out.error is not None}
    assert "bad" in in_failed and not {a, b} & in_failed
    for rid, out in done.items():
        if rid in in_failed:
            assert out.finished and "injected device fault" in out.error
            assert [o.finish_reason for o in out.outputs] == ["error"] * len(out.outputs)
        else:
            assert out.error is None
    assert len(done["bad"].outputs) == 2
    for rid, want in zip((a, b, c), expected):
        if rid not in in_failed:
            assert done[rid].outputs[0].token_ids == want
    assert engine.requests == {} and not engine.has_unfinished()
    assert engine.page_manager.num_free_pages == NUM_PAGES - 1
    assert engine.scheduler.num_preemptions == preemptions  # the cache survived: nobody recomputed
    assert alone(llm, GOOD[2]).outputs[0].token_ids == expected[2]  # the engine still serves


def test_lost_cache_is_rebuilt_and_others_recomputed(llm, monkeypatch):
    engine = llm.engine
    expected = [
        alone(llm, p).outputs[0].token_ids for p in GOOD[1:]
    ]  # their prefix pages are cached now
    late = alone(llm, LATE)
    preemptions = engine.scheduler.num_preemptions
    failed = inject_fault(engine, monkeypatch, lose_cache=True)

    a, b = (engine.add_request(p, GREEDY) for p in GOOD[1:])
    done: dict[str, RequestOutput] = {}
    drain(engine, done, steps=4)  # both hold KV in the cache that is about to be lost
    engine.add_request(BAD, GREEDY, request_id="bad")
    drain(engine, done)

    assert len(failed) == 1 and failed[0].ids == {
        a,
        b,
        "bad",
    }  # the step carried a's and b's decodes
    assert {rid for rid, out in done.items() if out.error is not None} == {"bad"}
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(engine.runner.cache))
    assert engine.scheduler.num_preemptions == preemptions + 2  # a and b were recomputed
    assert [done[a].outputs[0].token_ids, done[b].outputs[0].token_ids] == expected
    again = alone(llm, LATE)  # its pages lost their cached hash with the old cache
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == late.outputs[0].token_ids
    assert engine.page_manager.num_free_pages == NUM_PAGES - 1


def test_host_error_propagates_and_recover_clears_the_engine(llm, monkeypatch):
    engine = llm.engine
    expected = alone(llm, GOOD[0]).outputs[0].token_ids
    engine.add_request(GOOD[0], GREEDY)
    engine.add_request(GOOD[1], GREEDY)
    drain(engine, {}, steps=2)

    def broken(*args):
        raise KeyError("scheduler bug")

    monkeypatch.setattr(engine.step_update, "apply", broken)
    with pytest.raises(KeyError, match="scheduler bug"):  # only device steps are isolated
        engine.step()
    monkeypatch.undo()
    engine.recover()
    assert engine.requests == {} and not engine.has_unfinished()
    assert engine.page_manager.num_free_pages == NUM_PAGES - 1
    assert alone(llm, GOOD[0]).outputs[0].token_ids == expected


# ---------------------------------------------------------------------- point 8: the server


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse_payloads(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.split("\n") if line.startswith("data: ")]


def completion(prompt: list[int], max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def test_server_failed_step_errors_only_its_streams(llm, monkeypatch):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=60)
    expected = [alone(llm, p, params).outputs[0].text for p in GOOD]
    failed = inject_fault(engine, monkeypatch, delay_s=0.003)
    app = create_app(llm, model_name="tiny")
    state = app.state.minivllm

    async def main():
        async with app.router.lifespan_context(app), client_for(app) as client:
            goods = [
                asyncio.ensure_future(client.post("/v1/completions", json=completion(p, 60)))
                for p in GOOD
            ]
            while state.engine.stats.running < len(GOOD):  # all three decoding
                await asyncio.sleep(0.002)
            bad = await client.post("/v1/completions", json=completion(BAD, 8))
            bad_stream = await client.post("/v1/completions", json=completion(BAD, 8, stream=True))
            good_outs = await asyncio.gather(*goods)
            health = await client.get("/health")
            late = await client.post("/v1/completions", json=completion(GOOD[0], 60))
            return bad, bad_stream, good_outs, health, late

    bad, bad_stream, good_outs, health, late = run(main())
    assert failed and all(
        MARK in p for f in failed for p in f.suspects
    )  # no good prompt in a failed step
    assert failed[0].running > len(GOOD)  # the goods were decoding when the fault hit
    assert bad.status_code == 500
    assert (
        bad.json()["error"]["type"] == "server_error"
        and bad.json()["error"]["code"] == "engine_step_failed"
    )
    events = sse_payloads(bad_stream.text)
    assert (
        events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_step_failed"
    )
    assert [r.json()["choices"][0]["text"] for r in good_outs] == expected
    assert health.status_code == 200
    assert late.status_code == 200 and late.json()["choices"][0]["text"] == expected[0]
    assert engine.page_manager.num_free_pages == NUM_PAGES - 1


def test_server_restarts_a_crashed_engine_loop(llm, monkeypatch):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20)
    expected = alone(llm, GOOD[1], params).outputs[0].text
    real_process, crashes = engine.step_update.apply, []

    def process_crashing_once(step, result, *args):
        if not crashes and len(engine.requests) == 2:  # both requests are in flight
            crashes.append(len(step.batch.seqs))
            raise KeyError("host bug")  # not from the runner: it escapes step()
        return real_process(step, result, *args)

    monkeypatch.setattr(engine.step_update, "apply", process_crashing_once)
    inject_fault(engine, monkeypatch, delay_s=0.003)  # no MARK prompt here: only slows steps down
    app = create_app(llm, model_name="tiny")
    state = app.state.minivllm

    async def main():
        async with app.router.lifespan_context(app), client_for(app) as client:
            in_flight = await asyncio.gather(
                client.post("/v1/completions", json=completion(GOOD[0], 60)),
                client.post("/v1/completions", json=completion(GOOD[2], 60, stream=True)),
            )
            health = await client.get("/health")
            later = await client.post("/v1/completions", json=completion(GOOD[1], 20))
            return in_flight, health, later

    (plain, streamed), health, later = run(main())
    assert crashes and len(state.engine.restarts) == 1
    assert plain.status_code == 503 and "host bug" in plain.json()["error"]["message"]
    events = sse_payloads(streamed.text)
    assert (
        events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_unavailable"
    )
    assert health.status_code == 200
    assert later.status_code == 200 and later.json()["choices"][0]["text"] == expected
    assert engine.requests == {} and engine.page_manager.num_free_pages == NUM_PAGES - 1


def test_engine_loop_stays_down_after_too_many_crashes():
    llm = SimpleNamespace(engine=FakeEngine(), tokenizer=FakeTokenizer())
    llm.engine.crash = True  # every step raises
    app = create_app(llm, model_name="fake")
    state = app.state.minivllm

    async def main():
        async with app.router.lifespan_context(app), client_for(app) as client:
            for attempt in range(state.engine.max_restarts):
                r = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
                assert r.status_code == 503 and "device on fire" in r.json()["error"]["message"]
                assert (await client.get("/health")).status_code == 200, (
                    f"not restarted after crash {attempt + 1}"
                )
            r = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
            assert r.status_code == 503  # one crash too many
            await asyncio.sleep(0.1)
            assert (await client.get("/health")).status_code == 503
            r = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"

    run(main())
    assert not state.engine.alive and len(state.engine.restarts) == state.engine.max_restarts


class FaultyFakeEngine(FakeEngine):
    """Reports a failed step for any request whose prompt holds MARK, as `LLMEngine` does."""

    def step(self):
        failed = [
            RequestOutput(
                rid,
                None,
                ids,
                [CompletionOutput(i, "", [], None, None, "error") for i in range(len(outs))],
                True,
                RequestMetrics(0.0),
                error="RuntimeError: injected",
            )
            for rid, (ids, _, outs) in self.requests.items()
            if MARK in ids
        ]
        for out in failed:
            del self.requests[out.request_id]
        return failed + super().step()


def test_websocket_gets_an_error_for_a_failed_step_and_keeps_serving():
    app = create_app(
        SimpleNamespace(engine=FaultyFakeEngine(), tokenizer=FakeTokenizer()), model_name="fake"
    )
    with TestClient(app) as client, client.websocket_connect("/v1/stream") as ws:
        ws.send_json({"prompt": "a" + chr(MARK), "max_tokens": 3})
        error = ws.receive_json()
        assert (
            error["type"] == "error"
            and error["status"] == 500
            and error["code"] == "engine_step_failed"
        )
        ws.send_json({"prompt": "ab", "max_tokens": 3})
        messages = []
        while not messages or messages[-1]["type"] == "token":
            messages.append(ws.receive_json())
        assert messages[-1]["type"] == "done" and messages[-1]["finish_reason"] == "length"
        assert "".join(m["text"] for m in messages[:-1]) == expected_text("ab", 3)
        assert client.get("/health").status_code == 200


# ---------------------------------------------------------------------- point 9: bounded streams


def held_outputs(value) -> int:
    """RequestOutputs reachable from a stream attribute (through queues and containers)."""
    if isinstance(value, RequestOutput):
        return 1
    if isinstance(value, asyncio.Queue):
        value = list(value._queue)  # what an unbounded queue keeps
    if isinstance(value, (list, tuple, collections.deque)):
        return sum(held_outputs(v) for v in value)
    if isinstance(value, dict):
        return sum(held_outputs(v) for v in value.values())
    return 0


def test_unread_stream_holds_only_the_newest_output():
    engine = FakeEngine(max_model_len=512, step_seconds=0.0005)
    loop_engine = AsyncEngine(engine)
    loop_engine.start()

    async def main():
        stream = await loop_engine.add(
            [ord("a")], SamplingParams(temperature=0, max_tokens=300), "r"
        )
        while engine.steps < 200:  # the reader pauses for 200 steps
            await asyncio.sleep(0.005)
        held = sum(held_outputs(v) for k, v in vars(stream).items() if k != "_owner")
        newest = await stream.__anext__()
        rest = [out async for out in stream]
        return held, newest, rest

    held, newest, rest = run(main())
    loop_engine.stop()
    # One output held, and it is a recent one (the last step's hand-off to the event loop may be in flight).
    assert held == 1 and len(newest.outputs[0].token_ids) >= 190
    final = rest[-1] if rest else newest
    assert final.finished and final.outputs[0].text == expected_text("a", 300)
    assert all(
        not out.finished for out in [newest, *rest][:-1]
    )  # the final output came exactly once
    assert loop_engine.num_in_flight == 0


def test_stream_slot_keeps_the_final_output_and_an_error_wins():
    def out(tokens: int, finished: bool = False) -> RequestOutput:
        choice = CompletionOutput(
            0, "x" * tokens, [0] * tokens, 0.0, None, "length" if finished else None
        )
        return RequestOutput("r", None, [1], [choice], finished, RequestMetrics(0.0))

    async def main():
        owner = AsyncEngine(FakeEngine())  # never started: only its counters are used
        owner.num_in_flight = 2
        done = RequestStream(owner, "r", 1, 1, time.monotonic())
        for item in (out(1), out(2), out(3, finished=True)):
            done._put(item)
        assert sum(held_outputs(v) for k, v in vars(done).items() if k != "_owner") == 1
        got = [o async for o in done]
        failed = RequestStream(owner, "s", 1, 1, time.monotonic())
        for item in (out(1), RequestFailed("step failed"), out(2)):
            failed._put(item)
        with pytest.raises(RequestFailed):
            await failed.__anext__()
        assert [o async for o in failed] == [] and owner.num_in_flight == 0
        return got

    got = run(main())
    assert [len(o.outputs[0].token_ids) for o in got] == [3] and got[0].finished
