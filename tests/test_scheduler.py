"""Scheduler: ragged continuous batching (decodes first, then prompt chunks under a token
budget), the SLO-aware prompt budget, admission holds, limits, priorities and preemption
(no model)."""

from __future__ import annotations

import pytest

from minivllm_jax.args import EngineArgs
from minivllm_jax.config import AUTO_TPOT_FACTOR, EngineConfig, bucket_for
from minivllm_jax.engine.kv.pages import PageManager
from minivllm_jax.engine.kv.swap import SwapPool
from minivllm_jax.engine.sched_output import ScheduledBatch
from minivllm_jax.engine.scheduler import MIN_PROMPT_CHUNK, Scheduler
from minivllm_jax.engine.sequence import Sequence, SequenceStatus
from minivllm_jax.sampling_params import SamplingParams


def engine_config(num_pages: int = 1024, **knobs) -> EngineConfig:
    """An EngineConfig of these knobs (no model: the page count is given)."""
    return EngineArgs(num_pages=num_pages, **knobs).create_engine_config()


def make(num_pages=64, max_num_batched_tokens=32, max_model_len=64, **kw) -> Scheduler:
    cfg = engine_config(
        page_size=4,
        num_pages=num_pages,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        **kw,
    )
    return Scheduler(cfg, PageManager(cfg.cache.num_pages, cfg.cache.page_size))


def request(n_prompt, max_tokens=4, priority=0, arrival=0.0, first=0, streaming=True) -> Sequence:
    return Sequence(
        "r",
        list(range(first, first + n_prompt)),
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_time=arrival,
        streaming=streaming,
    )


def fake_step(s: Scheduler, now: float | None = None) -> ScheduledBatch:
    """What the engine does after a step, with token 7 as every sample."""
    batch = s.schedule(now)
    assert batch is not None
    check_batch(s, batch)
    for i, seq in enumerate(batch.seqs):
        samples = batch.samples_next_token(i)
        seq.num_computed_tokens += batch.num_new_tokens[i]
        s.page_manager.commit(seq)
        if samples:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                s.finish(seq, "length")
    return batch


def check_batch(s: Scheduler, batch: ScheduledBatch) -> None:
    """What holds for every step: decodes (one token each) first, then prompt chunks, within
    the token budget and the sequence limit, and a compiled step shape exists for it."""
    cfg = s.config
    assert len(batch.seqs) == len(batch.num_new_tokens) and len(set(batch.seqs)) == len(batch.seqs)
    assert 0 < batch.num_tokens <= cfg.scheduler.max_num_batched_tokens
    assert len(batch.seqs) <= cfg.scheduler.max_num_seqs
    assert all(n == 1 for n in batch.num_new_tokens[: batch.num_decodes])
    assert all(n >= 1 for n in batch.num_new_tokens)
    assert all(seq.status == SequenceStatus.RUNNING and seq in s.running for seq in batch.seqs)
    assert all(n <= seq.num_uncomputed_tokens for seq, n in zip(batch.seqs, batch.num_new_tokens))
    tokens = bucket_for(batch.num_tokens, cfg.scheduler.token_buckets)
    assert (
        tokens,
        bucket_for(len(batch.seqs), cfg.scheduler.seq_buckets(tokens)),
    ) in cfg.scheduler.step_shapes()


def run_all(s: Scheduler, limit=500) -> list[ScheduledBatch]:
    batches = []
    while s.has_unfinished() and len(batches) < limit:
        batches.append(fake_step(s))
    assert not s.has_unfinished()
    return batches


def decoding(s: Scheduler, n: int, streaming=True, max_tokens=100, n_prompt=1) -> list[Sequence]:
    """`n` sequences past their prompt: each feeds one token a step from now on."""
    seqs = [
        request(
            n_prompt, max_tokens=max_tokens, first=10 * i, arrival=float(i), streaming=streaming
        )
        for i in range(n)
    ]
    for q in seqs:
        s.add(q)
    batch = fake_step(s)
    assert batch.seqs == tuple(seqs) and batch.num_decodes == 0
    return seqs


# ---------------------------------------------------------------- continuous batching


