"""The KV memory hierarchy on the tiny random Llama: swap instead of recompute at preemption,
the disk tier under the prefix cache (restart and hit, corruption is a miss, the size budget),
and their bookkeeping (swap pool and pages back to zero).

Every output is compared with a run of an engine with ample pages and no tier: the tiers may
only change where KV comes from, never a token."""

from __future__ import annotations

from pathlib import Path

import pytest

from minivllm_jax import SamplingParams
from minivllm_jax.engine.engine import LLMEngine
from minivllm_jax.engine.kv.pages import ROOT_DIGEST, page_digest
from tests.test_engine_paths import (
    MAX_LEN,
    PAGE,
    greedy,
    idle_free_pages,
    llm,  # noqa: F401 (a fixture)
    random_ids,
    run_all,
    side_engine,
    tiny,  # noqa: F401 (a fixture)
)

TIGHT_PAGES = 1 + MAX_LEN // PAGE  # one full-length sequence: four prompts preempt each other


def assert_same_tokens(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs], g.request_id


def assert_idle(engine: LLMEngine) -> None:
    """Every page back in the free list, the swap pool empty, nothing queued to move."""
    assert engine.page_manager.num_free_pages == idle_free_pages(engine)
    assert not engine.scheduler.queued_moves
    pool = engine.scheduler.swap_pool
    assert pool is None or pool.used_pages == 0


@pytest.fixture(scope="module")
def pressure_workload():
    prompts = [random_ids(3100 + i, n) for i, n in enumerate([70, 100, 130, 45])]
    params = [greedy(96) for _ in prompts]
    params[1] = SamplingParams(temperature=0.8, seed=7, max_tokens=80, n=2, ignore_eos=True)
    return prompts, params


@pytest.fixture(scope="module")
def ample_outputs(llm, pressure_workload):  # noqa: F811
    return run_all(side_engine(llm, max_num_batched_tokens=64), *pressure_workload)


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_preemption_modes_give_the_same_tokens(
    llm,  # noqa: F811 (the fixture)
    pressure_workload,
    ample_outputs,
    mode,
    async_scheduling,
):
    """Under page pressure (pages for one full-length sequence, four prompts) every request
    finishes with the tokens of an unpressured run, in every preemption mode; swap and auto
    really swap, and the pool and pages are all back afterwards."""
    engine = side_engine(
        llm,
        num_pages=TIGHT_PAGES,
        max_num_batched_tokens=64,
        preemption_mode=mode,
        async_scheduling=async_scheduling,
    )
    got = run_all(engine, *pressure_workload)
    assert_same_tokens(got, ample_outputs)
    assert engine.scheduler.num_preemptions > 0
    pool = engine.scheduler.swap_pool
    if mode == "recompute":
        assert pool is None
    else:
        assert pool.num_swap_outs > 0 and pool.num_swap_ins == pool.num_swap_outs
    assert_idle(engine)


def test_full_swap_pool_falls_back_to_recompute(llm, pressure_workload, ample_outputs):  # noqa: F811
    """A pool too small for any sequence's pages: preemption recomputes instead, same tokens."""
    engine = side_engine(
        llm,
        num_pages=TIGHT_PAGES,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_space_gb=1e-9,
    )
    got = run_all(engine, *pressure_workload)
    assert_same_tokens(got, ample_outputs)
    assert engine.scheduler.swap_pool.capacity_pages == 0
    assert (
        engine.scheduler.swap_pool.num_swap_outs == 0
        and engine.scheduler.swap_pool.num_recomputes > 0
    )
    assert_idle(engine)


def test_auto_recomputes_when_copies_cost_more(llm, pressure_workload, ample_outputs):  # noqa: F811
    """The cost model: with page copies made to look slower than prefill, auto recomputes."""
    engine = side_engine(
        llm, num_pages=TIGHT_PAGES, max_num_batched_tokens=64, preemption_mode="auto"
    )
    engine.scheduler.swap_pool.bytes_per_second = 1.0  # a copy of any page takes "forever"
    engine.scheduler.costs.observe(64, 0.01)  # and a prompt token has been measured
    got = run_all(engine, *pressure_workload)
    assert_same_tokens(got, ample_outputs)
    assert (
        engine.scheduler.swap_pool.num_swap_outs == 0
        and engine.scheduler.swap_pool.num_recomputes > 0
    )


