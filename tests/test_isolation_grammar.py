"""Grammar cost is bounded: a constraint that is too costly to follow (too big, too ambiguous, a
regex that explodes) is refused or fails its own request, within a bounded time, while an
unconstrained request beside it completes unchanged; all constrained rows' masks are computed
in one batched call that gives exactly the per-row masks.

The grammars here are chosen so their cost is far over the budgets on any machine (hundreds of
times a typical mask), or the test lowers a budget itself, so no assertion depends on this
machine's speed; the one wall-clock bound is the compile deadline, which is the point."""

from __future__ import annotations

import time

import numpy as np
import pytest

from minivllm_jax import SamplingParams, StructuredOutputsParams
from minivllm_jax.engine.decoding import structured_output as so
from minivllm_jax.engine.decoding.structured_output import GrammarCompiler, fill_bitmasks
from tests.test_server_structured import WEATHER, save_byte_tokenizer, tiny_byte_llm

EOS = 2


def ambiguous_grammar(n: int) -> str:
    """Earley parsing of n rules that all match the same lexeme costs about n^3 a mask
    (600: over a second on a busy 2-core CPU, 800: about 2.5x that; a JSON schema's mask takes
    well under a millisecond)."""
    rules = "\n".join(f'a{i}: "q"' for i in range(n))
    return "start: s\ns: " + " | ".join(f"a{i} s" for i in range(n)) + ' | "z"\n' + rules


def too_many_items_grammar(n: int = 2500) -> str:
    """n words sharing a first byte: after it, one parser row holds n items (limit 2000)."""
    return "start: " + " | ".join(f'"w{i}x"' for i in range(n))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("byte-tokenizer")
    vocab = save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(
        str(path)
    ), vocab + 5  # ids the tokenizer lacks, as a model may have


@pytest.fixture
def compiler(tokenizer):
    hf, vocab = tokenizer
    compiler = GrammarCompiler(hf, vocab, [EOS])
    yield compiler
    compiler.close()


def advanced(compiler: GrammarCompiler, spec: StructuredOutputsParams, text: str, hf) -> so.Grammar:
    """A fresh grammar for `spec` that has consumed `text`."""
    grammar = compiler.compile(spec).new_grammar()
    for token in hf.encode(text, add_special_tokens=False):
        grammar.accept(token)
    assert grammar.failure is None, grammar.failure
    return grammar


# ----------------------------------------------------------------------------- the batched fill