def test_prompts_then_decodes_and_pages_return():
    s = make(max_num_batched_tokens=64)
    seqs = [request(5, first=10 * i) for i in range(3)]
    for q in seqs:
        s.add(q)
    first = fake_step(s)
    assert (
        first.num_decodes == 0 and first.seqs == tuple(seqs) and first.num_new_tokens == (5, 5, 5)
    )
    second = fake_step(s)
    assert (
        second.num_decodes == 3
        and second.seqs == tuple(seqs)
        and second.num_new_tokens == (1, 1, 1)
    )
    run_all(s)
    assert all(q.status == SequenceStatus.FINISHED and len(q.output_token_ids) == 4 for q in seqs)
    assert s.page_manager.num_free_pages == s.page_manager.num_usable_pages


def test_new_request_joins_running_decodes_in_the_same_step():
    s = make()
    a = request(5, max_tokens=8)
    s.add(a)
    fake_step(s)
    fake_step(s)
    b = request(6, max_tokens=3, first=40)
    s.add(b)
    batch = fake_step(s)  # a's decode and b's whole prompt in one step
    assert batch.seqs == (a, b) and batch.num_decodes == 1 and batch.num_new_tokens == (1, 6)
    batch = fake_step(s)
    assert batch.seqs == (a, b) and batch.num_decodes == 2


def test_long_prompt_is_prefilled_in_chunks():
    s = make()
    q = request(50, max_tokens=2)
    s.add(q)
    b1 = fake_step(s)
    assert (
        b1.num_new_tokens == (32,) and b1.num_decodes == 0 and not q.output_token_ids
    )  # a chunk samples nothing
    assert not b1.samples_next_token(0)
    b2 = fake_step(s)
    assert b2.num_decodes == 0 and b2.num_new_tokens == (18,) and q.output_token_ids == [7]
    b3 = fake_step(s)
    assert b3.num_decodes == 1 and b3.num_new_tokens == (1,)


def test_a_step_mixes_decodes_and_a_prompt_chunk_up_to_the_budget():
    s = make(num_pages=128, max_model_len=128)
    a, b = decoding(s, 2, streaming=False)
    q = request(50, first=60, arrival=5.0, streaming=False)
    s.add(q)
    batch = fake_step(s)
    assert batch.seqs == (a, b, q) and batch.num_decodes == 2
    assert (
        batch.num_new_tokens == (1, 1, 30)
        and batch.num_tokens == s.config.scheduler.max_num_batched_tokens
    )
    batch = fake_step(s)
    assert batch.seqs == (a, b, q) and batch.num_new_tokens == (1, 1, 20)


def test_prompt_chunks_share_the_token_budget():
    """The budget counts tokens, not padded rows: short prompts share a step, and a prompt that
    does not fit is chunked beside them; the next step finishes it beside the first's decode."""
    s = make(max_num_batched_tokens=32)
    for i in range(3):
        s.add(request(5, first=10 * i))
    assert fake_step(s).num_new_tokens == (5, 5, 5)

    s = make(max_num_batched_tokens=32)
    p = [request(20, first=30 * i, arrival=float(i), streaming=False) for i in range(3)]
    for q in p:
        s.add(q)
    first = fake_step(s)
    assert first.seqs == (p[0], p[1]) and first.num_new_tokens == (20, 12)
    second = fake_step(s)
    assert (
        second.seqs == tuple(p) and second.num_decodes == 1 and second.num_new_tokens == (1, 8, 20)
    )


def test_every_step_fits_the_token_budget():
    """A mixed workload (long and short prompts, streaming and offline, priorities, page
    pressure): every step's tokens fit `max_num_batched_tokens` (checked in `fake_step`)."""
    s = make(
        num_pages=34, max_num_batched_tokens=24, max_model_len=128, max_num_seqs=6
    )  # 33 pages: one sequence fits
    lengths = [3, 70, 11, 1, 40, 17, 5, 90, 2, 23, 8, 60]
    seqs = [
        request(
            n,
            max_tokens=4 + 5 * (i % 4),
            priority=i % 3,
            arrival=float(i),
            first=100 * i,
            streaming=i % 2 == 0,
        )
        for i, n in enumerate(lengths)
    ]
    for q in seqs[:6]:
        s.add(q)
    batches = [fake_step(s) for _ in range(3)]
    for q in seqs[6:]:
        s.add(q)
    batches += run_all(s)
    assert all(b.num_tokens <= 24 for b in batches)
    assert any(0 < b.num_decodes < len(b.seqs) for b in batches)  # some steps mix both kinds
    assert s.num_preemptions > 0
    assert all(len(q.output_token_ids) == q.params.max_tokens for q in seqs)
    assert s.page_manager.num_free_pages == s.page_manager.num_usable_pages


