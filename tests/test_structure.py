"""The package's shape: no import circle (every import counts, under TYPE_CHECKING and inside
functions too), no mixin classes, no file over 400 lines outside attention/triton/, no function
over 80 lines (Triton kernels aside)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "pagedllm"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The pagedllm modules ``name`` imports anywhere in its file. ``from a import b`` is an
    import of module ``a.b`` when that is a module, else of ``a``; importing ``a.b.c`` runs the
    packages above it, which is not counted as importing them."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_through(graph, set(c)) for c in comps]


def _path_through(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A concrete cycle inside one strongly connected component, for the error message."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def test_no_import_circle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["pagedllm.engine.core"], "the import walk found nothing: it is broken"
    cycles = _cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_no_mixin_classes() -> None:
    mixins = [f"{path.relative_to(PKG.parent)}: {node.name}"
              for path in PKG.rglob("*.py")
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin")]
    assert not mixins, f"mixin classes (compose instead): {mixins}"


def test_no_file_over_400_lines() -> None:
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if "attention/triton" not in p.as_posix()
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


MAX_FUNCTION_LINES = 80


def _long_functions(path: Path) -> list[tuple[str, int]]:
    """(name, lines) of each function in ``path`` longer than ``MAX_FUNCTION_LINES``, decorators
    and docstring included; Triton kernels (``@triton.jit``: one GPU program, split only at a
    cost) aside."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if any("jit" in ast.unparse(d) for d in node.decorator_list):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        n = (node.end_lineno or node.lineno) - first + 1
        if n > MAX_FUNCTION_LINES:
            out.append((node.name, n))
    return out


def test_no_function_over_80_lines() -> None:
    long = {f"{p.relative_to(PKG.parent)}:{name}": n for p in PKG.rglob("*.py")
            for name, n in _long_functions(p)}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_the_length_check_counts_lines(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    f.write_text(f"def long():\n{body}\ndef short():\n    pass\n\n@triton.jit\n"
                 f"def kernel():\n{body}")
    assert _long_functions(f) == [("long", 81)]


def _proc_paths(path: Path) -> list[int]:
    """Lines of string constants that start with ``/proc`` (a path to parse)."""
    return [n.lineno for n in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith("/proc")]


def test_psutil_not_proc() -> None:
    """CPU times, process trees, RSS come from psutil (load averages from os.getloadavg); only
    the CPU's model and flags, which psutil does not give, are read from /proc (``_cpu.py``)."""
    found = {str(p.relative_to(PKG.parent)): lines for p in PKG.rglob("*.py")
             if p.name != "_cpu.py" and (lines := _proc_paths(p))}
    assert not found, f"/proc parsed by hand (use psutil): {found}"


# What the server may know of the engine: the client and its plain-data messages, the records
# (StepStats) and outputs; never the scheduler, the KV manager, the runner or a live Request.
SERVER_FORBIDDEN = ("pagedllm.engine.core", "pagedllm.engine.core_proc", "pagedllm.engine.snapshot",
                    "pagedllm.engine.output", "pagedllm.engine.beam", "pagedllm.sched.scheduler",
                    "pagedllm.kv.manager", "pagedllm.kv.block_pool", "pagedllm.kv.snapshot",
                    "pagedllm.request", "pagedllm.runner", "pagedllm.executor")
ENGINE_HANDLES = {"engine", "call_sync", "call_soon"}  # a live engine, closures run on it
ENGINE_PARTS = {"scheduler", "kv", "runner", "executor", "structured"}


def _name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _reaches_in(node: ast.Attribute) -> bool:
    """``x.engine`` read, or an engine part read off anything but a config (``config.scheduler``)
    or a StepStats record (``stats.kv``: block counts)."""
    if not isinstance(node.ctx, ast.Load):
        return False
    if node.attr in ENGINE_HANDLES:
        return True
    return node.attr in ENGINE_PARTS and _name(node.value) not in ("config", "stats", "s")


def test_server_modules_use_the_engine_client_only() -> None:
    modules = _modules()
    bad = []
    for name, path in modules.items():
        if not name.startswith("pagedllm.server"):
            continue
        for m in _imports(name, path, modules):
            if any(m == f or m.startswith(f + ".") for f in SERVER_FORBIDDEN):
                bad.append(f"{name} imports {m}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _reaches_in(node):
                bad.append(f"{name}:{node.lineno} reads .{node.attr}")
    assert not bad, "the server reaches into the engine (use the EngineClient): " + "; ".join(bad)


def _private_imports(path: Path, modules: dict[str, Path]) -> list[str]:
    """``from pagedllm.x import _name`` of a private name of another pagedllm module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagedllm"):
            found += [f"{node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.endswith("__")
                      and f"{node.module}.{a.name}" not in modules]
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    """The server's modules, and every other (``planner/cli.py`` once took ``bench.cli``'s
    ``_workload_args``): what two modules share is public and lives where both can own it."""
    modules = _modules()
    bad = [f"{name} imports {what}" for name, path in modules.items()
           for what in _private_imports(path, modules)]
    assert not bad, "a module imports another module's private name: " + "; ".join(bad)


def test_the_private_import_finder_finds_them(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from pagedllm.server.serving import APIError, _Hidden\nimport pagedllm._env\n")
    assert _private_imports(f, _modules()) == ["pagedllm.server.serving._Hidden"]


# Engine packages the server may not import at all, but for the plain-data modules in them: the
# per-step record the client hands on (sched.stats), the inspector's static page (kv.page).
SERVER_FORBIDDEN_PACKAGES = ("pagedllm.sched", "pagedllm.kv", "pagedllm.runner",
                             "pagedllm.executor", "pagedllm.engine.core")
SERVER_ALLOWED_DATA = {"pagedllm.sched.stats", "pagedllm.kv.page", "pagedllm.kv.events"}


def test_server_modules_import_no_engine_internals() -> None:
    modules = _modules()
    bad = []
    for name, path in modules.items():
        if not name.startswith("pagedllm.server"):
            continue
        for m in _imports(name, path, modules) - SERVER_ALLOWED_DATA:
            if any(m == p or m.startswith(p + ".") or m.startswith(p + "_")
                   for p in SERVER_FORBIDDEN_PACKAGES):
                bad.append(f"{name} imports {m}")
    assert not bad, "the server imports engine internals (use the EngineClient): " + "; ".join(bad)


def test_no_merge_conflict_markers() -> None:
    """No ``<<<<<<<`` / ``>>>>>>>`` line left by a merge in the sources, tests, docs or scripts
    (one sat in docs/design/engine-core.md, rendered as text by the docs site)."""
    root = PKG.parent
    kinds = (".py", ".md", ".cpp", ".h", ".sh", ".html", ".yml", ".toml", "")
    files = [p for top in ("pagedllm", "tests", "docs", "scripts", ".ci")
             for p in (root / top).rglob("*") if p.is_file() and p.suffix in kinds]
    files += [root / "README.md", root / "pyproject.toml", root / "mkdocs.yml"]
    marked = [f"{p.relative_to(root)}:{i + 1}" for p in files if p.is_file()
              for i, line in enumerate(p.read_text(errors="replace").splitlines())
              if line.startswith(("<<<<<<< ", ">>>>>>> "))]
    assert marked == [], f"merge-conflict markers at {marked}"
