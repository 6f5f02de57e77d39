"""bench_memory.py and bench_ablations.py `--quick` on a tiny random model: well-formed JSON and
a PNG, with the expected keys. No performance assertions (numbers on a tiny model mean nothing)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def tiny_model(tiny_model_with_tokenizer):
    return tiny_model_with_tokenizer


@pytest.fixture(autouse=True)
def _isolated_conversions(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "converted"))


def test_memory_quick(tiny_model, tmp_path):
    from benchmarks.engine import bench_memory

    out = tmp_path / "memory.json"
    assert (
        bench_memory.main(["--quick", "--no-hf", "--model", str(tiny_model), "--out", str(out)])
        == 0
    )
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    for key in (
        "params",
        "kv_pool",
        "host_rss",
        "device_memory",
        "run",
        "timeline",
        "fragmentation",
        "machine",
    ):
        assert key in r, key
    assert (
        r["params"]["bytes"] > 0
        and r["kv_pool"]["bytes"] == r["kv_pool"]["num_pages"] * r["kv_pool"]["bytes_per_page"]
    )
    assert r["host_rss"]["peak_rss_bytes"] > 0
    assert r["device_memory"]["available"] is False  # tests run on the CPU
    assert r["timeline"] and {
        "step",
        "running",
        "waiting",
        "pages_used",
        "swap_pages",
        "disk_pages",
        "seq_tokens",
    } <= set(r["timeline"][0])
    tiers = r["tiers"]  # each KV tier: memory, the swap pool, disk, and the prefix hits per tier
    assert tiers["memory_pages_peak"] == r["kv_pool"]["peak_pages_used"] > 0
    assert (
        tiers["swap_pages_peak"] == 0
        and tiers["disk_pages_end"] == 0
        and tiers["memory_hit_tokens"] >= 0
    )
    allocators = {f["allocator"]: f for f in r["fragmentation"]}
    assert any(a.startswith("contiguous-") for a in allocators)
    # The page-16 row is computed from the timeline; it must equal the page manager's real count.
    paged = allocators["paged-16"]
    assert paged["allocated_slots_step_sum"] == paged["measured_allocated_slots_step_sum"]


@pytest.mark.slow
def test_memory_hf_peer_in_subprocess(tiny_model):
    """The PyTorch peer's RSS comes from its own process (about 15 s: a torch + transformers start)."""
    from benchmarks.engine import bench_memory

    argv = ["--quick", "--model", str(tiny_model)]
    hf = bench_memory.measure_hf(bench_memory.parse_args(argv), argv)
    assert "error" not in hf, hf
    assert hf["peak_rss_bytes"] >= hf["rss_after_load_bytes"] > 0 and hf["param_bytes"] > 0


def test_ablations_quick(tiny_model, tmp_path):
    from benchmarks.engine import bench_ablations

    out = tmp_path / "ablations.json"
    assert bench_ablations.main(["--quick", "--model", str(tiny_model), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    names = [row["name"] for row in r["rows"]]
    for name in (
        "baseline",
        "kv-cache-off",
        "static-batching",
        "paged-same-kv",
        "contiguous",
        "bucket-padding",
        "prefix-caching-on",
        "prefix-caching-off",
    ):
        assert name in names, name
    assert any(n.startswith("chunked-prefill-") for n in names) and any(
        n.startswith("max-num-seqs-") for n in names
    )
    for row in r["rows"]:
        assert {
            "description",
            "output_tok_s",
            "total_tok_s",
            "ttft_p50_s",
            "padded_token_pct",
            "metrics",
        } <= set(row)
        assert row["output_tok_s"] > 0 and row["metrics"]["compiles_during_run"] == 0
    rows = {row["name"]: row["metrics"] for row in r["rows"]}
    assert (
        rows["kv-cache-off"]["tokens_matching_cached_pct"] == 100.0
    )  # greedy recompute = cached decode
    assert (
        rows["contiguous"]["peak_running"] <= 2
    )  # --quick's KV budget holds 2 max-length sequences


def test_ablations_only_selects_by_prefix(tiny_model, tmp_path):
    from benchmarks.engine import bench_ablations

    out = tmp_path / "only.json"
    bench_ablations.main(
        ["--quick", "--model", str(tiny_model), "--out", str(out), "--only", "chunked-prefill"]
    )
    assert [row["name"] for row in json.loads(out.read_text())["rows"]] == [
        "chunked-prefill-16",
        "chunked-prefill-32",
    ]
    with pytest.raises(SystemExit):
        bench_ablations.main(["--quick", "--model", str(tiny_model), "--only", "no-such-ablation"])