def test_decodes_are_never_stalled_by_a_prompt():
    """Before the ragged step, a prefill step excluded every decode; now each step until the
    prompt is done carries all decodes."""
    s = make(num_pages=128, max_model_len=256)
    decodes = decoding(s, 3)
    q = request(200, max_tokens=2, first=1000, arrival=10.0)
    s.add(q)
    steps = 0
    while q.num_computed_tokens < len(q.prompt_token_ids):
        batch = fake_step(s)
        steps += 1
        assert (
            batch.seqs[:3] == tuple(decodes) and batch.num_decodes == 3 and batch.seqs[3:] == (q,)
        )
    assert steps > 1 and all(len(d.output_token_ids) == steps + 1 for d in decodes)


def test_max_num_seqs_limits_running():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(request(3, first=10 * i))
    batch = fake_step(s)
    assert len(batch.seqs) == 2 and len(s.running) == 2 and len(s.waiting) == 2
    batch = fake_step(s)  # both running are decoding: no room for a third
    assert batch.num_decodes == 2 and len(batch.seqs) == 2 and len(s.waiting) == 2
    run_all(s)


def test_priority_orders_admission():
    s = make(max_num_seqs=1)
    low = request(3, priority=5, arrival=0.0)
    high = request(3, priority=-1, arrival=1.0, first=20)
    s.add(low)
    s.add(high)
    assert fake_step(s).seqs == (high,)


def test_priority_orders_decodes_and_prompt_chunks():
    s = make(num_pages=128, max_model_len=128, max_num_batched_tokens=16)
    low = request(3, max_tokens=20, priority=5, arrival=0.0, streaming=False)
    high = request(3, max_tokens=20, priority=-1, arrival=1.0, first=20, streaming=False)
    s.add(low)
    s.add(high)
    assert fake_step(s).seqs == (high, low)
    p_low = request(30, priority=4, arrival=2.0, first=100, streaming=False)
    p_high = request(30, priority=0, arrival=3.0, first=200, streaming=False)
    s.add(p_low)
    s.add(p_high)
    batch = fake_step(s)
    assert batch.seqs == (high, low, p_high) and batch.num_new_tokens == (1, 1, 14)


def test_preemption_under_page_pressure_recomputes_and_completes():
    s = make(num_pages=9)  # 8 usable pages of 4 tokens
    seqs = [request(7, max_tokens=12, arrival=float(i), first=10 * i) for i in range(3)]
    for q in seqs:
        s.add(q)
    run_all(s)
    assert s.num_preemptions > 0
    assert all(len(q.output_token_ids) == 12 for q in seqs)
    assert s.page_manager.num_free_pages == 8
    # The newest request is the one that got preempted.
    assert seqs[-1].num_preemptions > 0 and seqs[0].num_preemptions == 0


def test_finish_while_waiting_frees_nothing_twice():
    s = make()
    q = request(5)
    s.add(q)
    s.finish(q, "abort")
    assert not s.has_unfinished() and q.finish_reason == "abort"
    assert s.page_manager.num_free_pages == s.page_manager.num_usable_pages


def test_admission_reserves_a_page_for_rows_admitted_in_the_same_step():
    """`reserve` counts every running sequence, including those admitted earlier in this step,
    so after admission each running sequence can still grow by a page."""
    s = make(num_pages=5, max_num_batched_tokens=32)  # 4 usable pages of 4 tokens
    r = request(3, max_tokens=8)
    s.add(r)
    fake_step(s)  # r: 4 tokens in 1 page
    w1, w2 = request(4, first=20), request(4, first=40)  # 1 page each
    s.add(w1)
    s.add(w2)
    batch = fake_step(s)
    assert batch.seqs == (r, w1) and batch.num_decodes == 1
    assert s.page_manager.num_free_pages >= len(s.running)
    run_all(s)


