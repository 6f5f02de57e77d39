"""The README blocks that quote measured numbers, each rendered from `benchmarks/results/*.json`.

A block is the text between `<!-- results:NAME -->` and `<!-- /results -->` in README.md or
benchmarks/README.md. `python benchmarks/run_all.py --readme` rewrites every block from its
renderer below, and `tests/test_readme_results.py` fails when a block differs from what the
results say, so a number in a README always has a results file behind it.
"""

from __future__ import annotations

import json
import re
import statistics
import textwrap
from collections.abc import Callable
from pathlib import Path

from benchmarks.lib.report import RESULTS, fmt, md_table

ROOT = Path(__file__).resolve().parents[2]
READMES = (ROOT / "README.md", ROOT / "benchmarks" / "README.md")
BLOCK = re.compile(r"(<!-- results:([\w-]+) -->)(.*?)(<!-- /results -->)", re.S)

Results = Callable[[str], dict]  # results name ("throughput") -> its JSON, {} when missing


def loader(folder: Path = RESULTS) -> Results:
    """Read `folder/NAME.json` on demand; a result not run yet reads as {}."""

    def load(name: str) -> dict:
        path = Path(folder) / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    return load


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def _date(result: dict) -> str:
    return (result.get("timestamp") or "not run yet")[:10]


def _wrap(text: str, **indents: str) -> str:
    """A generated paragraph (or bullet) wrapped as the hand-written ones are."""
    return textwrap.fill(text, 96, break_long_words=False, break_on_hyphens=False, **indents)


def _bullets(items: list[str]) -> str:
    return "\n".join(_wrap(x, initial_indent="- ", subsequent_indent="  ") for x in items)


