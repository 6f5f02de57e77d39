"""Scheduler: prefill-first continuous batching, limits, priorities and preemption (no model)."""

from __future__ import annotations

from minivllm_jax.config import EngineConfig
from minivllm_jax.engine.block_manager import BlockManager
from minivllm_jax.engine.scheduler import Scheduler
from minivllm_jax.engine.sequence import Sequence, SequenceStatus
from minivllm_jax.sampling_params import SamplingParams


def make(num_pages=64, max_num_batched_tokens=32, **kw) -> Scheduler:
    cfg = EngineConfig(page_size=4, num_pages=num_pages, max_model_len=64,
                       max_num_batched_tokens=max_num_batched_tokens, **kw)  # fmt: skip
    return Scheduler(cfg, BlockManager(cfg.num_pages, cfg.page_size))


def request(n_prompt, max_tokens=4, priority=0, arrival=0.0, first=0) -> Sequence:
    return Sequence("r", list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens),
                    priority=priority, arrival_time=arrival)  # fmt: skip


def fake_step(s: Scheduler) -> tuple:
    """What the engine does after a step, with token 7 as every sample."""
    batch = s.schedule()
    assert batch is not None
    for i, seq in enumerate(batch.seqs):
        samples = batch.samples_next_token(i)
        seq.num_computed_tokens += batch.num_new_tokens[i]
        s.block_manager.commit(seq)
        if samples:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                s.finish(seq, "length")
    return batch


def run_all(s: Scheduler, limit=500) -> list:
    batches = []
    while s.has_unfinished() and len(batches) < limit:
        batches.append(fake_step(s))
    assert not s.has_unfinished()
    return batches


def test_prefill_first_then_decode_and_pages_return():
    s = make(max_num_batched_tokens=64)
    seqs = [request(5, first=10 * i) for i in range(3)]
    for q in seqs:
        s.add(q)
    first = fake_step(s)
    assert first.is_prefill and len(first.seqs) == 3 and first.num_new_tokens == (5, 5, 5)
    second = fake_step(s)
    assert not second.is_prefill and len(second.seqs) == 3
    run_all(s)
    assert all(q.status == SequenceStatus.FINISHED and len(q.output_token_ids) == 4 for q in seqs)
    assert s.block_manager.num_free_pages == s.block_manager.num_usable_pages


def test_new_request_joins_running_decodes():
    s = make()
    a = request(5, max_tokens=8)
    s.add(a)
    fake_step(s)
    fake_step(s)
    b = request(6, max_tokens=3, first=40)
    s.add(b)
    batch = fake_step(s)
    assert batch.is_prefill and batch.seqs == (b,)
    batch = fake_step(s)
    assert set(batch.seqs) == {a, b}


def test_long_prompt_is_prefilled_in_chunks():
    s = make()
    q = request(50, max_tokens=2)
    s.add(q)
    b1 = fake_step(s)
    assert b1.num_new_tokens == (32,) and not q.output_token_ids  # a chunk samples nothing
    b2 = fake_step(s)
    assert b2.is_prefill and b2.num_new_tokens == (18,) and q.output_token_ids == [7]


def test_prefill_rows_respect_token_budget():
    s = make(max_num_batched_tokens=32)  # 5-token prompts pad to 16 columns: 2 rows fit
    for i in range(3):
        s.add(request(5, first=10 * i))
    assert len(fake_step(s).seqs) == 2


def test_max_num_seqs_limits_running():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(request(3, first=10 * i))
    batch = fake_step(s)
    assert len(batch.seqs) == 2 and len(s.running) == 2 and len(s.waiting) == 2
    run_all(s)


def test_priority_orders_admission():
    s = make(max_num_seqs=1)
    low = request(3, priority=5, arrival=0.0)
    high = request(3, priority=-1, arrival=1.0, first=20)
    s.add(low)
    s.add(high)
    assert fake_step(s).seqs == (high,)


