"""Isolation inside the engine: one request's values, faults or page moves never fail another.

- Sampling values are bounded where they are parsed (`SamplingParams`), and each sequence's
  device row is typed when it is added, so nothing request-specific can raise inside a step;
  a row whose host-side preparation still raises fails alone.
- A failed step that holds a row which already finished (async scheduling runs it once more)
  fails the others without taking the engine down.
- Page moves (swap out/in, disk write/load) are transactions of their own sequence.
- Per-request KV compression only where the engine allows it, compiled at warm-up.
- Recovery rebuilds the page, penalty-slot and swap-pool accounting from scratch.

The engines run the tiny random Llama; faults are injected by wrapping runner methods, and
`check_accounting()` runs after every fault."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams
from minivllm_jax.args import EngineArgs
from minivllm_jax.engine.engine import LLMEngine
from minivllm_jax.engine.kv.swap import SwapPool
from minivllm_jax.ops.sampler import SAMPLING_ROW_DTYPE, sampling_row
from minivllm_jax.sampling_params import (
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    MAX_TOP_K,
)

PAGE = 16
MAX_LEN = 128
NUM_PAGES = 64
BASE = dict(
    max_num_seqs=4,
    max_model_len=MAX_LEN,
    page_size=PAGE,
    num_pages=NUM_PAGES,
    max_num_batched_tokens=32,
)
WINDOW = {"policy": "sink_window", "sink_tokens": 4, "window_tokens": PAGE}
SCORES = {
    "policy": "page_scores",
    "sink_tokens": 4,
    "window_tokens": PAGE,
    "budget_tokens": 3 * PAGE,
}


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **{"ignore_eos": True, **kw})


def ids(seed: int, n: int) -> list[int]:
    """Token ids avoiding <unk>, <s> and </s>; each seed its own prefix."""
    return np.random.default_rng(seed).integers(3, 128, size=n).tolist()


@pytest.fixture(scope="module")
def llm(tiny_model_with_tokenizer):
    """Warmed up, with per-request KV compression allowed (its programs compiled at warm-up)."""
    return LLM(
        str(tiny_model_with_tokenizer), **BASE, allow_request_kv_compression=True, use_tqdm=False
    )


def side_engine(llm: LLM, eos: tuple[int, ...] = (), **overrides) -> LLMEngine:
    """Another engine on the same weights (not warmed up: it compiles what it runs)."""
    e = llm.engine
    return LLMEngine(
        e.model_config,
        EngineArgs(**{**BASE, **overrides}).create_engine_config(),
        e.runner.params,
        llm.tokenizer,
        eos_token_ids=eos,
    )


def drain(engine: LLMEngine, done: dict | None = None) -> dict:
    """Step until idle; each request's final output (a request finishing twice is an error)."""
    done = {} if done is None else done
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, f"{out.request_id} finished twice"
                done[out.request_id] = out
    engine.step()  # reads a last step still in flight, if any
    return done


def run_all(engine: LLMEngine, prompts: list, params: list) -> list:
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = drain(engine)
    return [done[r] for r in rids]


def tokens(out) -> list[list[int]]:
    return [o.token_ids for o in out.outputs]


def assert_idle(engine: LLMEngine) -> None:
    """Nothing left: the accounting is consistent, every page free, the pool empty."""
    engine.check_accounting()
    assert engine.requests == {} and not engine.has_unfinished()
    assert engine.page_manager.num_free_pages == engine.config.cache.num_pages - 1
    assert not engine.scheduler.queued_moves
    pool = engine.scheduler.swap_pool
    assert pool is None or pool.used_pages == 0


def failed_with_error(out) -> bool:
    return out.error is not None and all(o.finish_reason == "error" for o in out.outputs)


# ---------------------------------------------------------------------- 1. sampling values


