"""`DiskPageStore`: a disk tier for the prefix cache, so full KV pages outlive memory and restarts.

A full page is keyed by its chained digest (`pages.page_digest`), so a server restarted
on the same directory finds the pages of prefixes it has seen and loads them instead of
recomputing. Files live in `<directory>/<namespace>/`; the caller's namespace fingerprints the
model and KV layout, so pages of another model or layout are never seen. One file per page:

    <directory>/<namespace>/<digest hex[:2]>/<digest hex>.kvpage   (the fan-out keeps folders small)

A page read back is served to whichever request's prefix has its digest, so the folder is
trusted only as far as it is private: the directory must be ours and writable by no one else
(`minivllm_jax.engine.private_dir`; created 0700, files 0600), and every file carries an HMAC-SHA256
under the key in `<directory>/kv-disk.key` (32 random bytes, 0600, made on first use), so a file
that another party wrote or damaged is a miss.

File format (little-endian):
    b"MVKVPAGE" | uint32 format version | uint32 header length | HMAC tag (32 bytes) | JSON header | payload
The tag covers every other byte of the file. The JSON header holds namespace, digest (hex), parent
(hex), tokens (list of ints), arrays (a list of {name, dtype (numpy dtype str), shape}, one page:
`leaf[:, i]` of the cache) and payload_bytes; the payload is each array's C-contiguous bytes in
header order. The header is parsed only after the tag checks out, and only when its length and
nesting are within bounds (`MAX_HEADER_BYTES`, `MAX_HEADER_DEPTH`).

A file is written to a unique temp file and renamed into place, so readers never see half a
file and writers of the same page (threads or processes) cannot clash. Any file that does not
check out is a miss: it is logged, counted in `num_corrupt` and removed, never raised to the engine.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import re
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from minivllm_jax.engine.private_dir import (
    PRIVATE_DIR_MODE,
    PRIVATE_FILE_MODE,
    check_private_file,
    ensure_private_dir,
)

logger = logging.getLogger(__name__)

MAGIC = b"MVKVPAGE"
FORMAT_VERSION = 2  # 2: an HMAC tag instead of a CRC (files of version 1 are misses)
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
TAG_BYTES = hashlib.sha256().digest_size  # the HMAC-SHA256 tag after the prefix
KEY_FILE = "kv-disk.key"  # in the directory the user named: one key for every namespace
KEY_BYTES = 32
# Bounds checked before the header is parsed: ours is a few hundred bytes (tokens of one page),
# nested 4 deep ({"arrays": [{"shape": [...]}]}).
MAX_HEADER_BYTES = 1 << 20
MAX_HEADER_DEPTH = 4
SUFFIX = ".kvpage"
TMP_MARK = ".tmp-"  # `<digest hex>.kvpage.tmp-<pid>-<thread id>-<random>`
# A crash between write and rename leaves a temp file behind. The scan removes only old ones:
# another live process sharing the directory may be writing one right now.
STALE_TMP_S = 10 * 60
_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]+")

Entry = tuple[bytes, bytes, tuple[int, ...]]  # (digest, parent, tokens)


def _raw(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a uint8 view (no copy), for the HMAC and file writes."""
    return a.reshape(-1).view(np.uint8)


def load_or_create_key(directory: Path) -> bytes:
    """The directory's HMAC key, made (32 random bytes, 0600) if it has none. Processes racing to
    make it agree: each writes its own temp file and hard-links it into place, and a link never
    replaces a file, so all of them read the first one's key. Raises ValueError for a key file
    that is not ours, is readable by others, or is not 32 bytes."""
    path = directory / KEY_FILE
    if not path.exists():
        tmp = directory / f"{KEY_FILE}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(KEY_BYTES))
            os.link(tmp, path)
        except FileExistsError:  # another process made it first: use theirs
            pass
        finally:
            tmp.unlink(missing_ok=True)
    with open(path, "rb") as f:
        check_private_file(os.fstat(f.fileno()), f"the KV disk key file {path}")
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise ValueError(
            f"the KV disk key file {path} holds {len(key)} bytes, expected {KEY_BYTES}; delete it "
            "(a new key is made, and the pages it signed become misses)"
        )
    return key


def nesting_depth_within(text: bytes, limit: int) -> bool:
    """Whether JSON `text` nests objects and arrays at most `limit` deep (brackets inside strings
    do not count). Checked before `json.loads`, whose recursion a deep enough file would exhaust."""
    depth, in_string, escaped = 0, False, False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return False
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return True


