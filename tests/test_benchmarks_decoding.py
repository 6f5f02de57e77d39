"""bench_decoding.py and bench_structured.py `--quick` on the tiny random model: they exit cleanly
and write the JSON the README's decoding and structured-output blocks read, with the properties
those numbers rest on (the same greedy tokens across decoding modes; every constrained output
counted). No performance assertions (numbers on a tiny model mean nothing)."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine import bench_decoding, bench_structured


@pytest.fixture(autouse=True)
def _isolated_conversions(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "converted"))


def test_decoding_quick(tiny_chat_model, tmp_path):
    out = tmp_path / "decoding.json"
    argv = ["--quick", "--model", str(tiny_chat_model), "--out", str(out)]
    assert bench_decoding.main(argv) == 0
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert r["speculative_config"] == bench_decoding.SPECULATIVE
    for batch in ("batch_1", "batch_8"):
        gen = r["generate"][batch]
        assert gen["functional_equals_engine"] is True  # the jitted generate == the engine
        assert min(gen["functional_tok_s"], gen["engine_tok_s"], gen["hf_tok_s"]) > 0
    for batch, rows in (("batch_1", 1), ("batch_4", 4)):
        beam = r["beam_search"][batch]
        assert beam["ours_beam_tok_s"] == pytest.approx(4 * beam["ours_tok_s"])
        assert 0 <= beam["best_beam_equal_rows"] <= rows
    multi = r["multi_step"]
    assert multi["identical_tokens"] is True  # k decode steps in one program: the same tokens
    assert set(multi) >= {"k_1", "k_4", "k_8", "bound_tok_s", "weight_bytes_per_token"}
    spec = r["speculative"]
    # --quick runs the grounded workload only (the chat one takes the same paths)
    assert set(spec) == {"grounded_batch_1", "grounded_batch_8", "grounded_batch_1_int8"}
    for key, row in spec.items():
        assert row["identical_tokens"] is True, key  # greedy speculation keeps the tokens
        assert row["ngram"]["output_tokens"] == row["off"]["output_tokens"] > 0, key
        assert row["off"]["draft_tokens_per_run"] == 0 and row["off"]["acceptance_rate"] is None


def test_structured_quick(tiny_chat_model, tmp_path):
    out = tmp_path / "structured.json"
    bench_structured.main(["--quick", "--model", str(tiny_chat_model), "--out", str(out)])
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [row["batch_size"] for row in r["rows"]] == [1, 4]
    for row in r["rows"]:
        assert row["requests"] == 4 and row["output_tokens"] > 0
        assert 0 <= row["valid_json"] <= row["finished_by_grammar"] <= row["requests"]
        assert len(row["runs_tok_s"]["constrained"]) == len(row["runs_tok_s"]["unconstrained"]) == 1
        assert row["ratio"] == pytest.approx(row["constrained_tok_s"] / row["unconstrained_tok_s"])
    assert len(r["compile"]) == len(bench_structured.SCHEMAS) and r["tokenizer_view_ms"] > 0
    assert set(r["example"]) == {"schema", "prompt", "output"}
