"""Compiled programs: made once per key and counted (`CompileManager`), and kept on disk
whole (`ProgramCache`), so a warm start skips tracing and lowering too.

XLA's persistent compilation cache saves only the compile: each program still pays Python
tracing and lowering before that cache is looked up, and a hit costs about as much again (the
measurements are in docs/perf-notes.md). A serialized executable
(`jax.experimental.serialize_executable`) loads without tracing anything. The directory comes from `runtime.enable_compilation_cache`, which leaves
XLA's cache off: an executable that XLA loaded from its cache has lost its kernels when
serialized again (XLA:CPU, jax 0.10: "Function ... not found" when it runs), so only programs
compiled in this process are stored (if the user turned XLA's cache on, a program it served is
used but not stored: `jax.monitoring` reports the hit in the compiling thread).

The key is computed without tracing, so it must name everything the program depends on: the
jax/jaxlib versions, the backend and this CPU, the JAX/XLA flags (environment and the few
config values that change lowering), the package's source (the traced code lives in it), the
program's name, its static arguments and the shapes, dtypes and tree structure of its
arguments. A file holds a SHA-256 of its payload: a truncated or corrupt file
is a miss (logged and removed), never a crash. Files are written atomically; the oldest are
removed beyond `MAX_FILES`. Loading runs pickled code, so the directory must be ours alone
(`minivllm_jax.engine.private_dir`): one owned by another user or writable by group or others turns
the cache off with a warning (programs are then compiled), and a file in it that is not ours
is never unpickled.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable
from tqdm.auto import tqdm

from minivllm_jax.engine.private_dir import check_owned_by_us, ensure_private_dir

logger = logging.getLogger(__name__)

MAX_FILES = 256
_PACKAGE = Path(__file__).resolve().parent
_XLA_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_this_thread = threading.local()


def _count_xla_cache_hits(event: str, **_: Any) -> None:
    if event == _XLA_CACHE_HIT:
        _this_thread.xla_cache_hits = getattr(_this_thread, "xla_cache_hits", 0) + 1


@functools.cache
def _listen_for_xla_cache_hits() -> None:
    jax.monitoring.register_event_listener(_count_xla_cache_hits)


def _compile_counting_xla_hits(fn: Any, args: tuple, static: dict[str, Any]) -> tuple[Any, bool]:
    """Compile `fn` for `args`; True if XLA's persistent cache served it (then it must not be
    serialized again)."""
    _listen_for_xla_cache_hits()
    before = getattr(_this_thread, "xla_cache_hits", 0)
    program = fn.lower(*args, **static).compile()
    return program, getattr(_this_thread, "xla_cache_hits", 0) != before


@functools.cache
def _environment_digest() -> str:
    """What every program of this process shares: versions, backend, CPU, flags, source."""
    h = hashlib.sha256()
    device = jax.devices()[0]
    flags = sorted((k, v) for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_")))
    for part in (
        jax.__version__,
        jaxlib.__version__,
        device.platform,
        device.device_kind,
        device.client.platform_version,
        len(jax.devices()),
        flags,
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
        jax.config.jax_threefry_partitionable,
        _cpu_identity(),
    ):
        h.update(repr(part).encode() + b"\0")
    # The sources of the native kernels too: a program calls them by name, so their code is part of it.
    for path in sorted([*_PACKAGE.rglob("*.py"), *_PACKAGE.rglob("*.cc")]):
        h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _cpu_identity() -> str:
    """The model name and feature flags of this CPU: a program compiled for AVX-512 must not be
    loaded from a cache folder shared with a machine without it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def program_key(name: tuple, args: tuple, static: dict[str, Any]) -> str:
    """A digest of the program's identity: environment, name, static arguments, argument types."""
    leaves, treedef = jax.tree.flatten(args)
    types = [
        (
            np.shape(x),
            str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype),
            getattr(x, "weak_type", False),
            _placement(x),
        )
        for x in leaves
    ]
    text = repr((_environment_digest(), name, sorted(static.items()), str(treedef), types))
    return hashlib.sha256(text.encode()).hexdigest()