def test_preemption_under_page_pressure_recomputes_and_completes():
    s = make(num_pages=9)  # 8 usable pages of 4 tokens
    seqs = [request(7, max_tokens=12, arrival=float(i), first=10 * i) for i in range(3)]
    for q in seqs:
        s.add(q)
    run_all(s)
    assert s.num_preemptions > 0
    assert all(len(q.output_token_ids) == 12 for q in seqs)
    assert s.block_manager.num_free_pages == 8
    # The newest request is the one that got preempted.
    assert seqs[-1].num_preemptions > 0 and seqs[0].num_preemptions == 0


def test_finish_while_waiting_frees_nothing_twice():
    s = make()
    q = request(5)
    s.add(q)
    s.finish(q, "abort")
    assert not s.has_unfinished() and q.finish_reason == "abort"
    assert s.block_manager.num_free_pages == s.block_manager.num_usable_pages


def test_bucket_lists_cover_every_shape_with_bounded_padding():
    """Every decode page-list length and prefill token count has a bucket; page lists pad by
    at most 1.5x (the half-octave ladder), everything else by at most 2x."""
    from minivllm_jax.config import bucket_for

    cfg = EngineConfig(max_num_seqs=16, max_model_len=300, page_size=16, max_num_batched_tokens=96)
    for rows in cfg.decode_batch_buckets:
        buckets = cfg.page_list_buckets(rows)
        assert list(buckets) == sorted(set(buckets)) and buckets[-1] == rows * cfg.max_pages_per_seq
        for total in range(rows // 2 + 1, buckets[-1] + 1):  # a rows bucket holds > rows/2 sequences
            assert total <= bucket_for(total, buckets) <= max(16, 1.5 * total)
    tokens = cfg.prefill_token_buckets
    assert tokens[-1] == 96 and all(t <= bucket_for(t, tokens) <= max(16, 2 * t) for t in range(1, 97))
    assert {s[3] for s in cfg.decode_shapes()} >= set(cfg.page_list_buckets(cfg.max_num_seqs))


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
    assert batch.seqs == (w1,)
    assert s.block_manager.num_free_pages >= len(s.running)
    run_all(s)


def shared_prefix_hits(with_long_prompt: bool, scheduler_cls=Scheduler) -> int:
    """Prefix-cache hits (tokens) of two requests reusing cached prefixes, optionally while a
    long prompt is being chunked beside them."""
    cfg = EngineConfig(page_size=4, num_pages=33, max_model_len=64, max_num_batched_tokens=16)
    s = scheduler_cls(cfg, BlockManager(cfg.num_pages, cfg.page_size))
    prefix_a, prefix_b = list(range(100, 116)), list(range(200, 216))  # 4 full pages each
    for prefix in (prefix_a, prefix_b):  # warm the cache, then finish
        s.add(Sequence("warm", prefix + [1, 2], SamplingParams(max_tokens=2)))
        run_all(s)
    if with_long_prompt:
        s.add(Sequence("long", list(range(300, 360)), SamplingParams(max_tokens=2), arrival_time=0.0))
        fake_step(s)  # the long prompt is now being chunked
    a = Sequence("a", prefix_a + list(range(400, 430)), SamplingParams(max_tokens=2), arrival_time=1.0)
    s.add(a)
    run_all(s)
    b = Sequence("b", prefix_b + [5, 6], SamplingParams(max_tokens=2), arrival_time=2.0)
    s.add(b)
    run_all(s)
    return a.num_cached_tokens + b.num_cached_tokens


def test_waiting_admission_beside_a_long_chunk_does_not_evict_the_prefix_cache():
    """A waiting sequence that does not fit the step is not allocated and rolled back: that
    rollback took fresh pages on every step of the chunk and evicted cached prefixes."""
    assert shared_prefix_hits(False) == 32
    assert shared_prefix_hits(True) == 32
