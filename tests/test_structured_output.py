"""Structured output: the constraint params, the grammar compiler, the in-step bitmask, and the
engine on the shipped SmolLM2 (every constrained output parses and validates)."""

from __future__ import annotations

import json
import re
import threading

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams, StructuredOutputsParams
from minivllm_jax.ops.sampler import apply_token_bitmask, make_sampling_arrays, sample
from tests.conftest import requires_smollm2

# ----------------------------------------------------------------------------- params


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json='{"type": "integer"}').json == {"type": "integer"}
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_sampling_params_takes_a_dict_and_names_the_field():
    sp = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert sp.structured_outputs == StructuredOutputsParams(regex="[ab]+")
    with pytest.raises(ValueError, match="structured_outputs: unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"choice": ["a"], "regex": "a"})


def test_key_is_canonical():
    a = StructuredOutputsParams(json={"b": 1, "a": {"y": 2, "x": 3}})
    b = StructuredOutputsParams(json='{"a": {"x": 3, "y": 2}, "b": 1}')
    assert a.key == b.key and a.key != StructuredOutputsParams(json={"b": 1}).key


# ----------------------------------------------------------------------------- the bitmask


def _bitmask(allowed: list[list[int]], vocab: int) -> np.ndarray:
    mask = np.zeros((len(allowed), -(-vocab // 32)), np.uint32)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            mask[r, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return mask.view(np.int32)


def test_apply_token_bitmask_matches_numpy():
    rng = np.random.default_rng(0)
    vocab = 100  # not a multiple of 32: the last word's extra bits are ignored
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    allowed = [[0, 31, 32, 63, 64, 99], list(range(vocab)), [5]]
    got = np.asarray(
        apply_token_bitmask(jnp.asarray(logits), jnp.asarray(_bitmask(allowed, vocab)))
    )
    for r, tokens in enumerate(allowed):
        want = np.full(vocab, -np.inf, np.float32)
        want[tokens] = logits[r, tokens]
        np.testing.assert_array_equal(got[r], want)


def test_sampler_honours_the_mask_and_unmasked_rows_are_untouched():
    rng = np.random.default_rng(1)
    vocab = 300
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    rows = [
        (SamplingParams(temperature=0.0), 0, 0, 0),
        (SamplingParams(temperature=1.0, top_p=0.9), 7, 0, 3),
        (SamplingParams(temperature=0.0), 0, 0, 0),
        (SamplingParams(temperature=0.7), 3, 0, 1),
    ]
    plain = make_sampling_arrays(rows, 4, vocab)
    base = sample(jnp.asarray(logits), plain)
    masked = make_sampling_arrays(rows, 4, vocab)
    allowed = {0: [7, 250], 1: [3, 4, 5]}  # rows 2 and 3 stay all-ones
    for r, tokens in allowed.items():
        masked.token_bitmask[r] = _bitmask([tokens], vocab)[0]
    masked = type(masked)(**{**masked.__dict__, "use_bitmask": np.bool_(True)})
    out = sample(jnp.asarray(logits), masked)
    assert int(out.tokens[0]) == max(
        allowed[0], key=lambda t: logits[0, t]
    )  # greedy among the allowed
    assert int(out.tokens[1]) in allowed[1]
    assert out.tokens[2:].tolist() == base.tokens[2:].tolist()  # same draw, no constraint
    np.testing.assert_allclose(np.asarray(out.logprobs[2:]), np.asarray(base.logprobs[2:]))


# ----------------------------------------------------------------------------- engine (SmolLM2)

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "author": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 20},
                    "last": {"type": "string", "maxLength": 20},
                },
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        },
        "required": ["title", "author", "year"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "count": {"type": "integer"},
        },
        "required": ["colors", "count"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
            "ok": {"type": "boolean"},
        },
        "required": ["date", "code", "ok"],
        "additionalProperties": False,
    },
}
QUESTIONS = {
    "person": "Describe a person called Alice who is 30 and lives in Paris, as JSON.",
    "nested": "Give me a famous book with its author and year, as JSON.",
    "array": "List some colors of the rainbow and how many you listed, as JSON.",
    "pattern": "Give a date, a three-letter code with two digits, and a boolean, as JSON.",
}


@pytest.fixture(scope="module")
def llm():
    from tests.conftest import require_smollm2

    require_smollm2()
    return LLM(
        "smollm2-135m",
        max_num_seqs=8,
        max_model_len=384,
        max_num_batched_tokens=256,
        num_pages=160,
        use_tqdm=False,
    )


def chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