def _placement(x: Any) -> tuple[str, list[int]] | None:
    """How an argument is laid out and on which devices, in order (a mesh's repr names no
    devices): the same shapes on another replica's devices or mesh are another program."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return None
    mesh = getattr(sharding, "mesh", None)
    ids = (
        [d.id for d in mesh.devices.flat]
        if mesh is not None
        else sorted(d.id for d in sharding.device_set)
    )
    return str(sharding), ids


class ProgramCache:
    """`load_or_compile(name, fn, args, static)`: the compiled jitted `fn` for these arguments
    and whether it was loaded from `directory` (else compiled now, and stored there). With no
    directory it only compiles. Safe to call from several threads.

    `devices`: the devices the programs run on, in order (default: the first device). A loaded
    executable is bound to them; left to itself, JAX would bind it to every device of the
    backend, and a one-device program then refused its one-device arguments."""

    def __init__(
        self, directory: str | Path | None, devices: list[jax.Device] | None = None
    ) -> None:
        self.directory = Path(directory) if directory else None
        self.devices = devices
        if self.directory is not None:
            try:
                ensure_private_dir(self.directory, "the compiled-program cache directory")
            except (ValueError, OSError) as e:  # a cache is an optimisation: run without it
                logger.warning("%s; the compiled-program cache is off (programs are compiled)", e)
                self.directory = None

    def load_or_compile(
        self, name: tuple, fn: Any, args: tuple, static: dict[str, Any]
    ) -> tuple[Any, bool]:
        if self.directory is None:
            return fn.lower(*args, **static).compile(), False
        path = self.directory / f"{program_key(name, args, static)}.program"
        program = self._load(path)
        if program is not None:
            return program, True
        program, from_xla_cache = _compile_counting_xla_hits(fn, args, static)
        if from_xla_cache:
            logger.info("program %s came from XLA's compile cache: used, not stored", name)
        else:
            self._store(path, program)
        return program, False

    def _load(self, path: Path) -> Any | None:
        try:
            with open(path, "rb") as f:
                owner = os.fstat(f.fileno())
                blob = f.read()
        except OSError:
            return None
        digest, payload = blob[:32], blob[32:]
        try:
            check_owned_by_us(
                owner, f"the stored program {path.name}"
            )  # before unpickling anything
            if hashlib.sha256(payload).digest() != digest:
                raise ValueError("checksum mismatch (truncated or corrupt file)")
            serialized, in_tree, out_tree = pickle.loads(payload)
            devices = self.devices or jax.devices()[:1]
            program = serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, execution_devices=devices
            )
        except Exception as e:  # noqa: BLE001  any bad file is a miss: compile instead
            logger.warning("ignoring the stored program %s: %s", path.name, e)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: kept when old files are pruned
        return program

    def _store(self, path: Path, program: Any) -> None:
        tmp = None
        try:
            payload = pickle.dumps(serialize_executable.serialize(program))
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # removed since start-up
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)  # atomic: a reader sees the whole file or none
            tmp = None
            self._prune()
        except Exception as e:  # noqa: BLE001  storing is an optimisation; never fail a compile for it
            logger.warning("could not store the compiled program %s: %s", path.name, e)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _prune(self) -> None:
        files = sorted(self.directory.glob("*.program"), key=lambda p: p.stat().st_mtime)
        for old in files[: max(0, len(files) - MAX_FILES)]:
            old.unlink(missing_ok=True)


class CompileManager:
    """The compiled programs of one runner, by key: `program(key, fn, *args, **static)` makes
    each once (compiled ahead of time, or loaded whole from the `ProgramCache`) and keeps it, so
    a shape outside the warm-up set shows up (`num_compiles` grows, and once `warm` is set a
    warning names the key) instead of being a silent recompile. Safe to call from several
    threads (`compile_all`)."""

    def __init__(self, program_cache: ProgramCache) -> None:
        self.program_cache = program_cache
        self.programs: dict[tuple, Any] = {}
        self.num_compiles = 0  # programs made, compiled or loaded whole from the program cache
        self.num_loaded = 0  # of which loaded
        self.compile_seconds = 0.0
        self.warm = False  # the warm-up is done: a program made now was missing from it
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Any | None:
        """The program made under `key`, if any (the hot path: no abstract arguments built)."""
        return self.programs.get(key)

    def program(self, key: tuple, fn: Any, *args: Any, **static: Any) -> Any:
        """The program of jitted `fn` for these (abstract) arguments, made on first use."""
        program = self.programs.get(key)
        if program is None:
            start = time.perf_counter()
            program, loaded = self.program_cache.load_or_compile(key, fn, args, static)
            with self._lock:  # warm-up compiles from several threads
                self.compile_seconds += time.perf_counter() - start
                self.num_compiles += 1
                self.num_loaded += loaded
                self.programs[key] = program
            if self.warm:
                logger.warning(
                    "compiled %s after warm-up; a bucket is missing from the warm-up set", key
                )
        return program

    def compile_all(self, makers: list[Callable[[], Any]], progress: bool, desc: str) -> None:
        """Call every maker (each makes one program), one per core at a time: XLA compiles and
        loads stored programs outside the GIL. Any failure propagates."""
        with ThreadPoolExecutor(max_workers=min(len(makers), os.cpu_count() or 1)) as pool:
            made = pool.map(lambda make: make(), makers)
            for _ in tqdm(made, total=len(makers), desc=desc, disable=not progress):
                pass
