"""No client can read another's data, and nothing on disk can take the engine down: private
folders for the KV disk tier and the compiled-program cache, authenticated page files whose
malformed contents are misses, the prefix cache salted per request or API key, /metrics behind
the key, the CLI's refusal of an open non-loopback bind, and native kernels that check their
inputs."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat

import numpy as np
import pytest

from minivllm_jax.engine.kv import disk as kv_disk
from minivllm_jax.engine.kv.disk import DiskPageStore
from minivllm_jax.engine.kv.pages import ROOT_DIGEST, page_digest

NS = "model-abc123"


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _page() -> dict[str, np.ndarray]:
    return {
        "k": np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4),
        "v": np.ones((2, 4, 4), np.int8),
    }


def _one_page() -> tuple[bytes, bytes, tuple[int, ...]]:
    tokens = (11, 12, 13, 14)
    return page_digest(ROOT_DIGEST, tokens), ROOT_DIGEST, tokens


# ---------------------------------------------------------------- the KV disk tier's folder


def test_disk_tier_creates_private_folders_files_and_key(tmp_path):
    store = DiskPageStore(tmp_path / "kv", max_bytes=1 << 20, namespace=NS)
    d, p, t = _one_page()
    assert store.save(d, p, t, _page())
    store.close()
    (page_file,) = store.root.glob("*/*.kvpage")
    assert (
        _mode(tmp_path / "kv") == 0o700
        and _mode(store.root) == 0o700
        and _mode(page_file.parent) == 0o700
    )
    assert _mode(page_file) == 0o600
    key = tmp_path / "kv" / kv_disk.KEY_FILE
    assert _mode(key) == 0o600 and len(key.read_bytes()) == kv_disk.KEY_BYTES
    again = DiskPageStore(
        tmp_path / "kv", max_bytes=1 << 20, namespace=NS
    )  # a restart reads the same key
    np.testing.assert_array_equal(again.load(d, p, t)["k"], _page()["k"])
    again.close()


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_disk_tier_refuses_a_folder_others_can_write(tmp_path, mode):
    folder = tmp_path / "kv"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(ValueError, match="writable by group or others"):
        DiskPageStore(folder, max_bytes=1 << 20, namespace=NS)
    assert not (folder / NS).exists() and not (folder / kv_disk.KEY_FILE).exists()


def test_disk_tier_refuses_a_folder_of_another_user(tmp_path, monkeypatch):
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(
        os, "geteuid", lambda: os.stat(folder).st_uid + 1
    )  # as if another user made it
    with pytest.raises(ValueError, match="not by this user"):
        DiskPageStore(folder, max_bytes=1 << 20, namespace=NS)


def test_disk_tier_refuses_a_key_file_others_can_read(tmp_path):
    DiskPageStore(tmp_path, max_bytes=1 << 20, namespace=NS).close()
    (tmp_path / kv_disk.KEY_FILE).chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        DiskPageStore(tmp_path, max_bytes=1 << 20, namespace=NS)


def test_engine_with_an_open_disk_folder_fails_at_construction(tiny_model_with_tokenizer, tmp_path):
    from minivllm_jax import LLM

    folder = tmp_path / "kv"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(ValueError, match="KV disk directory"):
        LLM(
            str(tiny_model_with_tokenizer),
            max_model_len=64,
            num_pages=32,
            page_size=4,
            kv_disk_dir=str(folder),
            kv_disk_gb=0.01,
            use_tqdm=False,
        )


# ---------------------------------------------------------------- malformed page files are misses


def _forge(
    store: DiskPageStore, digest: bytes, head: bytes, payload: bytes = b"", key: bytes | None = None
) -> None:
    """Write a page file as the store would, but with this header and payload, signed with the
    directory's key (so the checks after the HMAC are the ones tested) or with `key`."""
    prefix = kv_disk._PREFIX.pack(kv_disk.MAGIC, kv_disk.FORMAT_VERSION, len(head))
    mac = hmac.new(
        store._key if key is None else key, prefix + head + payload, hashlib.sha256
    ).digest()
    path = store._path(digest)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(prefix + mac + head + payload)


def _header(store: DiskPageStore, **changes) -> dict:
    d, p, t = _one_page()
    header = {
        "namespace": store.namespace,
        "digest": d.hex(),
        "parent": p.hex(),
        "tokens": list(t),
        "arrays": [{"name": "k", "dtype": "<f4", "shape": [2, 2]}],
        "payload_bytes": 16,
    }
    return {**header, **changes}