def shared_prefix_hits(with_long_prompt: bool, scheduler_cls=Scheduler) -> int:
    """Prefix-cache hits (tokens) of two requests reusing cached prefixes, optionally while a
    long prompt is being chunked beside them."""
    cfg = engine_config(page_size=4, num_pages=33, max_model_len=64, max_num_batched_tokens=16)
    s = scheduler_cls(cfg, PageManager(cfg.cache.num_pages, cfg.cache.page_size))
    prefix_a, prefix_b = list(range(100, 116)), list(range(200, 216))  # 4 full pages each
    for prefix in (prefix_a, prefix_b):  # warm the cache, then finish
        s.add(Sequence("warm", prefix + [1, 2], SamplingParams(max_tokens=2)))
        run_all(s)
    if with_long_prompt:
        s.add(
            Sequence("long", list(range(300, 360)), SamplingParams(max_tokens=2), arrival_time=0.0)
        )
        fake_step(s)  # the long prompt is now being chunked
    a = Sequence(
        "a", prefix_a + list(range(400, 430)), SamplingParams(max_tokens=2), arrival_time=1.0
    )
    s.add(a)
    run_all(s)
    b = Sequence("b", prefix_b + [5, 6], SamplingParams(max_tokens=2), arrival_time=2.0)
    s.add(b)
    run_all(s)
    return a.num_cached_tokens + b.num_cached_tokens


def test_page_moves_come_in_the_schedule_output():
    """A swap-out and the swap-in that resumes it reach the engine as the `PageMoves` of the
    batch that relies on them (copies out first), once, and nothing stays queued."""
    cfg = engine_config(page_size=4, num_pages=16, max_model_len=64, max_num_batched_tokens=32)
    s = Scheduler(
        cfg, PageManager(cfg.cache.num_pages, cfg.cache.page_size), SwapPool("swap", 100, 1)
    )
    a = request(10, max_tokens=8)
    s.add(a)
    assert not fake_step(s).moves
    computed = list(a.pages[:3])  # 10 computed tokens
    s.preempt(a)
    swapped = a.swapped
    assert swapped is not None and s.queued_moves.swap_outs == ((a, swapped),)
    batch = s.schedule()  # re-admits it: its KV comes back into fresh pages
    assert batch.seqs == (a,) and batch.num_new_tokens == (1,)
    assert batch.moves.swap_outs == ((a, swapped),) and swapped.source_pages == computed
    assert batch.moves.swap_ins == ((a, swapped, tuple(a.pages[:3])),)
    assert not batch.moves.to_disk and not batch.moves.from_disk
    assert not s.queued_moves
    a.num_computed_tokens += 1
    a.output_token_ids.append(7)
    assert not s.schedule().moves  # handed over once


def test_waiting_admission_beside_a_long_chunk_does_not_evict_the_prefix_cache():
    """A waiting sequence that does not fit the step is not allocated and rolled back: that
    rollback took fresh pages on every step of the chunk and evicted cached prefixes."""
    assert shared_prefix_hits(False) == 32
    assert shared_prefix_hits(True) == 32


# ---------------------------------------------------------------- SLO-aware prompt budget

# Seconds of a step per token bucket (max_num_batched_tokens=64: buckets 1, 2, 3, 4, 6, 8, 12,
# 16, 24, 32, 48, 64). With 4 decodes (a 0.1 s step) the auto limit is 1.5 x 0.1 = 0.15 s: the
# largest bucket within it is 24 (0.15 s), so the prompt chunk is 24 - 4 = 20.
COSTS = {4: 0.1, 8: 0.11, 12: 0.12, 16: 0.13, 24: 0.15, 32: 0.19, 48: 0.3, 64: 0.4}


def slo_scheduler(costs=COSTS, streaming=True, max_num_batched_tokens=64, **kw):
    """A scheduler with 4 sequences decoding, a 200-token prompt waiting and `costs` measured."""
    s = make(num_pages=128, max_model_len=256, max_num_batched_tokens=max_num_batched_tokens, **kw)
    decodes = decoding(s, 4, streaming=streaming)
    for tokens, seconds in costs.items():
        s.costs.observe(tokens, seconds)
    q = request(200, first=1000, arrival=100.0)
    s.add(q)
    return s, decodes, q


