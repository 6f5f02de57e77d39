"""Server pieces in-process, without JAX or a model: request parsing, metrics text, the
engine-loop bridge and the app, driven by a fake engine whose outputs are computable by hand
(JetStream's mock-engine idea). The real model and process are in tests/test_server.py."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from minivllm_jax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm_jax.sampling_params import ContextLengthError, ParamError
from server.app import create_app
from server.engine_loop import AsyncEngine, EngineStopped, QueueFull
from server.metrics import EngineStats, Histogram, ServerMetrics
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    StreamRequest,
    param_error,
    parse_json,
    parse_request,
)
from server.responses import ChoiceTracker

# ---------------------------------------------------------------------- a hand-computable engine


class FakeTokenizer:
    """One token per character: id = ord(c) % 128; the chat template is 'role: content\\n'."""

    def __len__(self) -> int:
        return 128

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(
        self, messages, add_generation_prompt: bool, tokenize: bool
    ) -> list[int]:
        return self.encode(
            "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        )


class FakeEngine:
    """Each sequence outputs the next letters after its prompt's last character, one per step;
    every running request advances in the same step (one batch). One KV page per request."""

    def __init__(
        self, max_model_len: int = 64, pages: int = 32, step_seconds: float = 0.01
    ) -> None:
        self.step_seconds = step_seconds
        self.config = SimpleNamespace(max_model_len=max_model_len)
        self.page_manager = SimpleNamespace(num_free_pages=pages, num_usable_pages=pages)
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0)
        self.num_generated_tokens = self.num_prompt_tokens = self.num_compiles = (
            self.num_programs_loaded
        ) = 0
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self.requests: dict[str, tuple[list[int], object, list[list[int]]]] = {}
        self.steps = 0
        self.crash = False

    def add_request(self, ids, params, *, request_id):
        if not ids:
            raise ParamError("prompt", "prompt must not be empty")
        if len(ids) + params.max_tokens > self.config.max_model_len:
            raise ContextLengthError(
                "max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len",
            )
        self.requests[request_id] = (list(ids), params, [[] for _ in range(params.n)])
        self._sync()
        return request_id

    def abort(self, request_id):
        found = self.requests.pop(request_id, None) is not None
        self._sync()
        return found

    def has_unfinished(self):
        return bool(self.requests)

    def tier_stats(self):
        return {"disk_pages": 3}  # a KV tier gauge travels from the engine to /metrics

    def stats(self):
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            free_pages=self.page_manager.num_free_pages,
            usable_pages=self.page_manager.num_usable_pages,
            generated_tokens=self.num_generated_tokens,
            prompt_tokens=self.num_prompt_tokens,
            compiles=self.num_compiles,
            programs_loaded=self.num_programs_loaded,
            preemptions=self.scheduler.num_preemptions,
            steps=self.steps,
            **self.tier_stats(),
        )

    def close(self):
        self.closed = True

    def step(self):
        if self.crash:
            raise RuntimeError("device on fire")
        self.steps += 1
        time.sleep(
            self.step_seconds
        )  # like a device step: adds that arrive meanwhile join the next batch
        outputs = []
        for rid, (ids, params, outs) in list(self.requests.items()):
            for i, out in enumerate(outs):
                new = self.next_tokens(ids, out, i)
                out.extend(new)
                self.num_generated_tokens += len(new)
            reason = self.finish_reason(params, outs[0])
            outputs.append(
                RequestOutput(
                    rid,
                    None,
                    ids,
                    [
                        CompletionOutput(i, "".join(map(chr, o)), list(o), 0.0, None, reason)
                        for i, o in enumerate(outs)
                    ],
                    reason is not None,
                    RequestMetrics(0.0),
                )
            )
            if reason is not None:
                del self.requests[rid]
        self._sync()
        return outputs

    def next_tokens(self, ids, out, index):
        """This step's tokens for sample `index` (one: the letter after the last)."""
        return [ord("a") + (ids[-1] + len(out) + 1 + index) % 26]

    def finish_reason(self, params, out):
        return "length" if len(out) >= params.max_tokens else None

    def _sync(self):
        self.scheduler.running = list(self.requests)
        self.page_manager.num_free_pages = self.page_manager.num_usable_pages - len(self.requests)


def expected_text(prompt: str, n_tokens: int, index: int = 0) -> str:
    last = ord(prompt[-1]) % 128
    return "".join(chr(ord("a") + (last + k + 1 + index) % 26) for k in range(n_tokens))