MALFORMED = {
    "nested 100k deep": lambda s: (b"[" * 100_000 + b"]" * 100_000, b""),
    "nested 100k deep in an object": lambda s: (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, b""),
    "not UTF-8": lambda s: (b'{"namespace": "\xff\xfe"}', b""),
    "not an object": lambda s: (b"[1, 2, 3]", b""),
    "fields missing": lambda s: (b"{}", b""),
    "payload shorter than said": lambda s: (json.dumps(_header(s)).encode(), b"\0" * 8),
    "arrays larger than the payload": lambda s: (
        json.dumps(_header(s, arrays=[{"name": "k", "dtype": "<f4", "shape": [4, 4]}])).encode(),
        b"\0" * 16,
    ),
    "negative shape": lambda s: (
        json.dumps(_header(s, arrays=[{"name": "k", "dtype": "<f4", "shape": [-1]}])).encode(),
        b"\0" * 16,
    ),
    "object dtype": lambda s: (
        json.dumps(_header(s, arrays=[{"name": "k", "dtype": "|O", "shape": [2]}])).encode(),
        b"\0" * 16,
    ),
    "unknown dtype": lambda s: (
        json.dumps(_header(s, arrays=[{"name": "k", "dtype": "<q9", "shape": [2]}])).encode(),
        b"\0" * 16,
    ),
    "shape of strings": lambda s: (
        json.dumps(_header(s, arrays=[{"name": "k", "dtype": "<f4", "shape": ["x"]}])).encode(),
        b"\0" * 16,
    ),
    "payload_bytes not a number": lambda s: (
        json.dumps(_header(s, payload_bytes="16")).encode(),
        b"\0" * 16,
    ),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_authentic_file_is_a_counted_miss_never_an_exception(tmp_path, caplog, kind):
    """A file that passes the HMAC (as if the key had leaked, or our writer had a bug) but holds
    garbage: a miss counted in num_corrupt, the file removed. The 100k-deep header raised
    RecursionError out of `load` before, which took the engine down on restart."""
    store = DiskPageStore(tmp_path, max_bytes=1 << 22, namespace=NS)
    d, p, t = _one_page()
    head, payload = MALFORMED[kind](store)
    _forge(store, d, head, payload)
    with caplog.at_level(logging.WARNING, logger="minivllm_jax.engine.kv.disk"):
        assert store.load(d, p, t) is None
    assert store.num_corrupt == 1 and store.misses == 1 and store.hits == 0
    assert not store._path(d).exists() and "dropping" in caplog.text
    assert (
        store.save(d, p, t, _page()) and store.load(d, p, t) is not None
    )  # written again, and sound
    store.close()


def test_deep_header_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    store = DiskPageStore(tmp_path, max_bytes=1 << 22, namespace=NS)
    d, p, t = _one_page()
    _forge(store, d, b"[" * 100 + b"]" * 100)
    monkeypatch.setattr(
        kv_disk.json, "loads", lambda *a, **k: pytest.fail("parsed a header nested 100 deep")
    )
    assert store.load(d, p, t) is None and store.num_corrupt == 1
    store.close()


def test_file_signed_with_another_key_is_a_miss(tmp_path):
    """A page written by someone without this directory's key (a planted file) is never served."""
    store = DiskPageStore(tmp_path, max_bytes=1 << 22, namespace=NS)
    d, p, t = _one_page()
    header = _header(store, arrays=[{"name": "k", "dtype": "<f4", "shape": [2, 2]}])
    _forge(
        store, d, json.dumps(header).encode(), np.full(4, 7.0, np.float32).tobytes(), key=b"x" * 32
    )
    assert store.load(d, p, t) is None and store.num_corrupt == 1
    _forge(
        store, d, json.dumps(header).encode(), np.full(4, 7.0, np.float32).tobytes()
    )  # the right key: served
    np.testing.assert_array_equal(store.load(d, p, t)["k"], np.full((2, 2), 7.0, np.float32))
    store.close()


def test_header_depth_check():
    assert kv_disk.nesting_depth_within(b'{"a": [[1]], "b": "[[[[[[["}', 3)
    assert not kv_disk.nesting_depth_within(b'{"a": [[[1]]]}', 3)
    assert kv_disk.nesting_depth_within(
        b'{"a": "\\"[[[[[["}', 1
    )  # an escaped quote does not end the string


# ---------------------------------------------------------------- the compiled-program cache


def _program_args():
    import jax.numpy as jnp

    return (jnp.arange(4, dtype=jnp.float32),)


def _double():
    import jax

    return jax.jit(lambda x: x * 2)


def test_program_cache_off_for_a_folder_others_can_write(tmp_path, caplog):
    from minivllm_jax.engine.compilation import ProgramCache

    folder = tmp_path / "programs"
    folder.mkdir()
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="minivllm_jax.engine.compilation"):
        cache = ProgramCache(folder)
    assert cache.directory is None and "compiled-program cache is off" in caplog.text
    program, loaded = cache.load_or_compile(("double",), _double(), _program_args(), {})
    assert not loaded and list(folder.iterdir()) == []
    np.testing.assert_array_equal(program(*_program_args()), np.arange(4) * 2.0)


