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

from minivllm_jax.engine import kv_disk
from minivllm_jax.engine.block_manager import ROOT_DIGEST, page_digest
from minivllm_jax.engine.kv_disk import DiskPageStore

NS = "model-abc123"


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _page() -> dict[str, np.ndarray]:
    return {"k": np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4), "v": np.ones((2, 4, 4), np.int8)}


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
    assert _mode(tmp_path / "kv") == 0o700 and _mode(store.root) == 0o700 and _mode(page_file.parent) == 0o700
    assert _mode(page_file) == 0o600
    key = tmp_path / "kv" / kv_disk.KEY_FILE
    assert _mode(key) == 0o600 and len(key.read_bytes()) == kv_disk.KEY_BYTES
    again = DiskPageStore(tmp_path / "kv", max_bytes=1 << 20, namespace=NS)  # a restart reads the same key
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
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(folder).st_uid + 1)  # as if another user made it
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
        LLM(str(tiny_model_with_tokenizer), max_model_len=64, num_pages=32, page_size=4, kv_disk_dir=str(folder),
            kv_disk_gb=0.01, use_tqdm=False)  # fmt: skip


# ---------------------------------------------------------------- malformed page files are misses


def _forge(store: DiskPageStore, digest: bytes, head: bytes, payload: bytes = b"", key: bytes | None = None) -> None:
    """Write a page file as the store would, but with this header and payload, signed with the
    directory's key (so the checks after the HMAC are the ones tested) or with `key`."""
    prefix = kv_disk._PREFIX.pack(kv_disk.MAGIC, kv_disk.FORMAT_VERSION, len(head))
    mac = hmac.new(store._key if key is None else key, prefix + head + payload, hashlib.sha256).digest()
    path = store._path(digest)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(prefix + mac + head + payload)


def _header(store: DiskPageStore, **changes) -> dict:
    d, p, t = _one_page()
    header = {"namespace": store.namespace, "digest": d.hex(), "parent": p.hex(), "tokens": list(t),
              "arrays": [{"name": "k", "dtype": "<f4", "shape": [2, 2]}], "payload_bytes": 16}  # fmt: skip
    return {**header, **changes}


