"""bench_kv_tiers.py `--quick` on the tiny random model: the preemption and compression parts in
process (fast), the restart part (four server starts) as a slow test. Checked: what the README's
KV-tier numbers rest on (every preemption mode gives the recompute run's tokens, swap moves pages
out and back, compression keeps less than the full cache). No performance assertions."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine import bench_kv_tiers


@pytest.fixture(autouse=True)
def _isolated_conversions(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "converted"))


def test_kv_tiers_quick_preemption_and_compression(tiny_chat_model, tmp_path):
    out = tmp_path / "kv_tiers.json"
    argv = ["--quick", "--model", str(tiny_chat_model), "--out", str(out)]
    assert bench_kv_tiers.main([*argv, "--only", "preemption", "compression"]) == 0
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0 and "restart" not in r
    rows = {row["mode"]: row for row in r["preemption"]["rows"]}
    assert list(rows) == list(bench_kv_tiers.MODES)
    for mode, row in rows.items():
        assert row["tokens_identical_to_recompute"] is True, mode
        assert row["preemptions"] > 0, mode  # the pool holds 2 of the 6 sequences at full length
    assert rows["recompute"]["swap_outs"] == 0
    assert rows["swap"]["swap_outs"] == rows["swap"]["swap_ins"] > 0
    assert rows["swap"]["prompt_tokens_computed"] < rows["recompute"]["prompt_tokens_computed"]
    full, *compressed = r["compression"]["rows"]
    assert full["policy"] == "full" and full["kept_fraction"] == 1.0 and compressed
    for row in compressed:
        assert row["policy"]["policy"] in ("sink_window", "page_scores")
        assert 0 < row["kept_fraction"] < 1 and row["bytes_per_seq"] < full["bytes_per_seq"]
        assert 0 <= row["greedy_agreement"] <= 1 and row["perplexity"] > 0


@pytest.mark.slow  # four server starts (load, compile) on the tiny model
def test_kv_tiers_quick_restart(tiny_chat_model, tmp_path):
    out = tmp_path / "kv_tiers.json"
    argv = ["--quick", "--model", str(tiny_chat_model), "--out", str(out)]
    assert bench_kv_tiers.main([*argv, "--only", "restart"]) == 0
    tiers = {row["tier"]: row for row in json.loads(out.read_text())["restart"]["rows"]}
    assert tiers["disk"]["disk_hit_tokens"] > 0 and tiers["disk"]["page_files_after"] > 0
    assert tiers["none"]["disk_hit_tokens"] == 0 and tiers["none"]["page_files_after"] == 0