def test_abort_while_swapped_out_frees_the_pool(llm, pressure_workload):  # noqa: F811
    engine = side_engine(
        llm, num_pages=TIGHT_PAGES, max_num_batched_tokens=64, preemption_mode="swap"
    )
    prompts, params = pressure_workload
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while not any(s.swapped is not None for s in engine.scheduler.waiting):
        engine.step()
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    engine.step()
    assert_idle(engine)


# ---------------------------------------------------------------- the disk tier


def shared_prefix_prompts(n: int, prefix_len: int = 5 * PAGE + 3) -> list[list[int]]:
    prefix = random_ids(4200, prefix_len)
    return [prefix + random_ids(4300 + i, 9 + i) for i in range(n)]


def disk_engine(llm, directory: Path, **overrides) -> LLMEngine:  # noqa: F811
    return side_engine(llm, kv_disk_dir=str(directory), **overrides)


def test_restart_hits_the_disk_tier(llm, tmp_path):  # noqa: F811
    """Pages written at a clean shutdown are found by a new engine on the same folder: the
    shared prefix is served from disk (num_cached_tokens), the tokens are unchanged."""
    prompts = shared_prefix_prompts(3)
    params = [greedy(12)] * 3
    want = run_all(side_engine(llm), prompts, params)
    first = disk_engine(llm, tmp_path)
    run_all(first, prompts[:1], params[:1])
    first.close()
    assert first.tiers.disk.num_pages >= 5
    second = disk_engine(llm, tmp_path)
    got = run_all(second, prompts, params)
    assert_same_tokens(got, want)
    assert got[0].num_cached_tokens == 5 * PAGE  # the whole prefix, from disk
    assert second.page_manager.num_disk_hit_tokens == 5 * PAGE
    assert got[1].num_cached_tokens == 5 * PAGE  # ... then from memory
    assert second.page_manager.num_memory_hit_tokens >= 10 * PAGE
    assert_idle(second)


def test_another_model_does_not_see_the_pages(llm, tmp_path):  # noqa: F811
    first = disk_engine(llm, tmp_path)
    run_all(first, shared_prefix_prompts(1), [greedy(4)])
    first.close()
    other = disk_engine(llm, tmp_path, page_size=2 * PAGE)  # another layout: another namespace
    assert other.tiers.disk.num_pages == 0
    assert run_all(other, shared_prefix_prompts(1), [greedy(4)])[0].num_cached_tokens == 0


def test_corrupt_page_file_is_a_miss(llm, tmp_path):  # noqa: F811
    prompts = shared_prefix_prompts(1)
    want = run_all(side_engine(llm), prompts, [greedy(12)])
    first = disk_engine(llm, tmp_path)
    run_all(first, prompts, [greedy(12)])
    first.close()
    files = sorted(tmp_path.rglob("*.kvpage"), key=lambda f: f.stat().st_mtime)
    assert len(files) >= 5
    # Corrupt the file of the prefix's third page (found by the prompt's digest chain): a byte of
    # its payload flipped.
    second = disk_engine(llm, tmp_path)
    parent = ROOT_DIGEST
    for i in range(3):
        parent = page_digest(parent, tuple(prompts[0][i * PAGE : (i + 1) * PAGE]))
    target = next(f for f in files if f.stem == parent.hex())
    data = bytearray(target.read_bytes())
    data[-10] ^= 0xFF
    target.write_bytes(bytes(data))
    got = run_all(second, prompts, [greedy(12)])
    assert_same_tokens(got, want)
    assert got[0].num_cached_tokens == 2 * PAGE  # two pages from disk, then the corrupt one missed
    assert second.tiers.disk.num_corrupt == 1 and not target.exists()
    assert second.page_manager.num_disk_hit_tokens == 2 * PAGE


def test_evicted_pages_reach_disk_and_come_back(llm, tmp_path):  # noqa: F811
    """With few pages, a finished prompt's cached pages are reused by others (evicted): they are
    written to disk on the way out and the prompt's second run loads them back."""
    prompts = shared_prefix_prompts(1) + [random_ids(4400 + i, 150) for i in range(3)]
    params = [greedy(8)] * len(prompts)
    want = run_all(side_engine(llm), prompts + prompts[:1], params + params[:1])
    engine = disk_engine(
        llm, tmp_path, num_pages=TIGHT_PAGES, max_num_batched_tokens=64, max_num_seqs=1
    )
    got = run_all(engine, prompts, params)
    engine.tiers.disk.flush()
    assert engine.tiers.disk.num_written >= 5
    again = run_all(engine, prompts[:1], params[:1])
    assert_same_tokens(got + again, want)
    assert again[0].num_cached_tokens == 5 * PAGE
    assert engine.page_manager.num_disk_hit_tokens == 5 * PAGE
    assert_idle(engine)