def test_program_cache_creates_a_private_folder(tmp_path):
    from minivllm_jax.engine.compilation import ProgramCache

    ProgramCache(tmp_path / "a" / "programs").load_or_compile(
        ("double",), _double(), _program_args(), {}
    )
    assert _mode(tmp_path / "a" / "programs") == 0o700


def test_program_cache_never_unpickles_a_file_of_another_user(tmp_path, monkeypatch, caplog):
    from minivllm_jax.engine import compilation as program_cache
    from minivllm_jax.engine.compilation import ProgramCache

    ProgramCache(tmp_path).load_or_compile(("double",), _double(), _program_args(), {})
    cache = ProgramCache(tmp_path)
    monkeypatch.setattr(
        os, "geteuid", lambda: os.stat(tmp_path).st_uid + 1
    )  # every file now someone else's
    monkeypatch.setattr(
        program_cache.pickle, "loads", lambda *_: pytest.fail("unpickled another user's file")
    )
    with caplog.at_level(logging.WARNING, logger="minivllm_jax.engine.compilation"):
        program, loaded = cache.load_or_compile(("double",), _double(), _program_args(), {})
    assert not loaded and "not by this user" in caplog.text
    np.testing.assert_array_equal(program(*_program_args()), np.arange(4) * 2.0)


# ---------------------------------------------------------------- cache_salt (prefix-cache side channel)


def _salt_llm(model_dir, **kw):
    from minivllm_jax import LLM

    return LLM(
        str(model_dir),
        max_num_seqs=2,
        max_model_len=64,
        page_size=4,
        num_pages=48,
        max_num_batched_tokens=64,
        warmup=False,
        use_tqdm=False,
        **kw,
    )


SALT_PROMPT = [5 + (i * 7) % 50 for i in range(25)]  # six full pages of 4, and a token to compute


def _cached(llm, salt):
    from minivllm_jax import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    return llm.generate([SALT_PROMPT], greedy, use_tqdm=False, cache_salt=salt)[0].num_cached_tokens


def test_cache_salt_separates_prefix_cache_pages(tiny_model_with_tokenizer):
    """Equal prompts share cached pages only under equal salts: a client cannot learn by timing
    (or num_cached_tokens) that a differently salted client sent a prompt."""
    llm = _salt_llm(tiny_model_with_tokenizer)
    assert _cached(llm, "tenant-a") == 0
    assert _cached(llm, "tenant-b") == 0  # same prompt, another salt: nothing shared
    assert _cached(llm, None) == 0  # nor with unsalted requests
    assert _cached(llm, "tenant-a") == 24  # the same salt shares every full page
    assert _cached(llm, None) == 24
    with pytest.raises(ValueError, match="cache_salt"):
        _cached(llm, "")
    with pytest.raises(ValueError, match="cache_salt"):
        _cached(llm, "x" * 257)
    llm.shutdown()


def test_cache_salt_separates_disk_tier_pages(tiny_model_with_tokenizer, tmp_path):
    """The disk tier keys on the same digests: after a restart, a page written under one salt
    is found under that salt only."""
    first = _salt_llm(tiny_model_with_tokenizer, kv_disk_dir=str(tmp_path), kv_disk_gb=0.01)
    assert _cached(first, "tenant-a") == 0
    first.shutdown()  # writes the cached pages to disk
    second = _salt_llm(tiny_model_with_tokenizer, kv_disk_dir=str(tmp_path), kv_disk_gb=0.01)
    assert _cached(second, "tenant-b") == 0 and _cached(second, None) == 0
    assert (
        _cached(second, "tenant-a") == 24 and second.engine.page_manager.num_disk_hit_tokens == 24
    )
    second.shutdown()


# ---------------------------------------------------------------- the server: salts by key and field, /metrics


