"""DiskPageStore: round trips, restarts, namespaces, corruption, the byte budget (LRU), concurrent
writers (threads and processes) and the background writer (`save_later`)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from minivllm_jax.engine.kv.disk import SUFFIX, TMP_MARK, DiskPageStore
from minivllm_jax.engine.kv.pages import ROOT_DIGEST, page_digest

L, KVH, HD, PS = 2, 2, 4, 4
NS = "model-abc123"


def page(seed: int, quantized: bool = True) -> dict[str, np.ndarray]:
    """One page's arrays (`leaf[:, i]` of the cache): int8 K/V with float32 scales, or float32 K/V."""
    rng = np.random.default_rng(seed)
    if not quantized:
        return {
            "k": rng.standard_normal((L, KVH, HD, PS), np.float32),
            "v": rng.standard_normal((L, KVH, PS, HD), np.float32),
        }
    return {
        "k": rng.integers(-127, 128, (L, KVH, HD, PS), dtype=np.int8),
        "v": rng.integers(-127, 128, (L, KVH, PS, HD), dtype=np.int8),
        "k_scale": rng.random((L, KVH, PS), np.float32),
        "v_scale": rng.random((L, KVH, PS), np.float32),
    }


def chain(n: int, start: int = 0) -> list[tuple[bytes, bytes, tuple[int, ...]]]:
    """`n` chained pages (digest, parent, tokens) as the page manager keys them."""
    out, parent = [], ROOT_DIGEST
    for i in range(n):
        tokens = tuple(
            range(1000 + (start + i) * PS, 1000 + (start + i + 1) * PS)
        )  # 4 digits: equal file sizes
        digest = page_digest(parent, tokens)
        out.append((digest, parent, tokens))
        parent = digest
    return out


def assert_page_equal(got: dict[str, np.ndarray] | None, want: dict[str, np.ndarray]) -> None:
    assert got is not None
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        np.testing.assert_array_equal(got[name], want[name])


def page_files(store: DiskPageStore) -> list[Path]:
    return sorted(store.root.glob(f"*/*{SUFFIX}"))


def disk_bytes(store: DiskPageStore) -> int:
    return sum(p.stat().st_size for p in store.root.glob("*/*"))


@pytest.fixture
def store(tmp_path):
    s = DiskPageStore(tmp_path, max_bytes=1 << 20, namespace=NS)
    yield s
    s.close()


def test_round_trip_restart_and_namespace(tmp_path, store):
    pages = chain(3)
    for i, (d, p, t) in enumerate(pages):
        assert store.save(d, p, t, page(i, quantized=i != 1))  # float32 and int8 + scales
    assert not store.save(*pages[0], page(0))  # already there
    assert store.num_pages == 3 and store.num_written == 3
    assert store.num_bytes == disk_bytes(store) > 0
    for i, (d, p, t) in enumerate(pages):
        assert store.contains(d)
        got = store.load(d, p, t)
        assert_page_equal(got, page(i, quantized=i != 1))
        got["k"][0] = 0  # writable, a copy
    assert store.hits == 3 and store.misses == 0
    path = page_files(store)[0]
    assert path.parent.name == path.name[:2] and len(path.name) == 64 + len(SUFFIX)
    store.close()

    again = DiskPageStore(tmp_path, max_bytes=1 << 20, namespace=NS)  # a restart
    try:
        assert again.num_pages == 3 and again.num_bytes == store.num_bytes
        for i, (d, p, t) in enumerate(pages):
            assert again.contains(d)
            assert_page_equal(again.load(d, p, t), page(i, quantized=i != 1))
    finally:
        again.close()

    other = DiskPageStore(tmp_path, max_bytes=1 << 20, namespace="other-model")
    try:
        assert other.num_pages == 0
        assert not other.contains(pages[0][0])
        assert other.load(*pages[0]) is None and other.misses == 1
    finally:
        other.close()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        DiskPageStore(tmp_path, max_bytes=0, namespace=NS)
    with pytest.raises(ValueError):
        DiskPageStore(tmp_path, max_bytes=100, namespace="../escape")