def _file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


class _Batch:
    """Pages queued by `save_later`: their arrays are fetched once, by whoever needs them first."""

    def __init__(self, fetch: Callable[[], dict[str, np.ndarray]]) -> None:
        self.entries: list[
            tuple[int, bytes, bytes, tuple[int, ...]]
        ] = []  # (axis-1 index, digest, parent, tokens)
        self._fetch: Callable[[], dict[str, np.ndarray]] | None = fetch
        self._lock = threading.Lock()
        self._arrays: dict[str, np.ndarray] | None = None

    def arrays(self) -> dict[str, np.ndarray] | None:
        """The fetched arrays (pages on axis 1), or None when the fetch failed (logged once)."""
        with self._lock:
            if self._fetch is not None:
                fetch, self._fetch = self._fetch, None
                try:
                    self._arrays = {name: np.asarray(a) for name, a in fetch().items()}
                except Exception:
                    logger.exception(
                        "kv disk: fetching %d queued pages failed; not stored", len(self.entries)
                    )
            return self._arrays


class DiskPageStore:
    """Full KV pages on disk by chained digest, least recently used evicted past `max_bytes`.
    Thread-safe: one lock guards the index and the counters; file I/O runs outside it. Counters
    (plain ints, for /metrics): num_pages, num_bytes, hits, misses, num_corrupt, num_written,
    num_evicted (num_bytes and the budget count this process's index of the folder)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, namespace: str) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        if not _NAMESPACE.fullmatch(namespace) or namespace in (".", ".."):
            raise ValueError(
                f"namespace must be a plain identifier (letters, digits, _ . -), got {namespace!r}"
            )
        directory = ensure_private_dir(directory, "the KV disk directory (kv_disk_dir)")
        self.root = ensure_private_dir(directory / namespace, "the KV disk namespace directory")
        self._key = load_or_create_key(directory)
        self.max_bytes = max_bytes
        self.namespace = namespace
        self._lock = threading.Lock()  # guards the index, the pending map and the counters
        self._index: OrderedDict[bytes, int] = (
            OrderedDict()
        )  # digest -> file size, oldest use first
        self._pending: dict[bytes, tuple[_Batch, int, bytes, tuple[int, ...]]] = {}
        self.num_bytes = self.hits = self.misses = self.num_corrupt = self.num_written = (
            self.num_evicted
        ) = 0
        self._queue: queue.Queue[_Batch | None] = queue.Queue()
        self._closed = False
        self._scan()
        self._thread = threading.Thread(target=self._writer, name="kv-disk-writer", daemon=True)
        self._thread.start()

    @property
    def num_pages(self) -> int:
        return len(self._index)

    @property
    def closed(self) -> bool:
        return self._closed

    def _path(self, digest: bytes) -> Path:
        name = digest.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def _scan(self) -> None:
        """Index the files already there (a restart), oldest mtime first, so LRU spans restarts."""
        found, now = [], time.time()
        for sub in os.scandir(self.root):
            for entry in os.scandir(sub.path) if sub.is_dir(follow_symlinks=False) else ():
                try:
                    st = entry.stat(follow_symlinks=False)
                    if TMP_MARK in entry.name and now - st.st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)
                    elif entry.name.endswith(SUFFIX):
                        found.append(
                            (st.st_mtime, bytes.fromhex(entry.name[: -len(SUFFIX)]), st.st_size)
                        )
                except (OSError, ValueError):  # vanished meanwhile, or not one of our names
                    continue
        for _, digest, size in sorted(found):
            self._track(digest, size)

    def _track(self, digest: bytes, size: int | None) -> bool:
        """Index a file that is on disk (ours, or another process's) as most recently used, or
        forget one (`size` None); then evict LRU pages past the budget. True if newly indexed."""
        with self._lock:
            old = self._index.pop(digest, None)
            self.num_bytes -= old or 0
            if size is not None:
                self._index[digest] = size
                self.num_bytes += size
            victims = []
            while self.num_bytes > self.max_bytes and self._index:
                victim, victim_size = self._index.popitem(last=False)
                self.num_bytes -= victim_size
                self.num_evicted += 1
                victims.append(victim)
        for victim in victims:  # outside the lock (a racing re-save of a victim is a later miss)
            self._path(victim).unlink(missing_ok=True)
        return old is None and size is not None

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    # ---------------------------------------------------------------- the API

    def contains(self, digest: bytes) -> bool:
        """Stored, or queued by `save_later`; else adopts the file if another process wrote it."""
        with self._lock:
            if digest in self._index or digest in self._pending:
                return True
        if (size := _file_size(self._path(digest))) is None:
            return False
        self._track(digest, size)
        return True

    def load(
        self, digest: bytes, parent: bytes, tokens: tuple[int, ...]
    ) -> dict[str, np.ndarray] | None:
        """The page's arrays (leaf name -> one page, `leaf[:, i]` of the cache) or None. Whatever
        goes wrong is a miss: a bad file is logged and removed, never raised."""
        tokens = tuple(int(t) for t in tokens)
        with self._lock:
            pending = self._pending.get(digest)
        if pending is not None:  # queued, maybe not fetched yet: served from memory
            batch, i, p_parent, p_tokens = pending
            arrays = batch.arrays() if (p_parent, p_tokens) == (parent, tokens) else None
            self._count(hits=arrays is not None, misses=arrays is None)
            return (
                None if arrays is None else {name: np.array(a[:, i]) for name, a in arrays.items()}
            )
        path = self._path(digest)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read() if size <= self.max_bytes else None  # a larger file was never ours
        except OSError:  # not there (or removed by another process): a plain miss
            self._track(digest, None)
            self._count(misses=1)
            return None
        if data is None:
            arrays, reason = None, f"{size} bytes, more than the {self.max_bytes}-byte budget"
        else:
            arrays, reason = self._decode(data, digest, parent, tokens)
        if arrays is None:
            logger.warning("kv disk: dropping %s: %s", path, reason)
            path.unlink(missing_ok=True)
            self._track(digest, None)
            self._count(num_corrupt=1, misses=1)
            return None
        try:
            os.utime(path)  # mtime is the LRU order a restart rebuilds
        except OSError:
            pass
        self._track(digest, size)
        self._count(hits=1)
        return arrays

    def _decode(self, data: bytes, digest: bytes, parent: bytes, tokens: tuple[int, ...]):
        """(arrays, None) for an authentic file holding exactly the requested page, else (None,
        reason). Never raises: whatever a file holds, it is a miss at worst."""
        try:
            if len(data) < _PREFIX.size + TAG_BYTES:
                return None, f"unreadable: {len(data)} bytes, shorter than the fixed header"
            magic, version, header_len = _PREFIX.unpack_from(data)
            if magic != MAGIC or version != FORMAT_VERSION:
                return (
                    None,
                    f"magic {magic!r} version {version}, expected {MAGIC!r} version {FORMAT_VERSION}",
                )
            start = _PREFIX.size + TAG_BYTES
            if header_len > MAX_HEADER_BYTES or start + header_len > len(data):
                return (
                    None,
                    f"header length {header_len} is out of bounds for a {len(data)}-byte file",
                )
            view = memoryview(data)
            mac = hmac.new(self._key, view[: _PREFIX.size], hashlib.sha256)
            mac.update(view[start:])
            if not hmac.compare_digest(mac.digest(), data[_PREFIX.size : start]):
                return (
                    None,
                    "HMAC mismatch (damaged, truncated, or not written with this directory's key)",
                )
            head = data[start : start + header_len]
            if not nesting_depth_within(head, MAX_HEADER_DEPTH):
                return None, f"unreadable: the header nests deeper than {MAX_HEADER_DEPTH}"
            h = json.loads(head.decode("utf-8"))
            if not isinstance(h, dict):
                return None, "unreadable: the header is not a JSON object"
            if (h["namespace"], h["digest"], h["parent"], h["tokens"]) != (
                self.namespace,
                digest.hex(),
                parent.hex(),
                list(tokens),
            ):
                return (
                    None,
                    "the header's namespace, digest, parent or tokens differ from the request",
                )
            payload = view[start + header_len :]
            if len(payload) != h["payload_bytes"]:
                return (
                    None,
                    f"payload is {len(payload)} bytes, the header says {h['payload_bytes']}",
                )
            arrays, offset = {}, 0
            for spec in h["arrays"]:
                dtype, shape = np.dtype(spec["dtype"]), tuple(int(n) for n in spec["shape"])
                if dtype.hasobject or any(n < 0 for n in shape):
                    return (
                        None,
                        f"unreadable: array {spec['name']!r} has dtype {dtype} shape {shape}",
                    )
                count = int(np.prod(shape, dtype=np.int64))
                a = np.frombuffer(
                    payload, dtype, count=count, offset=offset
                )  # ValueError past the end
                arrays[str(spec["name"])] = a.reshape(
                    shape
                ).copy()  # a copy: writable, not tied to `data`
                offset += a.nbytes
            if offset != len(payload):
                return None, "the arrays do not fill the payload"
            return arrays, None
        except Exception as e:  # noqa: BLE001  short file, JSON, field or dtype garbage: a miss
            return None, f"unreadable ({e!r})"[:500]

    def save(
        self, digest: bytes, parent: bytes, tokens: tuple[int, ...], arrays: dict[str, np.ndarray]
    ) -> bool:
        """Write one page (arrays of ONE page) atomically unless present. True if this call stored it."""
        with self._lock:
            if digest in self._index:
                return False
        path = self._path(digest)
        if (size := _file_size(path)) is not None:  # another process (or thread) wrote it
            self._track(digest, size)
            return False
        parts = [np.ascontiguousarray(a) for a in arrays.values()]
        if any(
            np.dtype(a.dtype.str) != a.dtype for a in parts
        ):  # bfloat16: store its bits, as the cache does
            raise ValueError(
                f"dtypes {[a.dtype for a in parts]} must round-trip through their dtype str"
            )
        header = {
            "namespace": self.namespace,
            "digest": digest.hex(),
            "parent": parent.hex(),
            "tokens": [int(t) for t in tokens],
            "arrays": [
                {"name": n, "dtype": a.dtype.str, "shape": list(a.shape)}
                for n, a in zip(arrays, parts)
            ],
            "payload_bytes": sum(a.nbytes for a in parts),
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        size = _PREFIX.size + TAG_BYTES + len(head) + header["payload_bytes"]
        if size > self.max_bytes:
            return False
        prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head))
        mac = hmac.new(self._key, prefix, hashlib.sha256)
        mac.update(head)
        for a in parts:
            mac.update(_raw(a))
        path.parent.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
        tmp = path.with_name(
            f"{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
        )
        try:  # no fsync: a file torn by a power loss fails its checks and is a miss, like any other
            with os.fdopen(
                os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE), "wb"
            ) as f:
                f.write(prefix + mac.digest() + head)
                for a in parts:
                    f.write(_raw(a))
            os.replace(tmp, path)  # atomic: readers and racing writers see a whole file (all equal)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        stored = self._track(digest, size)
        self._count(num_written=stored)
        return stored

    def save_later(self, entries: list[Entry], fetch: Callable[[], dict[str, np.ndarray]]) -> None:
        """Queue pages for the writer thread, so the engine never waits on a device copy or the disk.
        `fetch()` returns arrays with the pages stacked on axis 1 (entry i is `arr[:, i]`)."""
        with self._lock:
            if self._closed:
                logger.warning("kv disk: save_later after close(); %d pages dropped", len(entries))
                return
            batch = _Batch(fetch)
            for i, (digest, parent, tokens) in enumerate(entries):
                if digest not in self._index and digest not in self._pending:
                    tokens = tuple(int(t) for t in tokens)
                    self._pending[digest] = (batch, i, parent, tokens)
                    batch.entries.append((i, digest, parent, tokens))
            if not batch.entries:
                return
            self._queue.put(batch)

    def _writer(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                arrays = batch.arrays()
                for i, digest, parent, tokens in batch.entries if arrays is not None else ():
                    try:
                        self.save(
                            digest, parent, tokens, {name: a[:, i] for name, a in arrays.items()}
                        )
                    except Exception:
                        logger.exception("kv disk: writing page %s failed", digest.hex())
            finally:
                with self._lock:  # after the index has them: `contains` never sees a gap
                    for _, digest, _, _ in batch.entries:
                        del self._pending[
                            digest
                        ]  # only this batch queues it (`save_later` skips pending ones)
                self._queue.task_done()
        self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued write has finished."""
        self._queue.join()

    def close(self) -> None:
        """Flush, then stop the writer thread (idempotent)."""
        with self._lock:
            closed, self._closed = self._closed, True
        if not closed:
            self._queue.put(None)
            self._thread.join()