def _times(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


# ------------------------------------------------------------------ the results table


def dig(d: dict, path: str):
    """`d["a"]["b"]...` along the dotted `path`; None where a step is missing."""
    for key in path.split("."):
        d = d.get(key) if isinstance(d, dict) else None
    return d


def summary(r: Results) -> str:
    """The main table (ours vs PyTorch, and llama.cpp where it ran), from whatever results exist."""
    g = lambda name, path: dig(r(name), path)  # one value of one result
    gib = lambda b: None if b is None else b / 2**30

    def llamacpp(name: str, key: str, ours: float | None) -> list[str]:
        """The llama.cpp column ("F32 / Q4_1") and ours / llama.cpp F32; blank without a peer."""
        if not r(name).get("llamacpp"):
            return ["", ""]
        f32, q4 = g(name, f"llamacpp.f32.{key}"), g(name, f"llamacpp.q4_1.{key}")
        return [f"{fmt(f32)} / {fmt(q4)}", f"{ours / f32:.2f}x" if ours and f32 else ""]

    def ttft8(side: dict | None) -> str:
        t = next(
            (lv["ttft_s"] for lv in (side or {}).get("levels", []) if lv["concurrency"] == 8), {}
        )
        return f"{fmt(_ms(t.get('p50')), 0)} / {fmt(_ms(t.get('p99')), 0)}"

    out, total = g("throughput", "ours.output_tok_s"), g("throughput", "ours.total_tok_s")
    decode = g("decode", "ours.decode_tok_s")
    lat_peers = sorted((r("latency").get("llamacpp") or {}).items())
    frac = g("roofline", "points.decode b=1 (LLM engine).fraction_of_bound")
    gap, gap_ratio = (
        g("interference", "median.worst_gap_s"),
        g("interference", "median.ratio_worst_gap_to_itl_p50"),
    )
    beam, spec = (
        g("decoding", "beam_search.batch_1") or {},
        g("decoding", "speculative.grounded_batch_1") or {},
    )
    modes = {x["mode"]: x["elapsed_s"] for x in g("kv_tiers", "preemption.rows") or []}
    tiers = {x["tier"]: x["ttft_s"]["p50"] for x in g("kv_tiers", "restart.rows") or []}
    rows = [
        [
            "offline throughput, output tok/s (mixed, fp32)",
            fmt(out),
            fmt(g("throughput", "hf.output_tok_s")),
            _times(g("throughput", "speedup")),
            *llamacpp("throughput", "output_tok_s", out),
        ],
        [
            "offline throughput, total tok/s",
            fmt(total),
            fmt(g("throughput", "hf.total_tok_s")),
            "",
            *llamacpp("throughput", "total_tok_s", total),
        ],
        [
            "offline throughput, output tok/s (chat, bf16)",
            fmt(g("throughput_bf16", "ours.output_tok_s")),
            fmt(g("throughput_bf16", "hf.output_tok_s")),
            _times(g("throughput_bf16", "speedup")),
        ],
        [
            "batch-1 greedy decode, tok/s",
            fmt(decode),
            fmt(g("decode", "hf.decode_tok_s")),
            _times(g("decode", "speedup")),
            *llamacpp("decode", "decode_tok_s", decode),
        ],
        [
            "TTFT p50 / p99 at concurrency 8, ms (chat)",
            ttft8(g("latency", "ours")),
            ttft8(g("latency", "hf")),
            "",
            "; ".join(f"{v.upper()}: {ttft8(side)}" for v, side in lat_peers),
            "",
        ],
        [
            "params + KV pool, GiB",
            f"{fmt(gib(g('memory', 'params.bytes')), 2)} + {fmt(gib(g('memory', 'kv_pool.bytes')), 2)}",
        ],
        [
            "peak host RSS, GiB",
            fmt(gib(g("memory", "host_rss.peak_rss_bytes")), 2),
            fmt(gib(g("memory", "hf.peak_rss_bytes")), 2),
        ],
        ["batch-1 engine decode, share of the bandwidth bound", fmt(frac and 100 * frac, 0) + "%"],
        [
            "worst stream gap while a 1,500-token prompt prefills, ms (target <= 2x ITL p50)",
            f"{fmt(_ms(gap), 0)} ({fmt(gap_ratio)}x ITL p50)" if gap else "n/a",
        ],
        [
            "server start-up to /health 200, cold / warm caches, s (targets <= 60 / 15)",
            f"{fmt(g('startup', 'cold_s'))} / {fmt(g('startup', 'warm_s'))}",
        ],
        [
            "beam search (k = 4), batch 1, tok/s",
            fmt(beam.get("ours_tok_s")),
            fmt(beam.get("hf_tok_s")),
            _ratio(beam.get("ours_tok_s"), beam.get("hf_tok_s")),
        ],
        [
            "n-gram speculation, batch-1 decode, input-grounded, tok/s with / without",
            f"{fmt(dig(spec, 'ngram.decode_tok_s'))} / {fmt(dig(spec, 'off.decode_tok_s'))}",
            "",
            _times(spec.get("decode_speedup")),
        ],
        [
            "preemption-heavy workload, completion s: recompute / swap / auto",
            " / ".join(fmt(modes.get(m)) for m in ("recompute", "swap", "auto")),
            "",
            _ratio(modes.get("recompute"), modes.get("swap")),
        ],
        [
            "TTFT p50 of the first requests after a server restart, ms: disk tier / none",
            f"{fmt(_ms(tiers.get('disk')), 0)} / {fmt(_ms(tiers.get('none')), 0)}",
            "",
            _ratio(tiers.get("none"), tiers.get("disk")),
        ],
        *_resilience_rows(r("resilience")),
    ]
    head = ["metric", "minivllm-jax (XLA)", "HF transformers (PyTorch)", "ratio"]
    if any(any(x[4:6]) for x in rows):
        head += ["llama.cpp F32 / Q4_1 GGUF", "ours / llama.cpp F32"]
    table = md_table(head, [(x + [""] * 6)[: len(head)] for x in rows])
    names = "throughput throughput_bf16 decode latency memory roofline interference startup"
    stamps = sorted(
        r(n)["timestamp"]
        for n in (names + " decoding kv_tiers resilience").split()
        if r(n).get("timestamp")
    )
    when = stamps[0] if stamps and stamps[0] == stamps[-1] else "not run yet"
    if stamps and stamps[0] != stamps[-1]:
        when = (
            f"from {stamps[0]} to {stamps[-1]} (rows rerun with `--only` keep their own timestamps)"
        )
    m = r("throughput").get("machine") or r("decode").get("machine") or {}
    return (
        f"{table}\nMeasured {when} on {m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores, "
        f"{m.get('mem_gib', '?')} GiB (`python benchmarks/run_all.py`).\n"
    )


def _resilience_rows(res: dict) -> list[list[str]]:
    """Good-traffic goodput alone and beside the worst abuse, good requests lost, and /health's
    worst latency while tool bombs arrive (bench_resilience.py)."""
    phases = {p["phase"]: p for p in res.get("phases", [])}

    def pct(phase: dict | None) -> str:
        if phase is None:
            return "n/a"
        goodput = phase["good"]["goodput"]
        return f"{fmt(None if goodput is None else 100 * goodput, 0)}% ({phase['phase']})"

    abused = [p for name, p in phases.items() if name != "alone"]
    worst = min(abused, key=lambda p: p["good"]["goodput"] or 0) if abused else None
    goodput = "n/a"
    if phases:
        goodput = f"{pct(phases.get('alone'))} / {pct(worst)}; {res.get('lost_good_requests')} lost"
    health = res.get("health_worst_s_during_tool_bombs")
    return [
        [
            "good-traffic goodput at concurrency 16 (TTFT <= 2 s, TPOT <= 100 ms): alone / worst "
            "beside abuse; good requests lost",
            goodput,
        ],
        ["/health worst latency while 800 KB tool-bomb requests arrive, ms", fmt(_ms(health), 0)],
    ]


# ------------------------------------------------------------------ the README's prose blocks


def startup(r: Results) -> str:
    s = r("startup")
    return (
        f"{fmt(s.get('cold_s'))} s cold and {fmt(s.get('warm_s'))} s warm here "
        f"({_date(s)}, `benchmarks/serving/bench_startup.py`)"
    )


def scheduling(r: Results) -> str:
    """How long the steps that carried a long prompt's chunks took against a decode-only step."""
    inter = r("interference")
    decode = ((inter.get("phase1") or {}).get("decode_step_s") or {}).get("p50")
    ratios = [
        st["duration_s"] / decode
        for rep in inter.get("repeats", [])
        for st in rep["steps_during_prefill"]
        if decode
    ]
    if not ratios:
        return "not measured yet (`benchmarks/engine/bench_interference.py`)"
    med = inter["median"]
    return (
        f"in `results/interference.json` ({_date(inter)}) the steps carrying a "
        f"{inter['scenario']['long_prompt_tokens']:,}-token prompt's chunks took "
        f"{min(ratios):.1f}-{max(ratios):.1f}x a decode-only step (median "
        f"{statistics.median(ratios):.1f}x), and the worst stream gap was "
        f"{med['ratio_worst_gap_to_itl_p50']:.1f}x ITL p50"
    )


# ------------------------------------------------------------------ the quantization table

REFERENCE = "fp32"  # bench_quant's base mode with the model-dtype KV cache: the quality reference


def _kl(x: float | None) -> str:
    return "n/a" if x is None else "0" if x == 0 else f"{x:.1e}" if x < 1e-3 else f"{x:.4f}"


def quant_table(result: dict) -> str:
    """bench_quant's table: one row per mode that ran, then the skipped ones with their reasons."""
    modes = result.get("modes") or {}
    budget = next((m["kv_budget"] for m in modes.values() if m.get("status") == "ok"), {})
    ref_tok_s = ((modes.get(REFERENCE) or {}).get("decode_b1") or {}).get("decode_tok_s")
    bandwidth = (result.get("bandwidth") or {}).get("best_gb_s")
    max_batch = (
        f"max batch ({fmt(budget.get('budget_mib'), 0)} MiB KV, {budget.get('context', '?')} tok)"
    )
    head = ["mode", "params MB", "KV B/token", max_batch, "peak RSS MB", "b1 decode tok/s"]
    head += [f"b1 x {REFERENCE}", "b1 % of bound", "offline out tok/s", "TTFT p50 ms"]
    head += ["perplexity", "mean KL", "top-1 agree %", "greedy agree %", "top-5 rule %"]
    rows, not_run = [], {}  # not_run: "skipped: reason" -> modes
    for name, m in modes.items():
        if m.get("status") != "ok":
            not_run.setdefault(f"{m.get('status')}: {m.get('reason')}", []).append(f"`{name}`")
            continue
        q, g = m.get("quality") or {}, m.get("greedy") or {}
        tok_s, read = m["decode_b1"]["decode_tok_s"], m.get("decode_bytes_per_token")
        share = tok_s * read / (bandwidth * 1e9) if bandwidth and read else None
        rows.append(
            [
                f"`{name}`",
                fmt(m["param_bytes"], 1, 1e-6),
                fmt(m["kv_bytes_per_token"], 0),
                str(m["kv_budget"]["max_batch"]),
                fmt(m["peak_rss_bytes"], 1, 1e-6),
                fmt(tok_s),
                fmt(tok_s / ref_tok_s if ref_tok_s else None, 2),
                fmt(share, 0, 100),
                fmt(m["offline"]["output_tok_s"]),
                fmt(m["ttft"]["p50"], 0, 1e3),
                fmt(q.get("perplexity"), 3),
                _kl(q.get("mean_kl")),
                fmt(q.get("top1_agreement"), 1, 100),
                fmt(g.get("position_agreement"), 1, 100),
                fmt(g.get("top5_rule_pass_share"), 0, 100),
            ]
        )
    text = result.get("text") or {}
    files = ", ".join(
        f"{s['package']} {s['version']} {Path(s['file']).name}"
        if "package" in s
        else Path(s["file"]).name
        for s in text.get("sources", [])
    )
    machine = result.get("machine") or {}
    lines = [
        md_table(head, rows),
        f"Quality against `{REFERENCE}` on {text.get('scored_tokens', 0):,} tokens of text ({files}; "
        f"{text.get('windows', '?')} windows of {text.get('window', '?')}, fed {text.get('chunk', '?')} "
        f"at a time through the KV cache) and {result.get('greedy_prompts', '?')} prompts x "
        f"{result.get('gen_tokens', '?')} greedy tokens. Measured {result.get('timestamp', 'not yet')} "
        f"on {machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} cores "
        "(`python benchmarks/quality/bench_quant.py`). The bound of a batch-1 decode is the read "
        f"bandwidth ({fmt(bandwidth)} GB/s, the best probe of the run) over the weight bytes a step reads.",
    ]
    peer = result.get("llamacpp") or {}
    if peer.get("status") == "ok":
        lines.append(
            f"\nllama.cpp on the same GGUF ({peer['gguf']}), same prompt and run: batch-1 decode "
            f"{peer['decode_tok_s']:.1f} tok/s."
        )
    if not_run:
        lines.append("\nNot measured:\n")
        lines += [f"- {', '.join(names)}: {why}" for why, names in not_run.items()]
    return "\n".join(lines) + "\n"


def quant(r: Results) -> str:
    q = r("quant")
    return "\n" + (quant_table(q) if q else "not run yet\n")


def quant_summary(r: Results) -> str:
    """One sentence per headline of the quantization table."""
    q = r("quant")
    modes = {n: m for n, m in (q.get("modes") or {}).items() if m.get("status") == "ok"}
    if "fp32" not in modes:
        return "Not run yet (`python benchmarks/quality/bench_quant.py`)."
    b1 = lambda n: modes[n]["decode_b1"]["decode_tok_s"] if n in modes else None
    off = lambda n: modes[n]["offline"]["output_tok_s"] if n in modes else None
    ppl = lambda n: modes[n]["quality"]["perplexity"] if n in modes else None
    rel = lambda n, ref="fp32": f"{100 * (ppl(n) / ppl(ref) - 1):+.1f}%" if ppl(n) else "n/a"
    peer = q.get("llamacpp") or {}
    kv8 = (modes.get("int8+kv8") or {}).get("kv_budget", {}).get("max_batch")
    kv = (modes.get("int8") or {}).get("kv_budget", {}).get("max_batch")
    return (
        f"One run here ({_date(q)}, the table below; batch-1 greedy decode of SmolLM2): int8 "
        f"{fmt(b1('int8'))} tok/s ({_ratio(b1('int8'), b1('fp32'))} fp32's {fmt(b1('fp32'))}), int4 "
        f"{fmt(b1('int4'))} ({_ratio(b1('int4'), b1('fp32'))}), gguf {fmt(b1('gguf'))} against "
        f"llama.cpp's {fmt(peer.get('decode_tok_s'))} on the same Q4_1 file in the same run, w8a8 "
        f"offline {fmt(off('w8a8'))} output tok/s against fp32's {fmt(off('fp32'))} "
        f"({_ratio(off('w8a8'), off('fp32'))}). Perplexity {fmt(ppl('fp32'), 3)} fp32, "
        f"{fmt(ppl('int8'), 3)} int8 ({rel('int8')}), {fmt(ppl('int4'), 3)} int4, "
        f"{fmt(ppl('gguf'), 3)} gguf, {fmt(ppl('w8a8'), 3)} w8a8 ({rel('w8a8')}); an int8 KV cache "
        f"fits {_ratio(kv8, kv)} the sequences in the same KV budget for "
        f"{rel('int8+kv8', 'int8')} perplexity on int8."
    )


def decoding(r: Results) -> str:
    d = r("decoding")
    spec = (d.get("speculative") or {}).get("grounded_batch_1") or {}
    beam = d.get("beam_search") or {}
    b1, b4 = beam.get("batch_1") or {}, beam.get("batch_4") or {}
    gen = (d.get("generate") or {}).get("batch_1") or {}
    same = "identical tokens" if spec.get("identical_tokens") else "tokens differ"
    return (
        f"Measured (`benchmarks/engine/bench_decoding.py`, {_date(d)}, one run, SmolLM2 fp32; the "
        "[results table](benchmarks/README.md#results) has the headline rows): n-gram speculation "
        f"with {(d.get('speculative_config') or {}).get('num_speculative_tokens', '?')} draft "
        "tokens, batch-1 decode on an input-grounded workload (rewrite a passage, annotate code) "
        f"{fmt(spec.get('decode_speedup'), 2)}x ({fmt(spec.get('ngram', {}).get('decode_tok_s'))} "
        f"against {fmt(spec.get('off', {}).get('decode_tok_s'))} tok/s, {same}); beam search "
        f"(k = 4) {_ratio(b1.get('ours_tok_s'), b1.get('hf_tok_s'))} HF "
        f"`generate(num_beams=4)` at batch 1 and {_ratio(b4.get('ours_tok_s'), b4.get('hf_tok_s'))} "
        f"at batch 4 ({fmt(b1.get('ours_tok_s'))} and {fmt(b4.get('ours_tok_s'))} tok/s); "
        f"`generate` {fmt(gen.get('functional_tok_s'))}, the engine {fmt(gen.get('engine_tok_s'))}, "
        f"HF {fmt(gen.get('hf_tok_s'))} tok/s at batch 1."
    )


def structured(r: Results) -> str:
    s = r("structured")
    rows = s.get("rows") or []
    head = ["concurrent requests", "constrained tok/s", "unconstrained tok/s", "ratio"]
    table = md_table(
        head + ["mask fill, ms/token"],
        [
            [
                str(x["batch_size"]),
                fmt(x["constrained_tok_s"]),
                fmt(x["unconstrained_tok_s"]),
                f"{x['ratio']:.2f}x",
                fmt(x["mask_fill_ms_per_token"], 2),
            ]
            for x in rows
        ],
    )
    compile_ms = s.get("compile") or [{}]
    first = rows[0] if rows else {}
    intro = (
        f"Measured (`benchmarks/engine/bench_structured.py`, {_date(s)}, one run, SmolLM2 fp32, "
        f"{first.get('requests', '?')} chat requests per row, three JSON schemas with nested "
        "objects, enums and arrays; constrained greedy runs against unconstrained runs forced to "
        "the same token counts, medians of three alternated runs):"
    )
    outro = (
        f"At concurrency {first.get('batch_size', '?')}, {first.get('finished_by_grammar', '?')} "
        f"of {first.get('requests', '?')} outputs completed by the grammar and "
        f"{first.get('valid_json', '?')} validate; the others reached `max_tokens`. The "
        f"llguidance view of the tokenizer takes {fmt((s.get('tokenizer_view_ms') or 0) / 1e3, 2)} s "
        f"once; a schema compiles in {fmt(max(c.get('cold_ms', 0) for c in compile_ms))} ms or "
        f"less, then {fmt(max(c.get('cached_ms', 0) for c in compile_ms), 2)} ms from the cache."
    )
    return f"\n{_wrap(intro)}\n\n{table}\n{_wrap(outro)}\n"


def kv_tiers(r: Results) -> str:
    kv = r("kv_tiers")
    pre, restart, comp = (kv.get(k) or {} for k in ("preemption", "restart", "compression"))
    modes = {x["mode"]: x for x in pre.get("rows", [])}
    tiers = {x["tier"]: x["ttft_s"]["p50"] for x in restart.get("rows", [])}
    rows = comp.get("rows", [])
    full = next((x for x in rows if x["policy"] == "full"), {})
    kept = {}  # kept tokens -> {policy: row}
    for x in rows:
        if x["policy"] != "full":
            kept.setdefault(x["final_kept_tokens"], {})[x["policy"]["policy"]] = x
    if not (modes and tiers and kept):
        return "\nNot run yet (`python benchmarks/engine/bench_kv_tiers.py`).\n"
    big, small = max(kept), sorted(kept)[-2] if len(kept) > 1 else min(kept)
    sw, ps = kept[big].get("sink_window", {}), kept[big].get("page_scores", {})
    auto = modes.get("auto", {})
    same = all(m["tokens_identical_to_recompute"] for m in modes.values())
    items = [
        f"{pre['requests']} requests of {pre['prompt_len']} + {pre['output_len']} tokens under "
        f"page pressure: recompute {fmt(modes['recompute']['elapsed_s'])} s, swap "
        f"{fmt(modes['swap']['elapsed_s'])} s, auto {fmt(auto.get('elapsed_s'))} s "
        f"({auto.get('swap_outs')} swaps; {modes['recompute']['prompt_tokens_computed']:,} against "
        f"{auto.get('prompt_tokens_computed', 0):,} prompt tokens computed; "
        f"{'identical' if same else 'different'} tokens);",
        f"the first {restart['first_requests']} concurrent requests after a server restart, sharing "
        f"a {restart['system_tokens']:,}-token system prompt: TTFT p50 {fmt(_ms(tiers['disk']), 0)} ms "
        f"from the disk tier, {fmt(_ms(tiers['none']), 0)} ms without it;",
        f"over {comp['tokens']:,} tokens of text (perplexity {fmt(full.get('perplexity'), 2)} with "
        f"full attention), keeping {big:,} tokens ({fmt(100 * sw.get('kept_fraction', 0), 0)}% of "
        f"the KV on average): sink + window {fmt(sw.get('perplexity'), 2)} "
        f"({fmt(100 * sw.get('greedy_agreement', 0), 0)}% greedy agreement), page scores "
        f"{fmt(ps.get('perplexity'), 2)} ({fmt(100 * ps.get('greedy_agreement', 0), 0)}%); keeping "
        f"{small:,}: {fmt(kept[small].get('sink_window', {}).get('perplexity'), 2)} and "
        f"{fmt(kept[small].get('page_scores', {}).get('perplexity'), 2)}.",
    ]
    head = f"Measured (`benchmarks/engine/bench_kv_tiers.py`, one run, SmolLM2 fp32, {_date(kv)}):"
    return f"\n{head}\n{_bullets(items)}\n"


def headline(r: Results) -> str:
    tp, dec = r("throughput"), r("decode")
    peer, dpeer = tp.get("llamacpp") or {}, dec.get("llamacpp") or {}
    tok = lambda side, key="output_tok_s": fmt((side or {}).get(key))
    return (
        f"Headline numbers here ({tp.get('machine', {}).get('cpu_count', '?')} cores, fp32, "
        f"{_date(tp)}, one run): {tok(tp.get('ours'))} output tok/s on the mixed "
        f"{tp.get('num_prompts', '?')}-request workload, against {tok(tp.get('hf'))} for HF "
        f"({fmt(tp.get('speedup'), 2)}x) and {tok(peer.get('f32'))} / {tok(peer.get('q4_1'))} for "
        "llama.cpp on the F32 / Q4_1 GGUF of the same weights (`make bench` builds llama.cpp "
        f"once). Batch-1 greedy decode ({_date(dec)}): {tok(dec.get('ours'), 'decode_tok_s')} "
        f"tok/s, HF {tok(dec.get('hf'), 'decode_tok_s')}, llama.cpp "
        f"{tok(dpeer.get('f32'), 'decode_tok_s')} (F32) and {tok(dpeer.get('q4_1'), 'decode_tok_s')} "
        "(Q4_1, a quarter of the bytes per token)."
    )


def machine(r: Results) -> str:
    roof = r("roofline")
    bw, mm = roof.get("bandwidth_gb_s") or {}, roof.get("matmul_gflop_s") or {}
    m = roof.get("machine") or {}
    return (
        f"{m.get('cpu_count', '?')} vCPUs ({m.get('cpu', '?')}; kernel flags "
        f"{', '.join(m.get('cpu_flags', [])) or 'not recorded'}), {fmt(m.get('mem_gib'))} GiB, "
        f"Python {m.get('python', '?')}, JAX {m.get('jax_backend', '?')} backend. `bench_roofline.py` ({_date(roof)}): "
        f"{fmt(bw.get('numpy_read_gb_s'))} GB/s memory read bandwidth (numpy), "
        f"{fmt(bw.get('jax_read_gb_s'))} GB/s (a jitted JAX reduction), "
        f"{fmt(mm.get('numpy_sgemm_gflop_s'), 0)} GFLOP/s fp32 sgemm (numpy), "
        f"{fmt(mm.get('jax_matmul_gflop_s'), 0)} for a large jitted JAX matmul."
    )


def _paragraph(render: Callable[[Results], str]) -> Callable[[Results], str]:
    """A renderer of one sentence or two, as a wrapped paragraph on lines of its own."""
    return lambda r: f"\n{_wrap(render(r))}\n"


BLOCKS: dict[str, Callable[[Results], str]] = {
    "summary": lambda r: "\n" + summary(r),
    "startup": startup,
    "scheduling": scheduling,
    "quant": quant,
    "quant-summary": _paragraph(quant_summary),
    "decoding": _paragraph(decoding),
    "structured": structured,
    "kv-tiers": kv_tiers,
    "headline": _paragraph(headline),
    "machine": _paragraph(machine),
}


def render(text: str, results: Results) -> str:
    """`text` with every results block rewritten from `results`."""

    def one(m: re.Match) -> str:
        if m[2] not in BLOCKS:
            raise KeyError(f"unknown README block results:{m[2]}; known: {', '.join(BLOCKS)}")
        return m[1] + BLOCKS[m[2]](results) + m[4]

    return BLOCK.sub(one, text)


def stale_blocks(text: str, results: Results) -> list[str]:
    """Names of the blocks in `text` whose content is not what `results` render."""
    fresh = BLOCK.finditer(render(text, results))
    return [old[2] for old, new in zip(BLOCK.finditer(text), fresh) if old[3] != new[3]]


def write_readmes(results: Results, paths: tuple[Path, ...] | None = None) -> list[Path]:
    """Rewrite the blocks of each README in `paths` (default: READMES); returns those changed."""
    changed = []
    for path in READMES if paths is None else paths:
        text = path.read_text()
        new = render(text, results)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed
