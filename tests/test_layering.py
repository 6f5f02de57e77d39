"""The package's layers, kept by reading every import with `ast` (nothing is imported).

Low to high: kernels <- data (config, sampling_params, outputs, prompts) <- ops <- models <- parallel,
loading <- engine <- reference <- entry points (llm, args, __main__). A module imports only
modules of its own layer or below; the import graph has no cycle; imports of our own modules
sit at the top of the file (a function-level import would hide a cycle); `minivllm_jax` never
imports `server`, `convert`, `benchmarks` or `tests`, and `server` never imports `convert`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("minivllm_jax", "server", "convert")
LAYERS = [
    ["minivllm_jax.kernels"],
    [
        "minivllm_jax.config",
        "minivllm_jax.sampling_params",
        "minivllm_jax.outputs",
        "minivllm_jax.prompts",  # tokenizing: uses only a tokenizer and the params' errors
    ],
    ["minivllm_jax.ops"],
    ["minivllm_jax.models"],
    ["minivllm_jax.parallel", "minivllm_jax.loading"],
    ["minivllm_jax.engine"],
    ["minivllm_jax.reference"],
    ["minivllm_jax.llm", "minivllm_jax.args", "minivllm_jax.__main__", "minivllm_jax"],
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {}
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "_build" not in path.parts:
                found[module_name(path)] = path
    return found


MODULES = modules()


def resolve(name: str) -> str:
    """The longest prefix of a dotted name that is one of our modules."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at top level?) for each import of our own modules."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks are top level too
        if isinstance(node, ast.If):
            top_level.update(id(child) for child in node.body)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] or [base]
        else:
            continue
        for name in names:
            if name.split(".")[0] in OURS:
                found.append((resolve(name), node.lineno, id(node) in top_level))
    return found


GRAPH = {m: imports(m) for m in MODULES}


def layer(module: str) -> int | None:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    return None if best is None else best[0]


def test_every_package_module_has_a_layer() -> None:
    orphans = [m for m in MODULES if m.startswith("minivllm_jax") and layer(m) is None]
    assert not orphans, f"modules outside every layer (add them to LAYERS): {orphans}"


def test_no_import_points_up_a_layer() -> None:
    upward = [
        f"{module}:{line} imports {target} (layer {layer(target)} > {layer(module)})"
        for module, edges in GRAPH.items()
        if module.startswith("minivllm_jax.") and module != "minivllm_jax.__init__"
        for target, line, _ in edges
        if target.startswith("minivllm_jax") and layer(target) > layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_the_package_imports_no_app_and_the_server_no_converter() -> None:
    wrong = [
        f"{module}:{line} imports {target}"
        for module, edges in GRAPH.items()
        for target, line, _ in edges
        if (module.startswith("minivllm_jax") and not target.startswith("minivllm_jax"))
        or (module.startswith("server") and target.startswith("convert"))
    ]
    assert not wrong, "\n".join(wrong)


def test_our_imports_sit_at_the_top_of_the_file() -> None:
    lazy = [
        f"{module}:{line} imports {target} inside a function"
        for module, edges in GRAPH.items()
        for target, line, top in edges
        if not top and target != module
    ]
    assert not lazy, "\n".join(lazy)


def test_the_import_graph_has_no_cycle() -> None:
    edges = {m: sorted({t for t, _, _ in GRAPH[m] if t in MODULES and t != m}) for m in MODULES}
    # A package's __init__ re-exporting its own submodules is not a cycle of meaning.
    for m in edges:
        edges[m] = [
            t for t in edges[m] if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))
        ]
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    """The walker itself: an upward, a lazy and a cyclic import in made-up modules are found."""
    global MODULES
    saved = MODULES
    try:
        (tmp_path / "minivllm_jax" / "ops").mkdir(parents=True)
        (tmp_path / "minivllm_jax" / "ops" / "a.py").write_text(
            "from minivllm_jax.engine import b\n\ndef f():\n    from minivllm_jax.ops import a\n"
        )
        MODULES = {
            "minivllm_jax.ops.a": tmp_path / "minivllm_jax" / "ops" / "a.py",
            "minivllm_jax.engine.b": tmp_path / "b.py",
        }
        found = imports("minivllm_jax.ops.a")
        assert ("minivllm_jax.engine.b", 1, True) in found
        assert ("minivllm_jax.ops.a", 4, False) in found
        assert layer("minivllm_jax.engine.b") > layer("minivllm_jax.ops.a")
    finally:
        MODULES = saved


# The engine's parts: code outside minivllm_jax/engine asks `LLMEngine.stats()`, its step
# listeners and its request API instead of reaching into these (tests may still).
ENGINE_INTERNALS = frozenset(
    {
        "scheduler",
        "runner",
        "page_manager",
        "block_manager",
        "tiers",
        "output_processor",
        "step_update",
        "input_processor",
    }
)
# Reads kept on purpose, each with its reason.
ENGINE_INTERNAL_READS_ALLOWED = {
    # The quality score runs the model's own forward over the runner's params and KV buffers.
    "benchmarks/quality/bench_quant.py",
}


def engine_internal_reads(source: str) -> list[int]:
    """Lines of `source` that read an engine's internals: `<engine>.runner`, `.scheduler`, ...
    or a private `<engine>._name`, where `<engine>` is a name `engine` or `e` or an attribute
    `.engine` (`llm.engine.runner`, `self.engine.scheduler`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        name = getattr(owner, "id", None) or getattr(owner, "attr", None)
        is_engine = (isinstance(owner, ast.Name) and name in ("engine", "e")) or (
            isinstance(owner, ast.Attribute) and name == "engine"
        )
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if is_engine and (node.attr in ENGINE_INTERNALS or private):
            lines.append(node.lineno)
    return sorted(lines)


def test_nothing_outside_the_engine_reads_its_internals() -> None:
    found = []
    for top in (*OURS, "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("minivllm_jax/engine/") or rel in ENGINE_INTERNAL_READS_ALLOWED:
                continue
            found += [f"{rel}:{line}" for line in engine_internal_reads(path.read_text())]
    assert not found, (
        "engine internals read outside the engine (use stats()/listeners):\n" + "\n".join(found)
    )
    # The check itself finds what it looks for, and not a config's `scheduler` group.
    assert engine_internal_reads(
        "llm.engine.runner.run = f\nengine.scheduler.running\ne._in_flight\nconfig.scheduler.x\n"
    ) == [1, 2, 3]