BAD_VALUES = [
    ("top_k", 2**32),
    ("top_k", 2**63),
    ("top_k", MAX_TOP_K + 1),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", True),
    ("seed", -1),
    ("seed", MAX_SEED + 1),
    ("seed", 2**64),
    ("seed", 1.5),
    ("n", 0),
    ("n", MAX_N + 1),
    ("n", 2.0),
    ("max_tokens", 0),
    ("max_tokens", MAX_TOKENS_LIMIT + 1),
    ("max_tokens", 2**63),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -0.5),
    ("temperature", MAX_TEMPERATURE * 2),
    ("top_p", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("min_p", math.nan),
    ("min_p", -0.1),
    ("presence_penalty", math.nan),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", MAX_REPETITION_PENALTY * 2),
    ("logprobs", 21),
    ("logprobs", True),
    ("logprobs", -1),
    ("stop_token_ids", [2**31]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", [2**63]),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_out_of_range_sampling_value_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{"temperature": 1.0, field: value})
    assert str(info.value).split()[0] == field  # the server reports the first word as `param`


def test_values_at_the_bounds_fit_the_device_row():
    params = SamplingParams(
        temperature=MAX_TEMPERATURE,
        top_k=MAX_TOP_K,
        seed=MAX_SEED,
        n=MAX_N,
        max_tokens=MAX_TOKENS_LIMIT,
        repetition_penalty=MAX_REPETITION_PENALTY,
        presence_penalty=-2.0,
        stop_token_ids=[2**31 - 1],
    )
    row = sampling_row(params, params.seed, MAX_N - 1)
    assert row.dtype == SAMPLING_ROW_DTYPE and int(row["top_k"]) == MAX_TOP_K
    assert (int(row["seed_hi"]) << 32) | int(row["seed_lo"]) == MAX_SEED


def test_bad_row_fails_alone_and_the_rest_of_its_step_runs(llm):
    """A row whose host-side preparation raises (here: its tokens) fails only its request, even
    in a step where others bring prompt work too (a failed step blames those)."""
    engine = llm.engine
    prompts = [ids(10, 9), ids(11, 14), ids(12, 6)]
    want = run_all(engine, prompts, [greedy(10)] * 3)
    bad = engine.add_request(
        ids(13, 7), greedy(10), request_id="bad"
    )  # first: it shares a step with prompt work
    rids = [engine.add_request(p, greedy(10)) for p in prompts]

    def broken(start, end):
        raise OverflowError("a token id out of int32")

    engine.requests[bad].seqs[0].tokens_between = broken
    done = drain(engine)
    assert failed_with_error(done["bad"]) and "OverflowError" in done["bad"].error
    assert [tokens(done[r]) for r in rids] == [tokens(w) for w in want]
    assert all(done[r].error is None for r in rids)
    assert_idle(engine)


# ---------------------------------------------------------------------- 2. a failed step holding a finished row


class FailingFetch:
    """A dispatched step whose results never arrive (the device failed while running it)."""

    def fetch(self):
        raise RuntimeError("injected fault at fetch")


@pytest.mark.parametrize("where", ["dispatch", "fetch"])
@pytest.mark.parametrize("finish", ["eos", "stop_string"])
def test_failed_decode_step_holding_a_finished_row(llm, monkeypatch, where, finish):
    """With async scheduling, the step after the one that sampled A's last token (EOS or a stop
    string) still carries A's row. A fault at its dispatch or at its fetch fails that step's
    other requests (a decode-only step: all are suspects), and A is reported once, finished."""
    prompt_a, others = ids(20, 7), [ids(21, 9), ids(22, 5)]
    free_run = run_all(side_engine(llm), [prompt_a], [greedy(40)])[0].outputs[0].token_ids
    word = lambda t: llm.tokenizer.decode([t])
    j = next(i for i in range(4, 40) if all(word(free_run[i]) not in word(t) for t in free_run[:i]))
    stop = free_run[j]
    if finish == "eos":
        eos, params_a = (stop,), greedy(40, ignore_eos=False)
    else:
        eos, params_a = (), greedy(40, stop=[word(stop)])
    reference = run_all(side_engine(llm, eos), [prompt_a], [params_a])[0]
    assert reference.outputs[0].finish_reason == "stop"
    m = len(reference.outputs[0].token_ids)

    engine = side_engine(llm, eos)
    real_run, hits = engine.runner.run, []

    def run(batch):
        seq_a = next((s for s in batch.seqs if s.request_id == "a"), None)
        if (
            not hits
            and seq_a is not None
            and batch.num_decodes == len(batch.seqs)
            and seq_a.num_pending
            and len(seq_a.output_token_ids) == m
        ):
            hits.append({s.request_id for s in batch.seqs})
            if where == "dispatch":
                raise RuntimeError("injected fault at dispatch")
            real_run(batch)
            return FailingFetch()
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    engine.add_request(prompt_a, params_a, request_id="a")
    for k, p in enumerate(others):
        engine.add_request(p, greedy(30), request_id=f"o{k}")
    done = drain(engine)

    assert hits == [{"a", "o0", "o1"}]
    assert done["a"].error is None and tokens(done["a"]) == tokens(reference)
    assert done["a"].outputs[0].finish_reason == "stop"
    assert all(failed_with_error(done[f"o{k}"]) for k in range(2))
    assert_idle(engine)
    monkeypatch.undo()
    assert tokens(run_all(engine, [prompt_a], [params_a])[0]) == tokens(reference)  # still serves


# ---------------------------------------------------------------------- 3. page moves are transactions


def fail_first_call(monkeypatch, obj, name: str) -> list[int]:
    """Make `obj.name` raise on its first call; returns a list that counts the calls."""
    real, calls = getattr(obj, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(f"injected {name} fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return calls


PRESSURE = [ids(30 + i, n) for i, n in enumerate((30, 45, 20, 38))]
TIGHT = 1 + MAX_LEN // PAGE  # pages for one full-length sequence: the prompts preempt each other


@pytest.fixture(scope="module")
def ample(llm):
    return run_all(side_engine(llm), PRESSURE, [greedy(80)] * 4)


@pytest.mark.parametrize("direction", ["gather_pages", "scatter_pages"])
def test_failed_swap_copy_recomputes_only_its_sequence(llm, ample, monkeypatch, direction):
    """A swap-out whose copy fails, or a swap-in whose copy back fails, makes that sequence
    recompute from its tokens: every request ends with the tokens of an unpressured run."""
    engine = side_engine(llm, num_pages=TIGHT, preemption_mode="swap")
    calls = fail_first_call(monkeypatch, engine.runner.page_mover, direction)
    got = run_all(engine, PRESSURE, [greedy(80)] * 4)
    assert calls and len(calls) >= 2  # it failed once, and later copies went through
    assert [tokens(g) for g in got] == [tokens(a) for a in ample] and all(
        g.error is None for g in got
    )
    assert engine.scheduler.swap_pool.num_recomputes >= 1
    assert_idle(engine)


def shared_prefix(n: int) -> list[list[int]]:
    prefix = ids(40, 4 * PAGE + 3)
    return [prefix + ids(41 + i, 5 + i) for i in range(n)]


def test_failed_disk_write_loses_only_the_disk_copy(llm, monkeypatch, tmp_path):
    """Evicted pages whose copy for the disk tier fails are simply not on disk: no request fails."""
    prompts = shared_prefix(2) + PRESSURE[:2]
    want = run_all(side_engine(llm), prompts, [greedy(40)] * 4)
    engine = side_engine(llm, num_pages=TIGHT, kv_disk_dir=str(tmp_path))
    real_write, writes = engine.tiers.write_to_disk, []

    def write(pages):
        writes.append(len(pages))
        if len(writes) == 1:
            raise RuntimeError("injected disk write fault")
        return real_write(pages)

    monkeypatch.setattr(engine.tiers, "write_to_disk", write)
    got = run_all(engine, prompts, [greedy(40)] * 4)
    assert writes and all(g.error is None for g in got)
    assert [tokens(g) for g in got] == [tokens(w) for w in want]
    assert_idle(engine)
    engine.close()


def test_failed_disk_load_fails_only_the_sequences_holding_those_pages(llm, monkeypatch, tmp_path):
    """Pages loaded from the disk tier whose copy into the cache fails: the request that holds
    them fails (their prefix-cache entries are forgotten), a request beside it completes, the
    queue is cleared (later steps run), and the same prompt later loads the pages fine."""
    hit, other = shared_prefix(1)[0], PRESSURE[2]
    want = run_all(side_engine(llm), [hit, other], [greedy(12)] * 2)
    first = side_engine(llm, kv_disk_dir=str(tmp_path))
    run_all(first, [hit], [greedy(12)])
    first.close()

    engine = side_engine(llm, kv_disk_dir=str(tmp_path))
    calls = fail_first_call(monkeypatch, engine.runner.page_mover, "scatter_pages")
    got = run_all(engine, [hit, other], [greedy(12)] * 2)
    assert calls and engine.page_manager.num_disk_hit_tokens > 0
    assert failed_with_error(got[0]) and "scatter_pages" in got[0].error
    assert got[1].error is None and tokens(got[1]) == tokens(want[1])
    assert_idle(engine)
    again = run_all(engine, [hit], [greedy(12)])[0]
    assert again.error is None and tokens(again) == tokens(want[0]) and again.num_cached_tokens > 0
    assert_idle(engine)
    engine.close()


def test_swap_pool_release_is_idempotent():
    pool = SwapPool("swap", capacity_pages=10, bytes_per_page=1)
    swapped = pool.take([3, 4, 5])
    pool.release(swapped)
    pool.release(swapped)  # a failure path releasing again: no effect
    assert pool.used_pages == 0


# ---------------------------------------------------------------------- 4. per-request KV compression


def test_request_compression_refused_unless_allowed(llm):
    engine = side_engine(llm)
    with pytest.raises(ValueError, match=r"^kv_compression: .*not enabled"):
        engine.add_request(ids(50, 8), greedy(8, kv_compression=WINDOW))
    assert engine.requests == {}


def test_request_compression_is_a_400_naming_the_field_over_http(llm):
    """The server maps the engine's refusal to a 400 naming `kv_compression` (a server without
    --allow-request-kv-compression), and the request leaves nothing behind."""
    import asyncio
    from types import SimpleNamespace

    import httpx

    from server.app import create_app

    engine = side_engine(llm)
    app = create_app(SimpleNamespace(engine=engine, tokenizer=llm.tokenizer), model_name="tiny")

    async def main() -> httpx.Response:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.post(
                    "/v1/completions",
                    json={"prompt": ids(55, 8), "max_tokens": 4, "kv_compression": WINDOW},
                )

    response = asyncio.run(main())
    assert response.status_code == 400, response.text
    assert (
        response.json()["error"]["param"] == "kv_compression"
        and "not enabled" in response.json()["error"]["message"]
    )
    assert engine.requests == {}


def test_request_compression_refused_across_processes(llm, monkeypatch):
    engine = llm.engine
    monkeypatch.setattr(
        engine.runner, "channel", object()
    )  # how the runner knows it is one of several
    with pytest.raises(ValueError, match=r"^kv_compression: .*several processes"):
        engine.add_request(ids(51, 8), greedy(8, kv_compression=SCORES))
    assert engine.requests == {}


def test_allowed_request_compression_compiles_nothing_after_warmup(llm):
    engine = llm.engine
    compiles, dropped = engine.stats().compiles, engine.stats().dropped_pages
    out = run_all(engine, [ids(52, 10)], [greedy(100, kv_compression=SCORES)])[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 100
    assert engine.stats().dropped_pages > dropped  # the policy ran ...
    assert engine.stats().compiles == compiles  # ... on the programs warm-up compiled
    assert_idle(engine)


def test_compression_failure_fails_only_its_request(llm, monkeypatch):
    engine = llm.engine
    plain = ids(53, 12)
    want = run_all(engine, [plain], [greedy(90)])[0]

    def broken(seq, index):
        raise RuntimeError("injected page_scores fault")

    monkeypatch.setattr(engine.runner, "page_scores", broken)
    got = run_all(engine, [ids(54, 10), plain], [greedy(90, kv_compression=SCORES), greedy(90)])
    assert failed_with_error(got[0]) and "page_scores fault" in got[0].error
    assert got[1].error is None and tokens(got[1]) == tokens(want)
    assert_idle(engine)


# ---------------------------------------------------------------------- 5. recovery rebuilds accounting


def test_recover_rebuilds_the_accounting_from_scratch(llm, monkeypatch):
    """A host-side crash in the middle of a step leaves the accounting unknown (here: a page
    reference leaked and one lost, a penalty slot and swap pages leaked, the cache lost);
    recover() does not trust it (freeing into it would raise) but rebuilds it all."""
    engine = side_engine(llm, preemption_mode="swap")
    rids = [engine.add_request(p, greedy(20, presence_penalty=0.5)) for p in PRESSURE[:3]]
    for _ in range(3):
        engine.step()
    running = engine.scheduler.running
    engine.page_manager.refcount[running[0].pages[0]] += (
        1  # what a crash may leave: a leaked reference ...
    )
    engine.page_manager.refcount[running[1].pages[-1]] = (
        0  # ... a page freeing it again would take below 0
    )
    engine.scheduler.free_penalty_slots.pop()
    engine.scheduler.swap_pool.used_pages += 3
    for leaf in jax.tree.leaves(engine.runner.cache):
        leaf.delete()
    with pytest.raises(AssertionError):
        engine.check_accounting()
    engine.recover()
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(engine.runner.cache))
    assert_idle(engine)
    assert sorted(engine.scheduler.free_penalty_slots) == list(
        range(engine.config.scheduler.max_num_seqs)
    )
    want = run_all(side_engine(llm), [PRESSURE[0]], [greedy(20, presence_penalty=0.5)])[0]
    assert tokens(run_all(engine, [PRESSURE[0]], [greedy(20, presence_penalty=0.5)])[0]) == tokens(
        want
    )
    assert all(r not in engine.requests for r in rids)


def test_lost_cache_in_a_failed_step_rebuilds_the_accounting(llm, monkeypatch):
    """A failed step that took the cache with it: the others are recomputed from a page
    manager rebuilt from scratch, with the same tokens."""
    engine = side_engine(llm)
    want = run_all(side_engine(llm), PRESSURE[:2], [greedy(20)] * 2)
    real_run, faults = engine.runner.run, []

    def run(batch):
        if any(s.request_id == "bad" for s in batch.seqs):
            faults.append(1)
            for leaf in jax.tree.leaves(engine.runner.cache):
                leaf.delete()
            raise RuntimeError("injected fault losing the cache")
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    rids = [engine.add_request(p, greedy(20)) for p in PRESSURE[:2]]
    for _ in range(4):
        engine.step()
    engine.add_request(ids(60, 6), greedy(5), request_id="bad")
    done = drain(engine)
    assert faults and failed_with_error(done["bad"])
    assert [tokens(done[r]) for r in rids] == [tokens(w) for w in want]
    assert_idle(engine)