class _SaltRecordingEngine:
    """The fake engine of tests/test_server_units.py, recording each request's cache salt."""

    def __new__(cls):
        from tests.test_server_units import FakeEngine

        class Recording(FakeEngine):
            def __init__(self) -> None:
                super().__init__()
                self.salts: list[str | None] = []

            def add_request(self, ids, params, *, request_id, cache_salt=None):
                self.salts.append(cache_salt)
                return super().add_request(ids, params, request_id=request_id)

        return Recording()


def _salt_app(**kw):
    from types import SimpleNamespace

    from server.app import create_app
    from tests.test_server_units import FakeTokenizer

    llm = SimpleNamespace(engine=_SaltRecordingEngine(), tokenizer=FakeTokenizer())
    return create_app(llm, model_name="fake", **kw), llm.engine


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


BODY = {"prompt": "ab", "max_tokens": 2, "temperature": 0}


def test_server_salts_each_api_key_and_each_request_salt():
    from starlette.testclient import TestClient

    from server.security import key_cache_salt

    app, engine = _salt_app(api_key=["key-a", "key-b"])
    with TestClient(app) as client:
        for key, extra in [
            ("key-a", {}),
            ("key-b", {}),
            ("key-a", {"cache_salt": "s"}),
            ("key-b", {"cache_salt": "s"}),
        ]:
            r = client.post("/v1/completions", json={**BODY, **extra}, headers=_bearer(key))
            assert r.status_code == 200, r.text
        r = client.post(
            "/v1/chat/completions",
            headers=_bearer("key-b"),
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        with client.websocket_connect("/v1/stream", headers=_bearer("key-a")) as ws:
            ws.send_json({**BODY, "cache_salt": "s"})
            while ws.receive_json()["type"] != "done":
                pass
        assert (
            client.post("/v1/completions", json=BODY, headers=_bearer("key-c")).status_code == 401
        )
    a, b = key_cache_salt("key-a"), key_cache_salt("key-b")
    assert engine.salts[:2] == [a, b] and a != b and "key-a" not in a
    salted_a, salted_b = engine.salts[2:4]
    assert (
        salted_a.startswith(a) and salted_b.startswith(b) and salted_a != salted_b
    )  # same field, other key
    assert engine.salts[4] == b and engine.salts[5] == salted_a  # chat and WebSocket alike


def test_server_with_one_key_passes_the_request_salt_as_is():
    from starlette.testclient import TestClient

    app, engine = _salt_app(api_key="only")
    with TestClient(app) as client:
        for extra in [{}, {"cache_salt": "tenant-7"}]:
            assert (
                client.post(
                    "/v1/completions", json={**BODY, **extra}, headers=_bearer("only")
                ).status_code
                == 200
            )
        for bad in ["", "x" * 257, 5]:
            r = client.post(
                "/v1/completions", json={**BODY, "cache_salt": bad}, headers=_bearer("only")
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    assert engine.salts == [None, "tenant-7"]


@pytest.mark.parametrize(
    "keys",
    [
        {"api_key": "k"},
        {"api_key": "k,other"},
        {"metrics_api_key": "k"},
        {"api_key": "user", "metrics_api_key": "k"},
    ],
)
def test_metrics_needs_a_key_when_one_is_set(keys):
    from starlette.testclient import TestClient

    app, _ = _salt_app(**keys)
    with TestClient(app) as client:
        no_key = client.get("/metrics")
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/metrics", headers=_bearer("wrong")).status_code == 401
        assert client.get("/metrics", headers=_bearer("k")).status_code == 200
        if keys.get("metrics_api_key"):  # the metrics key opens /metrics only
            assert client.get("/v1/models", headers=_bearer("k")).status_code == (
                200 if "api_key" not in keys else 401
            )
        assert client.get("/health").status_code == 200  # probes need no key


def test_metrics_open_without_any_key():
    from starlette.testclient import TestClient

    app, _ = _salt_app()
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 200


# ---------------------------------------------------------------- the CLI: no open non-loopback bind by accident


def _cli_args(*argv: str, environ: dict[str, str] | None = None):
    from server.cli import build_parser, resolve_api_keys

    args = build_parser().parse_args(list(argv))
    resolve_api_keys(args, environ or {})
    return args


@pytest.mark.parametrize(
    "argv",
    [
        ["--host", "0.0.0.0"],
        ["--host", "192.168.1.5"],
        ["--host", "::"],
        ["--host", "llm.lan"],
        ["--host", "0.0.0.0", "--allowed-hosts", "*"],
    ],
)
def test_cli_refuses_an_open_non_loopback_bind(argv):
    from server.cli import exposure_error

    error = exposure_error(_cli_args(*argv))
    assert error is not None and "--allow-unauthenticated" in error and "--api-key" in error


@pytest.mark.parametrize(
    "argv, environ",
    [
        ([], None),
        (["--host", "127.0.0.1"], None),
        (["--host", "::1"], None),
        (["--host", "localhost"], None),
        (["--host", "0.0.0.0", "--api-key", "k"], None),
        (["--host", "0.0.0.0"], {"MINIVLLM_API_KEY": "k"}),
        (["--host", "0.0.0.0", "--allowed-hosts", "llm.lan"], None),
        (["--host", "0.0.0.0", "--allow-unauthenticated"], None),
    ],
)
def test_cli_accepts_loopback_a_key_a_host_list_or_an_explicit_opt_out(argv, environ):
    from server.cli import exposure_error

    assert exposure_error(_cli_args(*argv, environ=environ)) is None


def test_cli_exits_2_on_an_open_bind_before_loading_anything(capsys, monkeypatch):
    from server import cli

    monkeypatch.delenv("MINIVLLM_API_KEY", raising=False)
    monkeypatch.setattr(cli, "load_llm", lambda args: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as e:
        cli.main(["--host", "0.0.0.0"])
    assert e.value.code == 2 and "refusing to serve --host 0.0.0.0" in capsys.readouterr().err


def test_cli_takes_several_api_keys():
    assert _cli_args("--api-key", "a,b", "--api-key", "c").api_key == ["a", "b", "c"]
    assert _cli_args(environ={"MINIVLLM_API_KEY": "x, y"}).api_key == ["x", "y"]
    assert _cli_args().api_key == []
    assert _cli_args("--metrics-api-key", "m").metrics_api_key == "m"


# ---------------------------------------------------------------- native attention checks its inputs


def _bad_batches():
    """(name, change) pairs: each change turns a sound batch into one whose indices point
    outside an array (sequence 0 feeds 7 tokens after 2 pages of context; `P` pages in the cache)."""
    return {
        "page id past the cache": lambda b, P: {"page_ids": b.page_ids.at[b.page_start[0]].set(P)},
        "negative page id": lambda b, P: {"page_ids": b.page_ids.at[b.page_start[0] + 1].set(-1)},
        "queries past the tokens": lambda b, P: {
            "query_len": b.query_len.at[0].set(b.tokens.shape[0] + 1)
        },
        "query start overflowing int32": lambda b, P: {
            "query_start": b.query_start.at[0].set(2**31 - 4)
        },
        "negative query start": lambda b, P: {"query_start": b.query_start.at[0].set(-1)},
        "negative query length": lambda b, P: {"query_len": b.query_len.at[1].set(-1)},
        "context past the listed pages": lambda b, P: {
            "context_len": b.context_len.at[0].set(10**6)
        },
        "context overflowing int32 pages": lambda b, P: {
            "context_len": b.context_len.at[0].set(2**31 - 1)
        },
        "page start past the list": lambda b, P: {
            "page_start": b.page_start.at[0].set(b.page_ids.shape[0])
        },
        "page start overflowing int32": lambda b, P: {
            "page_start": b.page_start.at[0].set(2**31 - 1)
        },
    }


@pytest.mark.parametrize("pages", ["float32", "int8"])
@pytest.mark.parametrize("bad", list(_bad_batches()))
def test_native_attention_refuses_indices_outside_its_arrays(pages, bad):
    """An inconsistent batch is an error from the kernel, never a read out of bounds (before, an
    out-of-range page was skipped silently and `query_start + query_len` was summed in int32)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from minivllm_jax import kernels
    from minivllm_jax.ops.attention import get_attention
    from tests.test_kernels import random_step

    if not kernels.native_available():
        pytest.skip("native kernels not available (not built, or MINIVLLM_KERNELS=reference)")
    rng = np.random.default_rng(0)
    num_pages = 40
    q, k_new, v_new, cache, batch = random_step(
        rng, 2, 2, 16, 4, [(8, 7), (3, 1)], num_pages=num_pages, pages=pages
    )
    batch = jax.tree.map(jnp.asarray, batch)
    native = jax.jit(get_attention("native"))
    np.asarray(native(q, k_new, v_new, cache, jnp.int32(1), batch))  # the sound batch runs
    broken = dataclasses.replace(batch, **_bad_batches()[bad](batch, num_pages))
    with pytest.raises(Exception, match="ragged_paged_attention: "):
        np.asarray(native(q, k_new, v_new, cache, jnp.int32(1), broken))
