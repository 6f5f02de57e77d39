"""`--quick` runs of the latency benchmarks on a tiny random Llama: they finish, exit 0 and
write well-formed JSON (and a PNG). No performance assertions.

Both runs use the same small engine shapes (2 sequences, 128 tokens, 32-token prefill
budget), so the second one finds the first one's programs in the persistent compile cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ["--max-num-batched-tokens", "32"]
SERVER_ARGS = "--max-num-seqs 2 --max-model-len 128 --max-num-batched-tokens 32"
LATENCY_KEYS = {
    "completed",
    "wall_s",
    "output_tokens",
    "output_tokens_per_s",
    "ttft_s",
    "tpot_s",
    "itl_s",
    "e2e_s",
    "goodput",
}


@pytest.fixture(scope="module")
def tiny_model(tiny_model_with_tokenizer) -> Path:
    return tiny_model_with_tokenizer


def _run(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]  # script: "<folder>/<name>.py"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def _check_level(level: dict, requests: int) -> None:
    assert LATENCY_KEYS <= level.keys()
    assert level["completed"] == requests and level["output_tokens"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert {"p50", "p90", "p99", "mean"} <= level[key].keys() and level[key]["p50"] is not None
    assert 0 <= level["goodput"]["requests_meeting_slo"] <= requests


def test_bench_latency_quick(tiny_model, tmp_path):
    out = tmp_path / "latency.json"
    proc = _run(
        "engine/bench_latency.py",
        "--quick",
        "--model",
        str(tiny_model),
        "--concurrency",
        "1",
        "2",
        *ENGINE,
        "--out",
        str(out),
    )
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    assert (
        result["concurrency"] == [1, 2]
        and {"machine", "timestamp", "workload", "slo"} <= result.keys()
    )
    n = result["workload"]["num_prompts"]
    assert result["ours"]["compiles_during_timed"] == 0 and result["ours"]["num_compiles"] > 0
    for side in ("ours", "hf"):
        levels = result[side]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        for level in levels:
            _check_level(level, n)
            assert level["output_tokens"] == result["workload"]["output_tokens"]  # exact lengths
    assert "hf" in proc.stdout and "ours" in proc.stdout  # the side-by-side table


@pytest.mark.slow  # starting a server (load, compile) takes 30-80 s on 2 busy cores
def test_load_test_launch_quick(tiny_model, tmp_path):
    out = tmp_path / "load.json"
    _run(
        "serving/load_test.py",
        "--launch",
        "--quick",
        "--model",
        str(tiny_model),
        "--server-args",
        SERVER_ARGS,
        "--concurrency-sweep",
        "1",
        "2",
        "--out",
        str(out),
    )
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    assert report["mode"] == "concurrency-sweep" and report["errors"] == 0
    assert report["workload"]["kind"] == "random" and report["workload"]["prompt_format"] == "ids"
    for level in report["levels"]:
        assert level["errors"] == 0 and level["error_samples"] == []
        _check_level(level, report["workload"]["num_prompts"])
        assert (
            level["output_tokens"] == report["workload"]["output_tokens"]
        )  # ignore_eos: exact lengths


@pytest.mark.slow  # two server starts
def test_bench_startup_quick(tiny_model, tmp_path):
    """Cold then warm: the warm server loads every program whole (the program cache works
    through the server's start-up path too)."""
    out = tmp_path / "startup.json"
    _run(
        "serving/bench_startup.py",
        "--quick",
        "--model",
        str(tiny_model),
        "--server-args",
        SERVER_ARGS,
        "--out",
        str(out),
        timeout=600,
    )
    r = json.loads(out.read_text())
    programs = r["cold"]["compiles_total"]
    assert programs > 0 and r["cold"]["programs_loaded_total"] == 0
    assert [(x["compiles_total"], x["programs_loaded_total"]) for x in r["warm"]] == [
        (programs, programs)
    ]
    assert r["cold_s"] > 0 and r["warm_s"] > 0


def test_load_test_rejects_non_loopback():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "serving" / "load_test.py"),
            "--url",
            "http://10.0.0.1:8000",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "loopback" in proc.stderr
