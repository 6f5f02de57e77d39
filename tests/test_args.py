"""Every engine knob is declared once, in `EngineArgs`: `LLM`'s keywords, the server's engine
flags and the `EngineConfig` groups are all derived from it (no model is loaded here)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from minivllm_jax import LLM
from minivllm_jax.args import EngineArgs
from minivllm_jax.config import CacheConfig, ParallelConfig, SchedulerConfig
from server.cli import SERVER_DEFAULTS, build_parser

FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
GROUPS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}


def engine_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest in FIELDS}


def test_llm_takes_exactly_the_engine_args_with_their_defaults():
    params = dict(inspect.signature(LLM).parameters)
    assert list(params) == list(FIELDS)  # model first, then every other knob
    for name, param in params.items():
        if name != "model":
            assert param.kind is param.KEYWORD_ONLY and param.default == FIELDS[name].default


def test_an_unknown_llm_keyword_names_itself_and_the_closest_knob(tmp_path):
    with pytest.raises(TypeError, match=r"'max_num_seq'; did you mean 'max_num_seqs'\?"):
        LLM(str(tmp_path / "never-loaded"), max_num_seq=4)  # refused before any loading
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        LLM(str(tmp_path / "never-loaded"), colour="blue")


def test_a_value_outside_a_knobs_choices_is_refused_by_name():
    with pytest.raises(ValueError, match=r"preemption_mode must be one of .*, got 'later'"):
        EngineArgs(preemption_mode="later")
    with pytest.raises(ValueError, match=r"dtype must be one of .*, got 'float64'"):
        EngineArgs(dtype="float64")


def test_every_knob_is_a_server_flag_with_its_default_choices_and_help():
    """Same default as `EngineArgs` unless `SERVER_DEFAULTS` says otherwise; every entry
    there really differs (otherwise it would not need saying) and names a knob."""
    parser = build_parser()
    actions = engine_actions(parser)
    assert set(actions) == set(FIELDS)
    parsed = vars(parser.parse_args([]))
    for name, field in FIELDS.items():
        expected = SERVER_DEFAULTS.get(name, field.default)
        assert parsed[name] == expected, name
        if field.metadata["choices"] is not None:
            assert tuple(actions[name].choices) == field.metadata["choices"], name
        assert field.metadata["help"].replace("%", "%%") in actions[name].help, name
    for name, value in SERVER_DEFAULTS.items():
        assert name in FIELDS and value != FIELDS[name].default, name


def test_server_flags_keep_their_spellings_and_build_the_engine_args():
    args = build_parser().parse_args(
        [
            "--model",
            "some-model",
            "--no-prefix-caching",
            "--no-async-scheduling",
            "--allow-request-kv-compression",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}',
            "--kv-compression",
            '{"policy": "sink_window", "window_tokens": 64}',
            "--max-num-seqs",
            "5",
            "--target-tpot-ms",
            "40",
            "--port",
            "9000",  # a server flag: not an engine knob
        ]
    )
    engine = EngineArgs.from_cli_args(args)
    assert engine == EngineArgs(
        model="some-model",
        enable_prefix_caching=False,
        async_scheduling=False,
        allow_request_kv_compression=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        kv_compression={"policy": "sink_window", "window_tokens": 64},
        max_num_seqs=5,
        target_tpot_ms=40.0,
        use_tqdm=SERVER_DEFAULTS["use_tqdm"],
    )
    with pytest.raises(ValueError, match="num_pages=None sizes the KV cache"):
        engine.create_engine_config()


def test_a_script_gets_the_flags_with_its_own_defaults_and_exclusions():
    parser = EngineArgs.add_cli_args(
        argparse.ArgumentParser(), defaults={"max_num_seqs": 3}, exclude=("seed",)
    )
    assert "--seed" not in parser._option_string_actions
    args = EngineArgs.from_cli_args(parser.parse_args(["--page-size", "8"]), use_tqdm=False)
    assert (args.max_num_seqs, args.page_size, args.use_tqdm, args.seed) == (3, 8, False, 0)
    with pytest.raises(TypeError, match="'max_num_seq'; did you mean 'max_num_seqs'"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), defaults={"max_num_seq": 3})
    with pytest.raises(TypeError, match="unexpected keyword argument 'sead'"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), exclude=("sead",))


def test_engine_config_groups_take_each_knob_of_the_same_name():
    args = EngineArgs(
        page_size=8,
        num_pages=40,
        kv_cache_dtype="int8",
        enable_prefix_caching=False,
        swap_space_gb=2.0,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        target_tpot_ms=30.0,
        target_ttft_ms=900.0,
        max_batch_wait_ms=5.0,
        async_scheduling=False,
        num_scheduler_steps=2,
        preemption_mode="swap",
        max_model_len=96,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        kv_compression={"policy": "sink_window", "window_tokens": 16},
        allow_request_kv_compression=True,
    )
    config = args.create_engine_config()
    for name, group in GROUPS.items():
        for field in dataclasses.fields(group):
            assert field.name in FIELDS, f"{group.__name__}.{field.name} is not an EngineArgs knob"
            assert getattr(getattr(config, name), field.name) == getattr(args, field.name)
    assert config.max_model_len == 96 and config.max_pages_per_seq == 12
    assert config.speculative.num_speculative_tokens == 3
    assert config.kv_compression.window_tokens == 16 and config.allow_request_kv_compression


def test_engine_config_replace_routes_flat_knobs_to_their_group_and_checks_them():
    config = EngineArgs(num_pages=64).create_engine_config()
    changed = config.replace(page_size=8, async_scheduling=False, max_model_len=100)
    assert changed.cache.page_size == 8 and changed.cache.num_pages == 64
    assert not changed.scheduler.async_scheduling and changed.max_model_len == 100
    assert config.cache.page_size == 16 and config.scheduler.async_scheduling  # a copy
    knobs = changed.knobs()  # flat, by the EngineArgs names, for a results file
    assert knobs["page_size"] == 8 and knobs["async_scheduling"] is False
    assert set(knobs) - {"speculative"} <= set(FIELDS)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 16, got 8"):
        config.replace(max_num_batched_tokens=8)
    with pytest.raises(TypeError):
        config.replace(max_num_seq=8)


def test_auto_page_count_holds_across_starts_with_slightly_different_free_memory(monkeypatch):
    """The page count is part of every step program's shape: two starts whose free memory
    differs by a little must size the same pool, or the program cache never loads (7,580 and
    7,664 pages were seen in two starts of the same server)."""
    import jax.numpy as jnp

    from minivllm_jax import args as args_module
    from minivllm_jax.ops.kv_cache import kv_bytes_per_page
    from tests.conftest import tiny_model_config

    cfg = tiny_model_config()
    engine_args = EngineArgs(model="m", max_num_seqs=10_000)
    page_bytes = kv_bytes_per_page(cfg, engine_args.page_size, jnp.float32)

    def pages_with_free(num_pages_of_memory: int) -> int:
        free = num_pages_of_memory * page_bytes / engine_args.kv_memory_fraction
        monkeypatch.setattr(args_module, "available_memory_bytes", lambda: free)
        return engine_args.auto_num_pages(cfg, 128)

    assert pages_with_free(7580) == pages_with_free(7664) == 1 + 7168
    for n in (100, 1000, 7580, 50_000):  # never more than the memory holds, at most 1/8 less
        assert n * 7 / 8 <= pages_with_free(n) - 1 <= n
    assert pages_with_free(1) - 1 == 128 // engine_args.page_size  # still one full sequence