def fake_llm(**kw) -> SimpleNamespace:
    return SimpleNamespace(engine=FakeEngine(**kw), tokenizer=FakeTokenizer())


def params(max_tokens: int = 4, n: int = 1):
    from minivllm_jax.sampling_params import SamplingParams

    return SamplingParams(temperature=0 if n == 1 else 1.0, max_tokens=max_tokens, n=n)


# ---------------------------------------------------------------------- protocol


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"", "empty"),
        (b"   ", "empty"),
        (b"\xff", "UTF-8"),
        (b"{", "not valid JSON"),
        (b"[" * 50_000, "nested"),
    ],
)
def test_parse_json_errors(raw, fragment):
    with pytest.raises(APIError) as e:
        parse_json(raw)
    assert e.value.status == 400 and fragment in e.value.message


@pytest.mark.parametrize(
    "model, body, param",
    [
        (CompletionRequest, {"prompt": "x", "bogus": 1}, "bogus"),
        (CompletionRequest, {"prompt": 5}, "prompt"),
        (CompletionRequest, {"prompt": [1, "a"]}, "prompt.1"),
        (CompletionRequest, {"prompt": "x", "seed": True}, "seed"),  # strict: no bool for int
        (CompletionRequest, {"prompt": "x", "top_p": float("inf")}, "top_p"),
        (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of"),
        (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages.0.content"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages.0.content.0.text",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        (StreamRequest, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        (StreamRequest, {}, "prompt"),
    ],
)
def test_validation_errors_name_the_param(model, body, param):
    with pytest.raises(APIError) as e:
        parse_request(model, body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_accepted_requests_map_to_sampling_params():
    req = parse_request(
        CompletionRequest,
        {
            "prompt": ["hi"],
            "max_tokens": 7,
            "temperature": 0,
            "stop": "x",
            "user": "u1",
            "logit_bias": {},
            "logprobs": 2,
            "best_of": 1,
        },
    )
    p = req.sampling_params()
    assert (
        req.single_prompt() == "hi"
        and p.max_tokens == 7
        and p.greedy
        and p.stop == ["x"]
        and p.logprobs == 2
    )
    chat = parse_request(
        ChatCompletionRequest,
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 3,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert chat.template_messages() == [{"role": "system", "content": "ab"}]
    cp = chat.sampling_params()
    assert cp.max_tokens == 5 and cp.logprobs == 3 and chat.include_usage
    plain = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})
    assert plain.sampling_params().max_tokens is None
    assert StreamRequest.model_validate({"prompt": "x"}).sampling_params().max_tokens == 16


def test_param_errors_become_400s_naming_the_field_the_request_sent():
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5}
    with pytest.raises(APIError) as e:  # SamplingParams' ParamError, no message parsing
        parse_request(ChatCompletionRequest, {**chat, "n": 2, "temperature": 0}).sampling_params()
    assert (e.value.status, e.value.param) == (400, "n"), e.value.message
    renames = parse_request(ChatCompletionRequest, chat).field_names()
    too_long = param_error(ContextLengthError("max_tokens", "does not fit"), renames)
    assert (too_long.param, too_long.code) == ("max_completion_tokens", "context_length_exceeded")
    top = param_error(ParamError("logprobs", "logprobs must be ..."), {"logprobs": "top_logprobs"})
    assert (top.param, top.code, top.message) == ("top_logprobs", None, "logprobs must be ...")
    assert parse_request(CompletionRequest, {"prompt": "x"}).field_names() == {}


# ---------------------------------------------------------------------- metrics and deltas


def test_histogram_is_cumulative_with_inf_bucket():
    h = Histogram("x_seconds", "help", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    h.observe(0.2, count=3)
    lines = h.render()
    assert 'minivllm_x_seconds_bucket{le="0.1"} 2' in lines
    assert 'minivllm_x_seconds_bucket{le="1.0"} 6' in lines
    assert (
        'minivllm_x_seconds_bucket{le="+Inf"} 7' in lines and "minivllm_x_seconds_count 7" in lines
    )


def test_metrics_render_without_engine():
    text = ServerMetrics().render(None, ready=False, in_flight=0)
    assert (
        "minivllm_ready 0" in text
        and "# TYPE minivllm_time_to_first_token_seconds histogram" in text
    )


def test_metrics_render_speculative_decoding_counters():
    stats = EngineStats(
        running=1,
        waiting=0,
        free_pages=10,
        usable_pages=20,
        generated_tokens=50,
        prompt_tokens=9,
        compiles=3,
        programs_loaded=0,
        preemptions=0,
        steps=30,
        draft_tokens=40,
        accepted_tokens=30,
    )
    lines = ServerMetrics().render(stats, ready=True, in_flight=1).splitlines()
    assert "minivllm_spec_decode_num_draft_tokens_total 40" in lines
    assert "minivllm_spec_decode_num_accepted_tokens_total 30" in lines
    assert "minivllm_spec_decode_acceptance_rate 0.75" in lines


def test_metrics_render_kv_tiers():
    stats = EngineStats(
        running=0,
        waiting=1,
        free_pages=10,
        usable_pages=20,
        generated_tokens=0,
        prompt_tokens=0,
        compiles=3,
        programs_loaded=0,
        preemptions=2,
        steps=3,
        swap_pages=5,
        swap_outs=2,
        swap_ins=1,
        disk_pages=7,
        disk_bytes=700,
        memory_hit_tokens=32,
        disk_hit_tokens=16,
    )
    lines = ServerMetrics().render(stats, ready=True, in_flight=1).splitlines()
    for line in (
        "minivllm_kv_swap_pages 5",
        "minivllm_kv_swap_outs_total 2",
        "minivllm_kv_disk_pages 7",
        "minivllm_kv_disk_bytes 700",
        'minivllm_prefix_cache_hit_tokens_total{tier="memory"} 32',
        'minivllm_prefix_cache_hit_tokens_total{tier="disk"} 16',
    ):
        assert line in lines


def test_engine_loop_publishes_tier_stats_and_closes_the_engine_on_a_clean_stop():
    engine = FakeEngine()
    loop_engine = AsyncEngine(engine, max_queue=8)
    loop_engine.start()

    async def main():
        return await collect(await loop_engine.add([ord("a")], params(2), "tiers"))

    assert run(main()).finished
    assert loop_engine.stats.disk_pages == 3
    loop_engine.stop()
    assert engine.closed  # cached KV pages get written to the disk tier


def test_choice_tracker_sends_each_piece_once():
    def out(texts, reasons):
        return RequestOutput(
            "r",
            None,
            [1],
            [
                CompletionOutput(i, t, list(range(len(t))), 0.0, None, r)
                for i, (t, r) in enumerate(zip(texts, reasons))
            ],
            False,
            RequestMetrics(0),
        )

    tracker = ChoiceTracker(2)
    assert [(d.index, d.text) for d in tracker.deltas(out(["ab", "x"], [None, None]))] == [
        (0, "ab"),
        (1, "x"),
    ]
    deltas = tracker.deltas(out(["abc", "x"], [None, "stop"]))
    assert [(d.index, d.text, d.finish_reason) for d in deltas] == [(0, "c", None), (1, "", "stop")]
    assert [(d.index, d.text) for d in tracker.deltas(out(["abcd", "x"], ["length", "stop"]))] == [
        (0, "d")
    ]


# ---------------------------------------------------------------------- the engine loop


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def collect(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_concurrent_requests_share_steps_and_get_their_own_text():
    engine = FakeEngine()
    loop_engine = AsyncEngine(engine, max_queue=8)
    loop_engine.start()

    async def main():
        prompts = ["ab", "cd", "xy", "hello"]
        adds = [
            loop_engine.add([ord(c) for c in p], params(6), f"r{i}") for i, p in enumerate(prompts)
        ]
        streams = await asyncio.gather(*adds)
        outs = await asyncio.gather(*(collect(s) for s in streams))
        return prompts, outs

    prompts, outs = run(main())
    assert [o.outputs[0].text for o in outs] == [expected_text(p, 6) for p in prompts]
    assert engine.steps < 4 * 6  # one step advanced several requests
    steps = engine.steps  # final: the last output came from the last step
    time.sleep(0.3)  # idle: the thread sleeps on its condition instead of stepping
    assert engine.steps == steps and loop_engine.num_in_flight == 0
    loop_engine.stop()


def test_abort_queue_full_bad_request_and_stop():
    engine = FakeEngine()
    loop_engine = AsyncEngine(engine, max_queue=2)
    loop_engine.start()

    async def main():
        a = await loop_engine.add([1, 2], params(50), "a")
        b = await loop_engine.add([1, 2], params(50), "b")
        with pytest.raises(QueueFull):
            await loop_engine.add([1], params(1), "c")
        await a.__anext__()
        a.abort()
        a.abort()  # idempotent
        with pytest.raises(ValueError, match="max_tokens"):
            await loop_engine.add([1], params(70), "too-long")
        await asyncio.to_thread(loop_engine.stop)
        with pytest.raises(EngineStopped):
            await collect(b)
        with pytest.raises(EngineStopped):
            await loop_engine.add([1], params(1), "late")

    run(main())
    assert engine.requests == {} and loop_engine.num_in_flight == 0
    assert loop_engine.stats.free_pages == loop_engine.stats.usable_pages


def test_engine_crash_fails_requests_instead_of_hanging():
    """A crash fails the requests in flight (never hangs them); the loop then restarts."""
    engine = FakeEngine()
    loop_engine = AsyncEngine(engine)
    engine.crash = True
    loop_engine.start()

    async def main():
        stream = await loop_engine.add([1], params(3), "r")
        with pytest.raises(EngineStopped, match="device on fire"):
            await collect(stream)

    run(main())
    assert engine.requests == {}
    assert loop_engine.alive and len(loop_engine.restarts) == 1


# ---------------------------------------------------------------------- the app in-process


async def _app_client(app):
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def test_health_503_while_loading_then_ready_and_generation_works():
    gate = threading.Event()

    def factory():
        assert gate.wait(10)
        return fake_llm()

    app = create_app(factory, model_name="fake", api_key="k")

    async def main():
        async with app.router.lifespan_context(app), await _app_client(app) as client:
            r = await client.get("/health")
            assert (
                r.status_code == 503
                and r.json()["status"] == "loading"
                and r.headers["Retry-After"]
            )
            r = await client.post(
                "/v1/completions", json={"prompt": "ab"}, headers={"Authorization": "Bearer k"}
            )
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
            gate.set()
            for _ in range(100):
                if (await client.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            auth = {"Authorization": "Bearer k"}
            body = {"prompt": "ab", "max_tokens": 5, "temperature": 0}
            r = await client.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text("ab", 5)
            body = {
                "messages": [{"role": "user", "content": "q"}],
                "max_tokens": 3,
                "n": 2,
                "stream": True,
            }
            r = await client.post("/v1/chat/completions", json=body, headers=auth)
            assert (
                r.text.endswith("data: [DONE]\n\n")
                and r.text.count('"finish_reason":"length"') == 2
            )
            assert (await client.post("/v1/completions", json={"prompt": "ab"})).status_code == 401

    run(main())


def test_load_failure_is_reported_on_health():
    errors = []

    def factory():
        raise FileNotFoundError("no such model")

    app = create_app(factory, model_name="missing", on_load_error=errors.append)

    async def main():
        async with app.router.lifespan_context(app), await _app_client(app) as client:
            for _ in range(100):
                if errors:
                    break
                await asyncio.sleep(0.02)
            r = await client.get("/health")
            assert (
                r.status_code == 503
                and r.json()["status"] == "failed"
                and "no such model" in r.json()["error"]
            )

    run(main())
    assert isinstance(errors[0], FileNotFoundError)


def test_kv_compression_request_field():
    ok = parse_request(
        CompletionRequest,
        {"prompt": "x", "kv_compression": {"policy": "sink_window", "window_tokens": 64}},
    )
    assert ok.sampling_params().kv_compression.window_tokens == 64
    bad = parse_request(CompletionRequest, {"prompt": "x", "kv_compression": {"policy": "lru"}})
    with pytest.raises(APIError) as e:
        bad.sampling_params()
    assert e.value.status == 400 and e.value.param == "kv_compression" and "lru" in e.value.message


def test_the_server_log_shows_its_own_info_lines_and_the_libraries_warnings_only():
    """orbax (through absl) wrote a dozen INFO lines per checkpoint save, JAX one per missing
    backend: at --log-level info only the server's lines and the libraries' warnings show."""
    import logging

    from server.cli import CHATTY_LIBRARY_LOGGERS, configure_logging

    saved = {name: logging.getLogger(name).level for name in ("", *CHATTY_LIBRARY_LOGGERS)}
    try:
        configure_logging("info")
        assert logging.getLogger("server").isEnabledFor(logging.INFO)
        assert logging.getLogger("minivllm_jax.engine").isEnabledFor(logging.INFO)
        for name in CHATTY_LIBRARY_LOGGERS:
            assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
            assert logging.getLogger(name).isEnabledFor(logging.WARNING), name
        configure_logging("debug")  # debugging shows everything
        assert all(logging.getLogger(n).isEnabledFor(logging.DEBUG) for n in CHATTY_LIBRARY_LOGGERS)
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