def test_auto_tpot_budget_keeps_the_step_within_1_5x_a_decode_only_step():
    s, decodes, q = slo_scheduler()
    batch = s.schedule(now=100.0)
    limit = AUTO_TPOT_FACTOR * COSTS[4]
    within = max(
        b
        for b in s.config.scheduler.token_buckets
        if s.costs.estimate(b) is not None and s.costs.estimate(b) <= limit
    )
    assert within == 24
    assert batch.seqs == (*decodes, q) and batch.num_decodes == 4
    assert batch.num_new_tokens == (1, 1, 1, 1, within - 4)
    assert s.costs.estimate(bucket_for(batch.num_tokens, s.config.scheduler.token_buckets)) <= limit


def test_explicit_target_tpot_sets_the_limit():
    s, _, _ = slo_scheduler(target_tpot_ms=320)  # 48 tokens: 0.3 s
    assert s.schedule(now=100.0).num_new_tokens == (1, 1, 1, 1, 44)
    s, _, _ = slo_scheduler(target_tpot_ms=150)  # 24 tokens: 0.15 s
    assert s.schedule(now=100.0).num_new_tokens == (1, 1, 1, 1, 20)
    s, _, _ = slo_scheduler(target_tpot_ms=1000)  # everything fits: the whole budget
    assert s.schedule(now=100.0).num_new_tokens == (1, 1, 1, 1, 60)


def test_offline_decodes_leave_the_whole_budget_to_prompts():
    s, _, _ = slo_scheduler(streaming=False)
    assert s.schedule(now=100.0).num_new_tokens == (1, 1, 1, 1, 60)


def test_a_prompt_past_its_ttft_target_gets_the_whole_budget():
    s, _, _ = slo_scheduler(target_ttft_ms=100)
    assert s.schedule(now=100.05).num_new_tokens == (
        1,
        1,
        1,
        1,
        20,
    )  # waited 50 ms: TPOT limit holds
    s, _, _ = slo_scheduler(target_ttft_ms=100)
    assert s.schedule(now=101.0).num_new_tokens == (1, 1, 1, 1, 60)  # waited 1 s


def test_a_prompt_always_progresses_by_at_least_min_prompt_chunk():
    # Nothing measured yet: a small chunk, to learn the costs.
    s, _, _ = slo_scheduler(costs={})
    assert s.schedule(now=100.0).num_new_tokens == (1, 1, 1, 1, MIN_PROMPT_CHUNK)
    # Every step with a prompt chunk is too slow: the chunk still fills the bucket of
    # 4 decodes + MIN_PROMPT_CHUNK (24 tokens).
    s, _, _ = slo_scheduler(costs={4: 0.1, 8: 0.5})
    assert s.schedule(now=100.0).num_new_tokens == (1, 1, 1, 1, 20)
    s, _, _ = slo_scheduler(target_tpot_ms=0.001)
    assert s.schedule(now=100.0).num_new_tokens == (1, 1, 1, 1, 20)
    # With a 32-token budget only 16 tokens (0.19 s) fit 0.2 s, 12 after the decodes: the
    # progress floor wins.
    s, _, _ = slo_scheduler(
        costs={4: 0.1, 8: 0.12, 12: 0.15, 16: 0.19, 24: 0.3, 32: 0.4}, max_num_batched_tokens=32
    )
    batch = s.schedule(now=100.0)
    assert batch.num_new_tokens == (1, 1, 1, 1, 20) and batch.num_new_tokens[-1] >= MIN_PROMPT_CHUNK


@pytest.mark.parametrize("target_tpot_ms", [None, 50.0])
def test_many_streaming_decodes_near_the_token_budget(target_tpot_ms):
    s = make(num_pages=128, max_num_batched_tokens=32, target_tpot_ms=target_tpot_ms)
    decodes = decoding(s, 20)  # 20 decodes leave 12 tokens, fewer than MIN_PROMPT_CHUNK
    s.costs.observe(20, 0.1)
    q = request(40, first=1000, arrival=100.0)
    s.add(q)
    batch = fake_step(s, now=100.0)
    assert (
        batch.seqs[:20] == tuple(decodes) and batch.num_decodes == 20 and batch.num_tokens == 32
    )  # the rest: prompt


# ---------------------------------------------------------------- admission hold