def test_wrong_parent_or_tokens_is_a_miss(store):
    (d, p, t), (d2, _, _) = chain(2)
    store.save(d, p, t, page(0))
    assert store.load(d, d2, t) is None  # wrong parent
    store.save(d, p, t, page(0))
    assert store.load(d, p, t[:-1] + (t[-1] + 1,)) is None  # wrong tokens
    assert store.load(d2, d, t) is None  # never stored
    assert store.hits == 0 and store.misses == 3


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("flip_payload", "HMAC mismatch"),
        ("truncate", "HMAC mismatch"),
        ("garbage_header", "HMAC mismatch"),
        ("bad_magic", "magic"),
        ("empty", "unreadable"),
    ],
)
def test_corrupt_file_is_a_miss_and_removed(store, caplog, damage, reason):
    ((d, p, t),) = chain(1)
    assert store.save(d, p, t, page(0))
    (path,) = page_files(store)
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-5] ^= 0x01
    elif damage == "truncate":
        data = data[:-7]
    elif damage == "garbage_header":
        data[60:80] = b"\xff{not json, at all!"  # past the prefix and the tag: in the JSON header
    elif damage == "bad_magic":
        data[:8] = b"NOTAPAGE"
    else:
        data = b""
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="minivllm_jax.engine.kv.disk"):
        assert store.load(d, p, t) is None
    assert str(path) in caplog.text and reason in caplog.text
    assert not path.exists()
    assert store.num_corrupt == 1 and store.misses == 1 and store.hits == 0
    assert store.num_pages == 0 and store.num_bytes == 0
    assert not store.contains(d)
    assert store.save(d, p, t, page(0))  # written again, and sound
    assert_page_equal(store.load(d, p, t), page(0))


def test_byte_budget_evicts_least_recently_used(tmp_path):
    probe = DiskPageStore(tmp_path / "probe", max_bytes=1 << 20, namespace=NS)
    probe.save(*chain(2)[1], page(0))
    size = probe.num_bytes  # a page of `chain` after the first (whose parent, the root, is empty)
    probe.close()

    store = DiskPageStore(tmp_path / "store", max_bytes=3 * size + 8, namespace=NS)
    pages = chain(6)
    try:
        for i in range(3):
            assert store.save(*pages[i], page(i))
        assert store.num_pages == 3 and store.num_evicted == 0
        assert_page_equal(store.load(*pages[0]), page(0))  # now the most recently used
        assert store.save(*pages[3], page(3))
        assert store.num_evicted == 1
        assert store.contains(pages[0][0]) and not store.contains(pages[1][0])
        assert store.load(*pages[1]) is None
        for i in (4, 5):
            assert store.save(*pages[i], page(i))
            assert store.num_bytes <= store.max_bytes
        assert [store.contains(d) for d, _, _ in pages] == [False, False, False, True, True, True]
        assert len(page_files(store)) == 3
        assert store.num_bytes == disk_bytes(store) <= store.max_bytes
    finally:
        store.close()

    tiny = DiskPageStore(tmp_path / "tiny", max_bytes=size // 2, namespace=NS)
    try:
        assert not tiny.save(*pages[0], page(0))  # larger than the whole budget: not written
        assert tiny.num_pages == 0 and page_files(tiny) == []
    finally:
        tiny.close()


def test_restart_keeps_newest_by_mtime_and_cleans_stale_temp_files(tmp_path, store):
    pages = chain(4)
    for i, entry in enumerate(pages):
        store.save(*entry, page(i))
    size = max(p.stat().st_size for p in page_files(store))
    now = time.time()
    for i, path in enumerate(store._path(d) for d, _, _ in pages):
        os.utime(path, (now - 100 + i, now - 100 + i))  # page 0 oldest
    os.utime(store._path(pages[1][0]), (now, now))  # page 1 used last
    stale = store.root / "ab" / f"x{SUFFIX}{TMP_MARK}1-2-dead"  # a crashed writer's, an hour ago
    fresh = store.root / "ab" / f"y{SUFFIX}{TMP_MARK}1-2-beef"  # maybe a live writer's: kept
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"half a page")
    fresh.write_bytes(b"being written by another process")
    os.utime(stale, (now - 3600, now - 3600))
    store.close()

    again = DiskPageStore(tmp_path, max_bytes=2 * size + 8, namespace=NS)
    try:
        assert [again.contains(d) for d, _, _ in pages] == [False, True, False, True]
        assert again.num_evicted == 2 and again.num_pages == 2
        assert not stale.exists() and fresh.exists()
    finally:
        again.close()


