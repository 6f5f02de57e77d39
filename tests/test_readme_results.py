"""The READMEs' measured numbers come from benchmarks/results/*.json: every
`<!-- results:NAME -->` block equals what `python benchmarks/run_all.py --readme` renders now."""

from __future__ import annotations

import json

import pytest

from benchmarks import run_all
from benchmarks.lib import readme


@pytest.mark.parametrize("path", readme.READMES, ids=lambda p: p.parent.name + "/" + p.name)
def test_readme_results_blocks_are_fresh(path):
    stale = readme.stale_blocks(path.read_text(), readme.loader())
    assert not stale, (
        f"{path.name}: blocks {stale} differ from benchmarks/results/*.json; "
        "run `python benchmarks/run_all.py --readme`"
    )


def test_readmes_hold_the_measured_blocks():
    names = {m[2] for path in readme.READMES for m in readme.BLOCK.finditer(path.read_text())}
    assert names == set(readme.BLOCKS)  # every renderer is used, and nothing else


def test_a_stale_block_is_found_and_rewritten(tmp_path):
    (tmp_path / "startup.json").write_text(json.dumps({"cold_s": 30.0, "warm_s": 9.5}))
    results = readme.loader(tmp_path)
    text = "start <!-- results:startup -->42.6 s cold<!-- /results --> end"
    assert readme.stale_blocks(text, results) == ["startup"]
    fresh = readme.render(text, results)
    assert "30.0 s cold and 9.5 s warm" in fresh and fresh.endswith("<!-- /results --> end")
    assert readme.stale_blocks(fresh, results) == []
    with pytest.raises(KeyError, match="results:nope"):
        readme.render("<!-- results:nope -->x<!-- /results -->", results)


def test_every_block_renders_without_results(tmp_path):
    results = readme.loader(tmp_path)
    for name, render in readme.BLOCKS.items():
        assert isinstance(render(results), str) and render(results), name


def test_run_all_readme_rewrites_the_blocks_and_the_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    target = tmp_path / "README.md"
    target.write_text("a\n<!-- results:summary -->\nSTALE\n<!-- /results -->\nb\n")
    monkeypatch.setattr(readme, "READMES", (target,))
    (tmp_path / "startup.json").write_text(json.dumps({"cold_s": 30.0, "warm_s": 9.5}))
    assert run_all.main(["--readme"]) == 0
    text = target.read_text()
    assert (
        "STALE" not in text and "| 30.0 / 9.5 |" in text and text.endswith("<!-- /results -->\nb\n")
    )
    assert (tmp_path / "SUMMARY.md").read_text() in text
    assert not (tmp_path / "QUANT.md").exists()  # no quant results: no quant table