def test_max_batch_wait_holds_a_lone_admission():
    s = make(max_batch_wait_ms=50)
    q = request(5, arrival=100.0)
    s.add(q)
    assert s.next_admission_time() == pytest.approx(100.05)
    assert s.schedule(now=100.01) is None and q.status == SequenceStatus.WAITING
    batch = s.schedule(now=100.06)
    assert batch is not None and batch.seqs == (q,)
    assert s.next_admission_time() is None


def test_max_batch_wait_admits_early_when_the_step_would_be_full():
    s = make(max_batch_wait_ms=50)  # 32-token budget
    p = [request(20, arrival=100.0, first=0), request(20, arrival=100.001, first=50)]
    for q in p:
        s.add(q)
    batch = s.schedule(now=100.01)
    assert batch is not None and batch.seqs == tuple(p) and batch.num_new_tokens == (20, 12)

    s = make(max_batch_wait_ms=50, max_num_seqs=2)  # or the running set would be full
    p = [request(3, arrival=100.0, first=0), request(3, arrival=100.001, first=50)]
    for q in p:
        s.add(q)
    assert s.schedule(now=100.01).seqs == tuple(p)


def test_max_batch_wait_does_not_hold_running_decodes():
    s = make(max_batch_wait_ms=50)
    a = request(5, max_tokens=8, arrival=100.0)
    s.add(a)
    fake_step(s, now=100.06)
    b = request(5, first=40, arrival=100.07)
    s.add(b)
    batch = fake_step(s, now=100.08)  # b is held, a decodes
    assert batch.seqs == (a,) and batch.num_decodes == 1
    assert s.next_admission_time() == pytest.approx(100.12)
    batch = fake_step(s, now=100.13)
    assert batch.seqs == (a, b) and batch.num_decodes == 1


# ---------------------------------------------------------------- step shapes


def test_token_buckets_cover_the_budget_with_bounded_padding():
    """Every step's token count has a bucket. Up to `max_num_seqs` tokens (where decode-only
    steps live) the half-octave ladder pads by at most 50%; above it doublings pad by at most
    100% (those steps carry prompt work, and prompt tokens fill the bucket)."""
    for max_num_seqs in (1, 16, 64, 100, 2048):
        for budget in (16, 32, 96, 100, 512, 1000):
            cfg = engine_config(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
            buckets = cfg.scheduler.token_buckets
            assert (
                list(buckets) == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == budget
            )
            for t in range(1, budget + 1):
                padded = bucket_for(t, buckets)
                assert t <= padded <= (1.5 if t <= min(max_num_seqs, budget) else 2) * t, (
                    max_num_seqs,
                    budget,
                    t,
                )


def test_seq_buckets_hold_every_step():
    for max_num_seqs in (1, 4, 16, 64, 256):
        cfg = engine_config(max_num_seqs=max_num_seqs, max_num_batched_tokens=128)
        for t in cfg.scheduler.token_buckets:
            seqs = cfg.scheduler.seq_buckets(t)
            assert min(t, max_num_seqs) in seqs and all(
                1 <= n <= min(t, max_num_seqs) for n in seqs
            )
        shapes = cfg.scheduler.step_shapes()
        assert len(shapes) == len(set(shapes))
        assert {t for t, _ in shapes} == set(cfg.scheduler.token_buckets)


def test_default_server_config_compiles_few_step_programs():
    assert len(engine_config(max_num_seqs=16).scheduler.step_shapes()) <= 40


def test_grammar_rows_never_run_multi_step_or_speculate():
    """A structured-output row's next mask needs its last token: no multi-step batch and no
    draft while one runs; the same batch without it runs multi-step and may draft."""

    s = make(
        num_scheduler_steps=4,
        max_num_seqs=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    plain, constrained = request(5, max_tokens=20), request(5, max_tokens=20, first=10)
    constrained.grammar = object()  # the scheduler only asks whether there is one
    for seq in (plain, constrained):
        s.add(seq)
    fake_step(s)  # both prefill
    assert not s._multi_step_fits([plain, constrained]) and s._multi_step_fits([plain])
    assert not s.wants_draft(constrained) and s.wants_draft(plain)
    assert fake_step(s).num_steps == 1 and s.num_multi_steps == 0
    s.finish(constrained, "stop")
    assert fake_step(s).num_steps == 4
