"""bench_quant.py and quant_quality.py: `--quick` on a tiny random model (each mode in its own process) writes
consistent JSON, a PNG and a table; the greedy comparison and the mode plan on hand-made
inputs. No performance assertions (numbers on a tiny model mean nothing)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks.lib.readme import quant_table
from benchmarks.quality import bench_quant, quant_quality


@pytest.fixture(scope="module")
def tiny_model(tiny_model_with_tokenizer, tmp_path_factory):
    """The tiny model, converted into a private cache (the children inherit the variable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIVLLM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield str(tiny_model_with_tokenizer)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """Words of the tiny tokenizer's vocabulary (`w3`..`w127`), so the text is not all `<unk>`."""
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_text(" ".join(f"w{i}" for i in np.random.default_rng(0).integers(3, 128, size=300)))
    return path


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_quick_run_json_png_and_table(tiny_model, text_file, tmp_path):
    out = tmp_path / "quant.json"
    # The reference (fp32) always runs first; int4 with and without an int8 KV cache; gguf does not apply.
    argv = [
        "--quick",
        "--model",
        tiny_model,
        "--text",
        str(text_file),
        "--modes",
        "int4",
        "gguf",
        "--out",
        str(out),
    ]
    assert bench_quant.main(argv) == 0
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert r["benchmark"] == "quantization" and r["reference"] == "fp32" and "machine" in r
    text = r["text"]
    assert (
        text["scored_tokens"] == text["windows"] * text["window"] > 0
        and text["sources"][0]["sha256"]
    )

    modes = r["modes"]
    assert list(modes)[0] == "fp32"  # the reference runs first
    assert set(modes) == {"fp32", "int4", "int4+kv8", "gguf", "gguf+kv8"}
    assert modes["gguf"]["status"] == "skipped" and "not a GGUF" in modes["gguf"]["reason"]
    for name, m in modes.items():
        if name.startswith("gguf"):
            continue
        assert m["status"] == "ok", (name, m.get("reason"))
        assert (
            m["param_bytes"] > 0 and m["kv_bytes_per_token"] > 0 and m["compiles_during_run"] == 0
        )
        assert 0 < m["decode_bytes_per_token"] <= m["param_bytes"]
        assert (
            m["peak_rss_with_scoring_bytes"] >= m["peak_rss_bytes"] >= m["rss_after_load_bytes"] > 0
        )
        b = m["kv_budget"]
        page = m["kv_bytes_per_token"] * m["engine"]["page_size"]
        assert b["pages"] == int(b["budget_mib"] * 2**20 // page)
        assert b["tokens"] == b["pages"] * m["engine"]["page_size"]
        assert b["max_batch"] == b["pages"] // -(-b["context"] // m["engine"]["page_size"])
        for key in (m["decode_b1"]["decode_tok_s"], m["offline"]["output_tok_s"], m["ttft"]["p50"]):
            assert _finite(key) and key > 0
        assert (
            m["offline"]["output_tokens"]
            == r["settings"]["batch"] * r["settings"]["batch_output_len"]
        )
        q, g = m["quality"], m["greedy"]
        assert _finite(q["perplexity"]) and q["perplexity"] > 1
        assert q["scored_predictions"] == text["windows"] * (text["window"] - 1)
        assert q["mean_kl"] >= 0 and 0 <= q["top1_agreement"] <= 1
        assert (
            g["prompts"] == r["greedy_prompts"]
            and 0 <= g["identical_share"] <= g["top5_rule_pass_share"] <= 1
        )
    ref = modes["fp32"]
    assert ref["quality"]["mean_kl"] == 0
    assert ref["greedy"]["position_agreement"] == 1 == ref["greedy"]["top5_rule_pass_share"]
    assert modes["int4"]["param_bytes"] < ref["param_bytes"]
    assert modes["int4+kv8"]["kv_bytes_per_token"] < modes["int4"]["kv_bytes_per_token"]
    assert "int8" in modes["int4+kv8"]["kv_cache_leaf_dtypes"]
    assert "int8" not in modes["int4"]["kv_cache_leaf_dtypes"]

    assert (
        r["bandwidth"]["best_gb_s"]
        == max(v for k in ("before", "after") for v in r["bandwidth"][k].values())
        > 0
    )
    table = quant_table(r)
    assert (
        "| `fp32` |" in table
        and "| `int4` |" in table
        and "`gguf`" in table.split("Not measured", 1)[1]
    )
    assert bench_quant.main(["--report", "--out", str(out)]) == 0


def test_compare_greedy_is_vllms_top5_rule():
    ref = {
        "token_ids": [[1, 2, 3], [1, 2, 3], [1, 2, 3]],
        "top_ids": [[[1, 7], [2, 5], [3]], [[1], [2, 9], [3]], [[1], [2], [3]]],
    }
    # prompt 0 identical; prompt 1 differs at 1 with each token in the other's top-k; prompt 2
    # differs at 1 but 8 is not in the reference's top-k there.
    other = {
        "token_ids": [[1, 2, 3], [1, 9, 4], [1, 8, 3]],
        "top_ids": [[[1], [2], [3]], [[1], [2, 9], [4]], [[1], [2, 8], [3]]],
    }
    g = quant_quality.compare_greedy(ref, other)
    assert g["first_difference"] == [None, 1, 1] and g["identical_share"] == pytest.approx(1 / 3)
    assert g["top5_rule_pass_share"] == pytest.approx(2 / 3)
    assert g["position_agreement"] == pytest.approx(6 / 9) and g[
        "mean_common_prefix"
    ] == pytest.approx(5 / 3)


def test_plan_runs_the_reference_first_and_skips_gguf_on_a_non_gguf_model(
    tiny_model_with_tokenizer,
):
    args = bench_quant.parse_args(
        ["--model", str(tiny_model_with_tokenizer), "--modes", "int8", "gguf"]
    )
    plan = bench_quant.plan_modes(args)
    assert list(plan) == ["fp32", "int8", "int8+kv8", "gguf", "gguf+kv8"]  # the reference always
    assert not any("status" in plan[name] for name in ("fp32", "int8", "int8+kv8"))
    assert (
        plan["gguf"]["status"] == plan["gguf+kv8"]["status"] == "skipped"
        and "GGUF" in plan["gguf"]["reason"]
    )


def test_run_all_readme_writes_the_quant_table(tmp_path, monkeypatch):
    from benchmarks import run_all
    from benchmarks.lib import readme

    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    target = tmp_path / "README.md"
    target.write_text("# x\n<!-- results:quant -->\nSTALE\n<!-- /results -->\nafter\n")
    monkeypatch.setattr(readme, "READMES", (target,))
    assert run_all.main(["--readme"]) == 0
    assert "not run yet" in target.read_text() and not (tmp_path / "QUANT.md").exists()
    result = {
        "modes": {"w8a8": {"status": "skipped", "reason": "not supported"}},
        "timestamp": "2026-01-02T10:00:00",
    }
    (tmp_path / "quant.json").write_text(json.dumps(result))
    assert run_all.main(["--readme"]) == 0
    text, table = target.read_text(), (tmp_path / "QUANT.md").read_text()
    assert "STALE" not in text and table in text and text.endswith("<!-- /results -->\nafter\n")
    assert "- `w8a8`: skipped: not supported" in table


def test_decode_bytes_per_token_counts_a_tied_head_but_not_an_untied_embedding():
    import numpy as np

    layer = {"w": np.zeros((4, 8), np.float32)}  # 128 bytes
    embed = np.zeros((16, 4), np.float32)  # 256 bytes
    tied = {"embed_tokens": embed, "layers": (layer,), "norm": np.zeros(4, np.float32)}
    untied = {**tied, "lm_head": np.zeros((4, 16), np.int8)}  # 64 bytes
    assert bench_quant.decode_bytes_per_token(tied) == 256 + 128 + 16
    assert bench_quant.decode_bytes_per_token(untied) == 128 + 16 + 64
