"""bench_interference.py `--quick` on a tiny random model: it finishes, exits 0 and writes
well-formed JSON and a PNG. No timing assertions (numbers on a tiny model mean nothing)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(autouse=True)
def _isolated_conversions(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "converted"))


def test_interference_quick(tiny_model_with_tokenizer, tmp_path):
    from benchmarks.engine import bench_interference

    out = tmp_path / "interference.json"
    assert (
        bench_interference.main(
            ["--quick", "--model", str(tiny_model_with_tokenizer), "--out", str(out)]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert {
        "scenario",
        "engine",
        "phase1",
        "median",
        "repeats",
        "timeline",
        "git",
        "machine",
        "timestamp",
    } <= r.keys()
    assert r["compiles_during_timed"] == 0 and r["num_compiles"] > 0
    assert r["num_preemptions"] == 0 and r["streams_outlasted"]
    itl = r["phase1"]["itl_s"]
    assert 0 < itl["p50"] <= itl["p90"] <= itl["p99"] <= itl["max"]
    assert len(r["repeats"]) == r["scenario"]["repeats"] == 1
    for rep in r["repeats"]:
        assert rep["ttft_s"] > 0 and rep["worst_gap_s"] > 0 and rep["gaps_s"]["p50"] > 0
        assert rep["worst_gap_s"] >= rep["gaps_s"]["p99"] >= rep["gaps_s"]["p50"]
        assert rep["ratio_worst_gap_to_itl_p50"] > 0
        assert (
            rep["long_finished"] == "length"
            and rep["long_output_tokens"] == r["scenario"]["long_max_tokens"]
        )
        assert rep["long_cached_tokens"] == 0
        # Every step of the 300-token prefill also carries the 4 streams' decodes (the ragged
        # step), and the chunks add up to the prompt.
        steps = rep["steps_during_prefill"]
        assert rep["num_prompt_steps"] >= 3 and rep["num_decode_steps"] == 0
        assert all(
            st["duration_s"] > 0 and st["kind"] == "mixed" and st["decodes"] == 4 for st in steps
        )
        assert sum(st["tokens"] - st["decodes"] for st in steps) == 300
    assert len(r["timeline"]["streams_s"]) == r["scenario"]["streams"] == 4
    assert len(r["timeline"]["prefill_spans_s"]) == 1
    for key in ("ttft_s", "worst_gap_s", "gap_p50_s", "gap_p99_s", "ratio_worst_gap_to_itl_p50"):
        assert r["median"][key] > 0