@requires_smollm2
def test_json_schemas_mixed_with_unconstrained_rows(llm):
    """Every constrained output parses and validates, greedy and sampled (n=2), in one batch
    with unconstrained rows whose tokens are those of a run without any constraint; nothing
    compiles after warm-up."""
    compiles = llm.engine.stats().compiles
    plain_prompts = [chat(llm, "Write one sentence about the sea."), "The capital of France is"]
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    prompts, params = [], []
    for name, schema in SCHEMAS.items():
        so = StructuredOutputsParams(json=schema)
        prompts += [chat(llm, QUESTIONS[name])] * 2
        params += [
            SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=so),
            SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=160, structured_outputs=so),
        ]
    outs = llm.generate(plain_prompts + prompts, [plain, plain] + params)
    alone = llm.generate(plain_prompts, plain)
    for o, a in zip(outs[:2], alone):
        assert o.outputs[0].token_ids == a.outputs[0].token_ids
    names = [name for name in SCHEMAS for _ in range(2)]
    checked = 0
    for name, out in zip(names, outs[2:]):
        for c in out.outputs:
            assert c.finish_reason == "stop", (name, c.text)
            jsonschema.validate(json.loads(c.text), SCHEMAS[name])
            checked += 1
    assert checked == 12
    assert llm.engine.stats().compiles == compiles
    assert llm.engine.page_manager.num_free_pages == llm.engine.config.cache.num_pages - 1


@requires_smollm2
def test_json_object_regex_choice_and_grammars(llm):
    cases = [
        (
            StructuredOutputsParams(json_object=True),
            "Describe the weather today as a JSON object.",
            lambda t: isinstance(json.loads(t), dict),
        ),
        (
            StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
            "Make up a phone number.",
            lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t),
        ),
        (
            StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
            "Sentiment of 'I love this film!'?",
            lambda t: t in ("positive", "negative", "neutral"),
        ),
        (
            StructuredOutputsParams(grammar='start: "yes" | "no" | "maybe"'),
            "Is the sky blue?",
            lambda t: t in ("yes", "no", "maybe"),
        ),
        (
            StructuredOutputsParams(grammar='root ::= ("cat" | "dog") " " [0-9]'),
            "Name an animal and a digit.",
            lambda t: re.fullmatch(r"(cat|dog) [0-9]", t),
        ),
    ]
    outs = llm.generate(
        [chat(llm, q) for _, q, _ in cases],
        [
            SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=so)
            for so, _, _ in cases
        ],
    )
    for (so, _, ok), out in zip(cases, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop" and ok(text), (so.kind, text)


@requires_smollm2
def test_async_and_sync_scheduling_give_the_same_constrained_tokens(llm):
    so = StructuredOutputsParams(json=SCHEMAS["person"])
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so)
    prompts = [
        chat(llm, QUESTIONS["person"]),
        chat(llm, "Invent a character for a novel, as JSON."),
    ]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    scheduler = llm.engine.scheduler
    config = scheduler.config
    scheduler.config = config.replace(async_scheduling=False)  # what `step` reads
    try:
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        scheduler.config = config
    assert before == after and config.scheduler.async_scheduling


@requires_smollm2
def test_bad_constraint_raises_and_compiles_are_cached_off_thread(llm):
    compiler = llm.engine.grammar_compiler
    with pytest.raises(ValueError, match="objectx"):
        llm.generate(["x"], SamplingParams(structured_outputs={"json": {"type": "objectx"}}))
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "a(b"}))
    assert not llm.engine.has_unfinished()

    threads = []
    original = compiler._compile
    compiler._compile = lambda spec: (
        threads.append(threading.current_thread().name),
        original(spec),
    )[1]
    try:
        spec = StructuredOutputsParams(regex="[a-c]{2,6}")
        n = compiler.num_compiled
        outs = llm.generate(
            ["abc"] * 3, SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec)
        )
        llm.generate(
            ["abc"], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec)
        )
    finally:
        compiler._compile = original
    assert compiler.num_compiled == n + 1 and len(threads) == 1
    assert threads[0] != threading.current_thread().name and threads[0].startswith("grammar")
    assert all(re.fullmatch("[a-c]{2,6}", o.outputs[0].text) for o in outs)


@requires_smollm2
def test_failed_compile_on_the_engine_fails_only_that_request(llm):
    """A request added straight to the engine (no LLM-level check) whose grammar fails comes
    back with an error and frees everything; the request beside it completes."""
    engine = llm.engine
    bad = engine.add_request(
        "x", SamplingParams(structured_outputs={"grammar": "start: undefined_rule"})
    )
    good = engine.add_request("The sea is", SamplingParams(temperature=0.0, max_tokens=5))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert (
        done[bad].error
        and "grammar" in done[bad].error
        and done[bad].outputs[0].finish_reason == "error"
    )
    assert done[good].error is None and len(done[good].outputs[0].token_ids) == 5
    assert engine.page_manager.num_free_pages == engine.config.cache.num_pages - 1
