"""Nothing outside the runner touches the KV tensors: every change travels in the step.

The runner (pagedllm/runner/) owns the KV tensors of its rank; the engine, the scheduler, the
executor and the workers only hand it ``ModelInput.kv`` through ``execute`` / ``run_step``.
This walks the package's syntax trees: no ``.kv_cache`` attribute, no ``"kv_cache"`` string
(``getattr``) and no import of ``pagedllm.runner.kv_cache`` outside the runner. (Tests read rank
0's tensors through ``engine.runner.kv_cache``; the package does not.)
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "pagedllm"


def _offences(path: Path, root: Path = PKG) -> list[str]:
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        hit = None
        if isinstance(node, ast.Attribute) and node.attr == "kv_cache":
            hit = "attribute .kv_cache"
        elif isinstance(node, ast.Constant) and node.value == "kv_cache":
            hit = "string 'kv_cache'"
        elif isinstance(node, ast.ImportFrom) and node.module == "pagedllm.runner.kv_cache":
            hit = "import of pagedllm.runner.kv_cache"
        if hit:
            out.append(f"{rel}:{getattr(node, 'lineno', '?')} ({func}): {hit}")
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return out


def test_only_the_runner_touches_kv_tensors() -> None:
    files = [p for p in PKG.rglob("*.py") if "runner" not in p.relative_to(PKG).parts[:1]]
    assert len(files) > 50
    offences = [o for p in sorted(files) for o in _offences(p)]
    assert offences == [], "KV tensors touched outside pagedllm/runner/:\n" + "\n".join(offences)


def test_the_check_sees_each_kind_of_offence(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"  # what kv_preheat.py and the TP executor did before this rule
    bad.write_text("from pagedllm.runner.kv_cache import KVCache\n"
                   "def grow(engine):\n    engine.runner.kv_cache.resize(8)\n"
                   "def forward(runner, msg):\n    getattr(getattr(runner, 'kv_cache'), msg[1])(msg[2])\n")
    assert _offences(bad, tmp_path) == [
        "probe.py:1 (<module>): import of pagedllm.runner.kv_cache",
        "probe.py:3 (grow): attribute .kv_cache",
        "probe.py:5 (forward): string 'kv_cache'",
    ]