MALFORMED = {
    "nested 100k deep": lambda s: (b"[" * 100_000 + b"]" * 100_000, b""),
    "nested 100k deep in an object": lambda s: (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, b""),
    "not UTF-8": lambda s: (b'{"namespace": "\xff\xfe"}', b""),
    "not an object": lambda s: (b"[1, 2, 3]", b""),
    "fields missing": lambda s: (b"{}", b""),
    "payload shorter than said": lambda s: (json.dumps(_header(s)).encode(), b"\0" * 8),
    "arrays larger than the payload": lambda s: (
        json.dumps(_header(s, arrays=[{"name": "k", "dtype": "<f4", "shape": [4, 4]}])).encode(), b"\0" * 16),
    "negative shape": lambda s: (
        json.dumps(_header(s, arrays=[{"name": "k", "dtype": "<f4", "shape": [-1]}])).encode(), b"\0" * 16),
    "object dtype": lambda s: (
        json.dumps(_header(s, arrays=[{"name": "k", "dtype": "|O", "shape": [2]}])).encode(), b"\0" * 16),
    "unknown dtype": lambda s: (
        json.dumps(_header(s, arrays=[{"name": "k", "dtype": "<q9", "shape": [2]}])).encode(), b"\0" * 16),
    "shape of strings": lambda s: (
        json.dumps(_header(s, arrays=[{"name": "k", "dtype": "<f4", "shape": ["x"]}])).encode(), b"\0" * 16),
    "payload_bytes not a number": lambda s: (json.dumps(_header(s, payload_bytes="16")).encode(), b"\0" * 16),
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
    with caplog.at_level(logging.WARNING, logger="minivllm_jax.engine.kv_disk"):
        assert store.load(d, p, t) is None
    assert store.num_corrupt == 1 and store.misses == 1 and store.hits == 0
    assert not store._path(d).exists() and "dropping" in caplog.text
    assert store.save(d, p, t, _page()) and store.load(d, p, t) is not None  # written again, and sound
    store.close()


def test_deep_header_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    store = DiskPageStore(tmp_path, max_bytes=1 << 22, namespace=NS)
    d, p, t = _one_page()
    _forge(store, d, b"[" * 100 + b"]" * 100)
    monkeypatch.setattr(kv_disk.json, "loads", lambda *a, **k: pytest.fail("parsed a header nested 100 deep"))
    assert store.load(d, p, t) is None and store.num_corrupt == 1
    store.close()


def test_file_signed_with_another_key_is_a_miss(tmp_path):
    """A page written by someone without this directory's key (a planted file) is never served."""
    store = DiskPageStore(tmp_path, max_bytes=1 << 22, namespace=NS)
    d, p, t = _one_page()
    header = _header(store, arrays=[{"name": "k", "dtype": "<f4", "shape": [2, 2]}])
    _forge(store, d, json.dumps(header).encode(), np.full(4, 7.0, np.float32).tobytes(), key=b"x" * 32)
    assert store.load(d, p, t) is None and store.num_corrupt == 1
    _forge(store, d, json.dumps(header).encode(), np.full(4, 7.0, np.float32).tobytes())  # the right key: served
    np.testing.assert_array_equal(store.load(d, p, t)["k"], np.full((2, 2), 7.0, np.float32))
    store.close()


def test_header_depth_check():
    assert kv_disk.nesting_depth_within(b'{"a": [[1]], "b": "[[[[[[["}', 3)
    assert not kv_disk.nesting_depth_within(b'{"a": [[[1]]]}', 3)
    assert kv_disk.nesting_depth_within(b'{"a": "\\"[[[[[["}', 1)  # an escaped quote does not end the string


# ---------------------------------------------------------------- the compiled-program cache


def _program_args():
    import jax.numpy as jnp

    return (jnp.arange(4, dtype=jnp.float32),)


def _double():
    import jax

    return jax.jit(lambda x: x * 2)


def test_program_cache_off_for_a_folder_others_can_write(tmp_path, caplog):
    from minivllm_jax.program_cache import ProgramCache

    folder = tmp_path / "programs"
    folder.mkdir()
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="minivllm_jax.program_cache"):
        cache = ProgramCache(folder)
    assert cache.directory is None and "compiled-program cache is off" in caplog.text
    program, loaded = cache.load_or_compile(("double",), _double(), _program_args(), {})
    assert not loaded and list(folder.iterdir()) == []
    np.testing.assert_array_equal(program(*_program_args()), np.arange(4) * 2.0)


def test_program_cache_creates_a_private_folder(tmp_path):
    from minivllm_jax.program_cache import ProgramCache

    ProgramCache(tmp_path / "a" / "programs").load_or_compile(("double",), _double(), _program_args(), {})
    assert _mode(tmp_path / "a" / "programs") == 0o700


def test_program_cache_never_unpickles_a_file_of_another_user(tmp_path, monkeypatch, caplog):
    from minivllm_jax import program_cache
    from minivllm_jax.program_cache import ProgramCache

    ProgramCache(tmp_path).load_or_compile(("double",), _double(), _program_args(), {})
    cache = ProgramCache(tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(tmp_path).st_uid + 1)  # every file now someone else's
    monkeypatch.setattr(program_cache.pickle, "loads", lambda *_: pytest.fail("unpickled another user's file"))
    with caplog.at_level(logging.WARNING, logger="minivllm_jax.program_cache"):
        program, loaded = cache.load_or_compile(("double",), _double(), _program_args(), {})
    assert not loaded and "not by this user" in caplog.text
    np.testing.assert_array_equal(program(*_program_args()), np.arange(4) * 2.0)