def test_batched_fill_gives_exactly_the_per_row_masks(compiler, tokenizer, monkeypatch):
    """A mixed batch (JSON schema, JSON object, regex, choice, Lark, GBNF; at the start and
    mid-output; unconstrained rows between them) gets the same rows from one batched call as
    from filling each row alone, and the rows between stay all-ones."""
    hf, vocab = tokenizer
    monkeypatch.setattr(
        so, "GRAMMAR_MASK_BUDGET_S", 60.0
    )  # this is about the masks, on any CPU load
    cases = [
        (StructuredOutputsParams(json=WEATHER), ""),
        (StructuredOutputsParams(json=WEATHER), '{"city":"Par'),
        (StructuredOutputsParams(json_object=True), '{"a":[1,'),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), "55"),
        (StructuredOutputsParams(choice=["positive", "negative", "neutral"]), "ne"),
        (StructuredOutputsParams(grammar='start: "yes" | "no" | "maybe"'), ""),
        (StructuredOutputsParams(grammar='root ::= ("cat" | "dog") " " [0-9]'), "dog "),
    ]
    width = -(-vocab // 32)
    rows = [(advanced(compiler, spec, text, hf), 2 * i + 1) for i, (spec, text) in enumerate(cases)]
    per_row = np.full((2 * len(cases) + 1, width), -1, np.int32)
    for grammar, row in rows:
        grammar.fill_bitmask(per_row, row)
    twins = [
        (advanced(compiler, spec, text, hf), 2 * i + 1) for i, (spec, text) in enumerate(cases)
    ]
    batched = np.full_like(per_row, -1)
    assert fill_bitmasks(batched, twins) == [None] * len(cases)
    np.testing.assert_array_equal(batched, per_row)
    assert (batched[0::2] == -1).all()
    # real masks, all distinct but the two at a JSON schema's start
    assert len({batched[row].tobytes() for _, row in rows}) == len(cases) - 1


def test_a_failed_row_does_not_stop_the_others(compiler, tokenizer, monkeypatch):
    """In one batched call, a grammar over a parser limit gets its error (naming the limit) and
    the rows beside it get their masks."""
    hf, vocab = tokenizer
    monkeypatch.setattr(
        so, "GRAMMAR_MASK_BUDGET_S", 60.0
    )  # this is about the limit, on any CPU load
    bad = advanced(compiler, StructuredOutputsParams(grammar=too_many_items_grammar()), "", hf)
    bad.accept(hf.encode("w", add_special_tokens=False)[0])  # now one row holds 2,500 items
    good = advanced(compiler, StructuredOutputsParams(regex="[ab]+"), "", hf)
    bitmask = np.zeros((2, -(-vocab // 32)), np.int32)
    errors = fill_bitmasks(bitmask, [(bad, 0), (good, 1)])
    assert errors[1] is None and isinstance(errors[0], RuntimeError)
    assert "2501 items; max is 2000" in str(errors[0]) and "grammar failed" in str(errors[0])
    allowed = np.flatnonzero(np.unpackbits(bitmask[1].view(np.uint8), bitorder="little"))
    assert sorted(hf.decode([t]) for t in allowed) == ["a", "b"]


def test_a_grammar_over_the_mask_budget_is_stopped(compiler, tokenizer, monkeypatch):
    """A step whose batched fill overruns the budget times each row: the costly grammar is
    stopped with an error saying so and stays stopped; a row under the budget is untouched."""
    hf, vocab = tokenizer
    costly = advanced(compiler, StructuredOutputsParams(regex="[ab]+"), "a", hf)
    monkeypatch.setattr(so, "GRAMMAR_MASK_BUDGET_S", 0.0)  # every mask is over it
    bitmask = np.zeros((1, -(-vocab // 32)), np.int32)
    [error] = fill_bitmasks(bitmask, [(costly, 0)])
    assert isinstance(error, RuntimeError) and "too costly to follow" in str(error)
    monkeypatch.setattr(so, "GRAMMAR_MASK_BUDGET_S", 60.0)
    [again] = fill_bitmasks(bitmask, [(costly, 0)])
    assert again is not None and "too costly" in str(again)
    fine = advanced(compiler, StructuredOutputsParams(regex="[ab]+"), "a", hf)
    assert fill_bitmasks(bitmask, [(fine, 0)]) == [None]


# ----------------------------------------------------------------------------- compiles


def test_a_costly_grammar_is_refused_at_compile_naming_its_field(compiler):
    """Its first mask is computed on the compile thread: far over the budget, so a ValueError
    (a 400 on the server) names the field and the cost; it is not cached."""
    spec = StructuredOutputsParams(grammar=ambiguous_grammar(800))
    with pytest.raises(
        ValueError, match=r"structured_outputs\.grammar (is too costly to follow|did not compile)"
    ):
        compiler.compile(spec)
    assert spec.key not in compiler._cache and compiler.num_compiled == 0


def test_a_compile_past_the_deadline_fails_its_waiter_and_not_the_next(compiler, monkeypatch):
    """The waiter gets a ValueError at the deadline, though llguidance runs on (it cannot be
    interrupted); another constraint still compiles meanwhile, on the other compile thread."""
    compiler.compile(
        StructuredOutputsParams(regex="x")
    )  # the tokenizer, built once, is not the grammar's time
    monkeypatch.setattr(so, "GRAMMAR_MASK_BUDGET_S", 60.0)  # only the deadline can end it
    monkeypatch.setattr(
        so, "GRAMMAR_COMPILE_TIMEOUT_S", 0.02
    )  # a tenth of this compile on a fast CPU
    slow = StructuredOutputsParams(grammar=ambiguous_grammar(600))
    start = time.monotonic()
    with pytest.raises(
        ValueError, match=r"structured_outputs\.grammar did not compile within 0\.02 s"
    ):
        compiler.compile(slow)
    assert time.monotonic() - start < 5  # the deadline, not the compile, ends the wait
    monkeypatch.setattr(so, "GRAMMAR_COMPILE_TIMEOUT_S", 60.0)
    assert compiler.compile(StructuredOutputsParams(regex="[0-9]+")) is not None


def test_the_parser_limits_are_passed_to_llguidance(compiler, monkeypatch):
    """GRAMMAR_LIMITS is what the matcher runs under: tightened, a grammar over it is an error
    naming the field and the limit."""
    monkeypatch.setitem(so.GRAMMAR_LIMITS, "max_grammar_size", 50)
    rules = (
        " ".join(f"r{i}" for i in range(60)) + "\n" + "\n".join(f'r{i}: "x{i}"' for i in range(60))
    )
    with pytest.raises(ValueError, match=r"invalid structured_outputs\.grammar: .*grammar size"):
        compiler.compile(StructuredOutputsParams(grammar="start: " + rules))


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return tiny_byte_llm(tmp_path_factory.mktemp("grammar-isolation") / "tiny")


def run_beside(engine, bad_params: SamplingParams, good_prompt: str, good_params: SamplingParams):
    """Run a constrained request and an unconstrained one together; their final outputs."""
    bad = engine.add_request("Say a word:", bad_params)
    good = engine.add_request(good_prompt, good_params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done[bad], done[good]


def test_a_grammar_failing_mid_output_fails_alone(llm, monkeypatch):
    """A grammar that reaches a parser limit after its first token fails its own request with
    the reason; the unconstrained request beside it gets exactly its tokens when run alone."""
    monkeypatch.setattr(
        so, "GRAMMAR_MASK_BUDGET_S", 60.0
    )  # this is about the limit, on any CPU load
    engine = llm.engine
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [alone] = llm.generate(["The sea is"], plain)
    spec = StructuredOutputsParams(grammar=too_many_items_grammar())
    bad_params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=spec)
    bad, good = run_beside(engine, bad_params, "The sea is", plain)
    assert bad.outputs[0].finish_reason == "error" and "max is 2000" in bad.error
    assert good.error is None and good.outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.page_manager.num_free_pages == engine.page_manager.num_usable_pages


def test_a_grammar_over_the_mask_budget_fails_alone_in_the_engine(llm, monkeypatch):
    engine = llm.engine
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [alone] = llm.generate(["The sea is"], plain)
    spec = StructuredOutputsParams(regex="[a-z]{30}")
    engine.grammar_compiler.compile(spec)
    monkeypatch.setattr(so, "GRAMMAR_MASK_BUDGET_S", 0.0)  # then every mask is over it
    bad, good = run_beside(
        engine,
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec),
        "The sea is",
        plain,
    )
    assert bad.outputs[0].finish_reason == "error" and "too costly to follow" in bad.error
    assert good.error is None and good.outputs[0].token_ids == alone.outputs[0].token_ids


def test_a_costly_grammar_is_refused_within_the_deadline_beside_a_request(llm):
    """Its compile fails (too costly, or past the deadline) while the request beside it runs:
    the error comes within the compile deadline and the other request is unchanged."""
    engine = llm.engine
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [alone] = llm.generate(["The sea is"], plain)
    start = time.monotonic()
    bad_params = SamplingParams(
        structured_outputs=StructuredOutputsParams(grammar=ambiguous_grammar(800))
    )
    bad, good = run_beside(engine, bad_params, "The sea is", plain)
    assert (
        time.monotonic() - start < so.GRAMMAR_COMPILE_TIMEOUT_S + 10
    )  # the deadline, plus the plain request
    assert bad.outputs[0].finish_reason == "error"
    assert "structured_outputs.grammar is too costly" in bad.error or "did not compile" in bad.error
    assert good.error is None and good.outputs[0].token_ids == alone.outputs[0].token_ids


def test_the_server_refuses_a_costly_grammar_with_a_400_naming_the_field(llm, monkeypatch):
    """Over HTTP: a grammar too costly to follow, and one past the compile deadline, are 400s
    naming the request's field; a plain request right after is served."""
    from tests.test_server_structured import LiveServer, wait_idle

    server = LiveServer(llm)
    try:
        r = server.post(
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "guided_grammar": ambiguous_grammar(800),
            },
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "guided_grammar", r.text
        assert (
            "too costly to follow" in err["message"] or "did not compile within" in err["message"]
        )
        monkeypatch.setattr(so, "GRAMMAR_MASK_BUDGET_S", 60.0)  # only the deadline can end it
        monkeypatch.setattr(so, "GRAMMAR_COMPILE_TIMEOUT_S", 0.02)
        r = server.post(
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "guided_grammar": ambiguous_grammar(601)},
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "guided_grammar", r.text
        assert "did not compile within 0.02 s" in err["message"]
        monkeypatch.setattr(so, "GRAMMAR_COMPILE_TIMEOUT_S", 60.0)
        r = server.post(
            "/v1/completions", {"model": "tiny", "prompt": "The sea is", "max_tokens": 4}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in (
            "length",
            "stop",
        )
        wait_idle(server)
    finally:
        server.stop()
