"""bench_resilience.py `--quick` against a server on the tiny random model: good traffic alone and
beside out-of-range values loses no request, and every abusive request is refused with a 400.
No performance assertions (goodput on a tiny model on a busy machine means nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # starts a server (load, compile)
def test_resilience_quick(tiny_model_with_tokenizer, tmp_path):
    out = tmp_path / "resilience.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "serving" / "bench_resilience.py"),
        "--quick",
        "--model",
        str(tiny_model_with_tokenizer),
        "--phases",
        "alone",
        "overflow_values",
        "--server-args",
        "--max-num-seqs 4 --max-model-len 128 --max-num-batched-tokens 32 --max-queue 8",
        "--out",
        str(out),
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MINIVLLM_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert r["lost_good_requests"] == 0 and r["flags"]["out"] == out.name  # no machine paths
    phases = {p["phase"]: p for p in r["phases"]}
    assert list(phases) == ["alone", "overflow_values"]
    for p in phases.values():
        assert p["good"]["sent"] == p["good"]["completed"] == 4 and p["good"]["lost"] == 0
        assert p["health"]["polls"] > 0 and p["health"]["not_200"] == {}
    answers = phases["overflow_values"]["abuse_answers"]
    assert set(answers) == {"400"} and sum(answers.values()) > 0
