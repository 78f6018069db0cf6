"""The package's house rules, read from its source: imports only go down (no cycle,
whether the import is at the top of a module or inside a function), libraries never
import a command-line module, and no module grows past ~500 lines."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jaxdist"
# python -m jaxdist.X: argument parsing and one call into a library; nothing imports them
CLIS = {
    "jaxdist.__main__",
    "jaxdist.train",
    "jaxdist.analyze",
    "jaxdist.profile",
    "jaxdist.convert",
    "jaxdist.generate",
    "jaxdist.eval",
    "jaxdist.launch",
    "jaxdist.commbench",
}
CLI_PACKAGES = {"jaxdist.data.__main__", "jaxdist.plan.__main__"}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The jaxdist modules ``name`` imports anywhere in its source (a package's
    ``__init__`` counts only when a name is taken from it, not for its submodules)."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            if target.startswith("jaxdist"):
                resolved = resolve(target)
                if resolved and resolved != name:
                    found.add(resolved)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_no_library_imports_a_command_line_module():
    graph = _graph()
    offenders = [f"{m} imports {d}" for m, deps in graph.items() for d in deps if d in CLIS | CLI_PACKAGES and m not in CLIS]
    assert not offenders, offenders


def test_the_top_level_holds_the_command_lines_and_the_config():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == {name.split(".")[1] for name in CLIS} | {"__init__", "config", "config_fields", "config_rules", "cli", "errors"}, top


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_a_module_run_as_main_logs_under_its_own_name():
    """Run as ``python -m jaxdist.X``, a module's ``__name__`` is ``__main__``: a logger named by
    it is outside ``jaxdist``'s, and its lines never reach stderr."""
    runnable = {
        name: path for name, path in _modules().items() if path.name == "__main__.py" or '__name__ == "__main__"' in path.read_text()
    }
    assert "jaxdist.analyze" in runnable and "jaxdist.plan.measure" in runnable
    bad = sorted(name for name, path in runnable.items() if "getLogger(__name__)" in path.read_text())
    assert not bad, bad


def test_the_graph_sees_function_level_imports():
    """The walk must catch an import hidden inside a function (a lazy import is still an
    edge): jaxdist.train imports the training library only inside main()."""
    source = (PACKAGE / "train.py").read_text()
    tree = ast.parse(source)
    top_level = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    inside = _graph()["jaxdist.train"] - {m for m in top_level if m}
    assert inside, "expected function-level imports in jaxdist.train"


# Lazy imports a module that already imports JAX may keep: optional kernels and libraries
# that are heavy or absent where they are not used (each named with why).
OPTIONAL = {
    "jax._src.cudnn",  # cuDNN attention: only with model.attention=cudnn (a private module, imported where it is used)
    "jax.experimental.pallas.ops.gpu",  # Pallas attention: only with model.attention=pallas
}


def test_function_level_imports_only_before_jax_starts():
    """A function-level import delays its module until the call: that is for the code that
    runs before JAX starts (the CLIs, the config, the device and platform choice, what they
    import first). A module that imports JAX at its top has nothing to delay, so its imports
    of jaxdist, JAX and its libraries sit at the top (optional kernels aside)."""
    offenders = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
        if not top & {"jax", "flax", "optax"}:
            continue
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                modules = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                for module in modules:
                    if module.split(".")[0] in ("jaxdist", "jax", "flax", "optax", "numpy") and module not in OPTIONAL:
                        offenders.append(f"{name}:{node.lineno} imports {module} inside {func.name}")
    assert not offenders, "\n".join(sorted(set(offenders)))