def test_threads_saving_the_same_page(store):
    ((d, p, t),) = chain(1)
    barrier, results = threading.Barrier(8), []

    def save() -> None:
        barrier.wait()
        results.append(store.save(d, p, t, page(0)))

    threads = [threading.Thread(target=save) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 8 and sum(results) <= 1
    assert len(page_files(store)) == 1 and not list(store.root.glob(f"*/*{TMP_MARK}*"))
    assert store.num_pages == 1 and store.num_bytes == disk_bytes(store)
    assert_page_equal(store.load(d, p, t), page(0))


WRITER = textwrap.dedent("""
    import importlib.util, os, sys, time
    import numpy as np
    # Load the module by its path: importing the minivllm_jax package pulls in jax (slow).
    spec = importlib.util.spec_from_file_location("kv_disk", sys.argv[1])
    kv_disk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kv_disk)
    store = kv_disk.DiskPageStore(sys.argv[2], max_bytes=1 << 24, namespace=sys.argv[3])
    while not os.path.exists(sys.argv[4]):  # start together
        time.sleep(0.001)
    for i in range(40):
        digest = bytes([i]) * 32
        rng = np.random.default_rng(i)
        k = rng.standard_normal((2, 2, 8, 16), np.float32)
        store.save(digest, b"", tuple(range(i, i + 16)), {"k": k, "v": k.swapaxes(2, 3) * 2})
    store.close()
""")


def test_processes_writing_the_same_pages(tmp_path):
    import minivllm_jax.engine.kv.disk as kv_disk

    go = tmp_path / "go"
    cmd = [sys.executable, "-c", WRITER, kv_disk.__file__, str(tmp_path / "cache"), NS, str(go)]
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE) for _ in range(2)]
    time.sleep(0.3)
    go.touch()
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
    store = DiskPageStore(tmp_path / "cache", max_bytes=1 << 24, namespace=NS)
    try:
        assert store.num_pages == 40
        for i in range(40):
            k = np.random.default_rng(i).standard_normal((2, 2, 8, 16), np.float32)
            want = {"k": k, "v": k.swapaxes(2, 3) * 2}
            assert_page_equal(store.load(bytes([i]) * 32, b"", tuple(range(i, i + 16))), want)
        assert store.num_corrupt == 0
        assert not list(store.root.glob(f"*/*{TMP_MARK}*"))
    finally:
        store.close()


def stacked(seeds: list[int]) -> dict[str, np.ndarray]:
    """Pages stacked on axis 1, as `fetch` returns them (a slice of the cache)."""
    pages = [page(s) for s in seeds]
    return {name: np.stack([p[name] for p in pages], axis=1) for name in pages[0]}


def test_save_later_serves_pending_pages_from_memory(store):
    a, b = chain(4)[:2], chain(4)[2:]
    gate, calls = threading.Event(), {"a": 0, "b": 0}

    def fetch_a():  # blocks the writer thread until the test opens the gate
        calls["a"] += 1
        assert gate.wait(10)
        return stacked([0, 1])

    def fetch_b():
        calls["b"] += 1
        return stacked([2, 3])

    store.save_later(a, fetch_a)
    store.save_later(b, fetch_b)  # queued behind a's fetch: nothing of b is on disk yet
    assert all(store.contains(d) for d, _, _ in a + b)
    assert_page_equal(store.load(*b[1]), page(3))  # served from memory, fetched here
    assert_page_equal(store.load(*b[0]), page(2))
    assert not any(store._path(d).exists() for d, _, _ in a + b)
    assert store.load(b[0][0], b[1][0], b[0][2]) is None  # a pending page still checks its parent

    got = []
    loader = threading.Thread(target=lambda: got.append(store.load(*a[0])))  # waits on a's fetch
    loader.start()
    time.sleep(0.05)
    assert loader.is_alive() and not got
    gate.set()
    loader.join(10)
    assert_page_equal(got[0], page(0))
    store.flush()
    assert calls == {"a": 1, "b": 1}  # each fetch ran once, whoever needed it first
    assert all(store._path(d).exists() for d, _, _ in a + b)
    assert store.num_written == 4 and store.num_pages == 4
    for i, entry in enumerate(a + b):
        assert_page_equal(store.load(*entry), page(i))

    store.save_later(a, lambda: pytest.fail("stored pages are skipped, never fetched"))
    store.flush()
    assert store.num_written == 4


def test_save_later_fetch_error_is_logged_not_raised(store, caplog):
    pages = chain(2)

    def fetch():
        raise RuntimeError("device copy failed")

    with caplog.at_level(logging.ERROR, logger="minivllm_jax.engine.kv.disk"):
        store.save_later(pages, fetch)
        store.flush()
    assert "device copy failed" in caplog.text
    assert store.num_pages == 0 and store.num_written == 0 and page_files(store) == []
    assert not any(store.contains(d) for d, _, _ in pages)
    assert store.load(*pages[0]) is None
    store.close()
    store.close()  # idempotent
    store.save_later(pages, fetch)  # after close: dropped with a warning, not raised