def test_disk_budget_holds(llm, tmp_path):  # noqa: F811
    first = disk_engine(llm, tmp_path)
    run_all(first, shared_prefix_prompts(1), [greedy(4)])
    first.close()
    page_file = next(tmp_path.rglob("*.kvpage")).stat().st_size
    budget = 3 * page_file + page_file // 2
    engine = disk_engine(llm, tmp_path, kv_disk_gb=budget / 2**30)
    prompts = [random_ids(4500 + i, 4 * PAGE + 1) for i in range(3)]
    run_all(engine, prompts, [greedy(4)] * 3)
    engine.close()
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.kvpage"))
    assert engine.tiers.disk.num_bytes <= budget and on_disk <= budget
    assert engine.tiers.disk.num_evicted > 0


# ---------------------------------------------------------------- KV compression in the engine

WINDOW = {"policy": "sink_window", "sink_tokens": 4, "window_tokens": 2 * PAGE}
SCORES = {
    "policy": "page_scores",
    "sink_tokens": 4,
    "window_tokens": 2 * PAGE,
    "budget_tokens": 5 * PAGE,
}


def pages_per_step(
    engine: LLMEngine, prompt: list[int], params: SamplingParams
) -> tuple[list[int], list]:
    """Pages the request holds after each step, and its output."""
    request_id = engine.add_request(prompt, params)
    held, out = [], None
    while engine.has_unfinished():
        for o in engine.step():
            out = o if o.request_id == request_id else out
        held += [len(s.pages) for s in engine.scheduler.running]
    return held, out


@pytest.mark.parametrize("policy", [WINDOW, SCORES])
def test_compressed_generation_runs_in_constant_pages(llm, policy):  # noqa: F811
    """A generation 10x longer than what the policy keeps holds a constant number of pages once
    past it (engine-wide policy); every page is back at the end."""
    engine = side_engine(llm, kv_compression=policy)
    prompt = random_ids(4600, 20)
    held, out = pages_per_step(engine, prompt, greedy(340))
    assert len(out.outputs[0].token_ids) == 340
    kept = 1 + 2 if policy is WINDOW else 5  # full pages kept: sinks + window, or the budget
    steady = held[len(held) // 2 :]
    assert max(steady) <= kept + 2  # + the partial page and the one the next token may open
    assert max(held) <= kept + 2 and engine.stats().dropped_pages >= (20 + 340) // PAGE - kept - 2
    assert_idle(engine)


def test_compression_is_per_request_and_leaves_other_rows_alone(llm):  # noqa: F811
    """One request with a window policy batched with one without: the latter's tokens equal its
    solo run; the former's tokens equal the uncompressed ones until its first drop."""
    prompts = [random_ids(4700, 30), random_ids(4701, 30)]
    solo = run_all(side_engine(llm), prompts, [greedy(200)] * 2)
    engine = side_engine(llm, allow_request_kv_compression=True)
    compressed = SamplingParams(
        temperature=0.0, max_tokens=200, ignore_eos=True, kv_compression=WINDOW
    )
    got = run_all(engine, prompts, [compressed, greedy(200)])
    assert got[1].outputs[0].token_ids == solo[1].outputs[0].token_ids
    first_drop = (
        4 * PAGE - 30
    )  # 4 full pages exist before the sink page + 2 window pages are exceeded
    assert got[0].outputs[0].token_ids[:first_drop] == solo[0].outputs[0].token_ids[:first_drop]
    assert engine.stats().dropped_pages > 0
    assert_idle(engine)


def test_short_generation_under_a_policy_is_unchanged(llm):  # noqa: F811
    prompts = [random_ids(4800 + i, 20) for i in range(3)]
    want = run_all(side_engine(llm), prompts, [greedy(20)] * 3)
    engine = side_engine(llm, kv_compression=WINDOW)
    assert_same_tokens(run_all(engine, prompts, [greedy(20)] * 3), want)
    assert engine.stats().dropped_pages == 0


def test_bad_compression_config_is_an_error():
    with pytest.raises(ValueError, match="unknown KV compression policy"):
        SamplingParams(kv_compression={"policy": "lru"})
    with pytest.raises(ValueError, match="budget_tokens"):
        SamplingParams(kv_compression={"policy": "page_scores"})
