"""Build the native CPU kernels: every `*.cc` here into one shared library beside them.

    python -m minivllm_jax.kernels.build        # what `make setup` runs after installing

Flags suit the CPU it runs on (`-march=native`: the library is built on the machine that uses
it, at install time). The kernels split their work over XLA's own CPU thread pool (`parallel.h`),
so no threading library is linked. The XLA FFI headers come with jaxlib
(`jax.ffi.include_dir()`). Without a compiler this prints one warning and exits 0: the package
then runs every op on its pure-JAX reference.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

from minivllm_jax.kernels import LIBRARY, sources

FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno"]


def build(verbose: bool = True) -> bool:
    """Compile the library (atomically replaced); False, with a reason printed, if it cannot.
    Each source compiles on its own process, all at once (one per core: 18 s one after another
    here, for a `make setup` that waits on it), then one link."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        print(
            "warning: no C++ compiler found; native kernels not built, the pure-JAX reference runs instead",
            file=sys.stderr,
        )
        return False
    LIBRARY.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=LIBRARY.parent, suffix=".so")
    os.close(fd)
    with tempfile.TemporaryDirectory(dir=LIBRARY.parent) as work:
        objects = {src: str(Path(work) / f"{src.stem}.o") for src in sources()}
        compiles = [
            [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", "-c", str(src), "-o", obj]
            for src, obj in objects.items()
        ]
        link = [compiler, *FLAGS, *objects.values(), "-o", tmp]
        for cmd in [*compiles, link] if verbose else []:
            print(" ".join(cmd))
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            runs = list(pool.map(_run, compiles))
        result = next((run for run in runs if run.returncode != 0), None) or _run(link)
    if result.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        print(
            f"warning: building the native kernels failed; the pure-JAX reference runs instead:\n{result.stderr[-4000:]}",
            file=sys.stderr,
        )
        return False
    os.replace(tmp, LIBRARY)
    return True


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


if __name__ == "__main__":
    build()
    sys.exit(0)
