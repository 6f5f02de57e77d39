"""The throughput, roofline, energy and decode benchmarks' --quick modes on a tiny random model:
they run and write well-formed JSON (and PNGs). No performance assertions: numbers only > 0."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.engine import bench_decode, bench_throughput
from benchmarks.micro import bench_roofline, energy


@pytest.fixture(scope="module")
def tiny_model(tiny_model_with_tokenizer, tmp_path_factory):
    """The tiny model, converted into a private cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIVLLM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield str(tiny_model_with_tokenizer)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_energy(e) -> None:
    assert (isinstance(e, str) and e.startswith("not available (")) or _positive(e["joules"]), e


def test_throughput_quick(tiny_model, tmp_path):
    out = tmp_path / "throughput.json"
    args = ["--quick", "--model", tiny_model, "--hf-batch-sweep", "4", "8", "--out", str(out)]
    assert bench_throughput.main(args) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "offline_throughput" and r["dtypes"] == ["float32"]
    assert (
        r["workload"]["preset"] == "tiny"
        and r["output_tokens"] == r["workload"]["output_tokens"] > 0
    )
    side = r["by_dtype"]["float32"]
    ours, hf = side["ours"], side["hf"]
    for key in (
        "startup_s",
        "warmup_s",
        "compiled_programs",
        "elapsed_s",
        "output_tok_s",
        "total_tok_s",
        "usd_per_1m_output_tokens",
    ):
        assert _positive(ours[key]), key
    assert ours["compiles_during_run"] == 0
    for key in ("elapsed_s", "output_tok_s", "total_tok_s", "usd_per_1m_output_tokens"):
        assert _positive(hf[key]), key
    assert hf["batch_size"] in (4, 8) and set(hf["batch_sweep_output_tok_s"]) == {"4", "8"}
    assert _positive(side["speedup"])
    _check_energy(ours["energy"])
    _check_energy(hf["energy"])
    assert r["ours"] == ours and r["speedup"] == side["speedup"]  # the old flat layout still reads
    assert out.with_suffix(".png").stat().st_size > 0


def test_throughput_without_peer(tiny_model, tmp_path):
    out = tmp_path / "t.json"
    assert (
        bench_throughput.main(
            [
                "--quick",
                "--model",
                tiny_model,
                "--hf-batch",
                "0",
                "--temperature",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert "hf" not in r["by_dtype"]["float32"] and r["num_prompts"] == 8
    assert _positive(r["ours"]["output_tok_s"])


def test_roofline_quick(tiny_model, tmp_path):
    out = tmp_path / "roofline.json"
    assert bench_roofline.main(["--quick", "--model", tiny_model, "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in (
        "bound_bandwidth_gb_s",
        "bound_peak_gflop_s",
        "param_bytes",
        "non_embedding_params",
        "decode_bytes_per_token",
        "decode_bound_tok_s",
        "prefill_bound_tok_s",
        "prefill_step_s",
    ):
        assert _positive(r[key]), key
    assert all(_positive(v) for v in r["bandwidth_gb_s"].values())
    assert _positive(r["greedy_stream"]["decode_tok_s"]) and _positive(r["engine"]["decode_tok_s"])
    assert len(r["points"]) == 3 and all(
        _positive(p["fraction_of_bound"]) for p in r["points"].values()
    )
    # Both are greedy decodes of the same prompt: the engine's batched step and the bare model
    # loop must pick the same tokens.
    assert r["engine_matches_greedy_stream"] is True
    assert out.with_suffix(".png").stat().st_size > 0


def test_decode_quick(tiny_model, tmp_path):
    out = tmp_path / "decode.json"
    assert (
        bench_decode.main(
            ["--quick", "--model", tiny_model, "--prompt", "t5 t6 t7 t8", "--out", str(out)]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert (
        _positive(r["ours"]["decode_tok_s"])
        and _positive(r["hf"]["decode_tok_s"])
        and _positive(r["speedup"])
    )


def test_energy_quick(tmp_path):
    out = tmp_path / "energy.json"
    assert energy.main(["--quick", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert _positive(r["elapsed_s"]) and _positive(r["usd_for_load"])
    _check_energy(r["energy"])


def test_cost_per_million_tokens():
    # 1 hour at 0.10 USD/h for 1M tokens costs 0.10 USD per 1M tokens.
    assert energy.usd_per_million_tokens(3600.0, 1_000_000, 0.10) == pytest.approx(0.10)
    assert energy.usd_per_million_tokens(1.0, 0, 0.10) is None


def test_rapl_reading_handles_wraparound(tmp_path):
    pkg, sub = tmp_path / "intel-rapl:0", tmp_path / "intel-rapl:0:0"
    for zone, value in [(pkg, 999_900), (sub, 5)]:
        zone.mkdir()
        (zone / "energy_uj").write_text(f"{value}\n")
        (zone / "max_energy_range_uj").write_text("1000000\n")
    assert energy.rapl_zones(tmp_path) == [pkg]  # sub-zones would double count
    meter = energy.EnergyMeter(root=tmp_path)
    with meter:
        (pkg / "energy_uj").write_text("400\n")  # wrapped past 1,000,000 uJ
    e = meter.result(output_tokens=10)
    assert e["source"] == "rapl" and e["joules"] == pytest.approx(500e-6)
    assert e["j_per_output_token"] == pytest.approx(50e-6)


def test_energy_not_available_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(energy.shutil, "which", lambda name: None)  # as if no nvidia-smi here
    meter = energy.EnergyMeter(root=tmp_path / "missing")
    with meter:
        pass
    assert meter.source is None
    assert meter.result().startswith("not available (") and "RAPL" in meter.result()


def test_summary_table_reads_results_and_dates_them(tmp_path):
    """run_all's table is built from the JSON results; rows from different runs show the span."""
    from benchmarks.lib import readme

    results = readme.loader(tmp_path)
    assert "not run yet" in readme.summary(results) and "| n/a | n/a |" in readme.summary(results)
    tp = {
        "ours": {"output_tok_s": 60.0},
        "hf": {"output_tok_s": 20.0},
        "speedup": 3.0,
        "timestamp": "2026-01-02T10:00:00",
    }
    (tmp_path / "throughput.json").write_text(json.dumps(tp))
    table = readme.summary(results)
    assert "| 60.0 | 20.0 | 3.00x |" in table and "Measured 2026-01-02T10:00:00 on" in table
    (tmp_path / "decode.json").write_text(json.dumps({"timestamp": "2026-01-01T09:00:00"}))
    assert "from 2026-01-01T09:00:00 to 2026-01-02T10:00:00" in readme.summary(results)
