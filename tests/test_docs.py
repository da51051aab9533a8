"""The docs stay true: the README stays a short guide whose links resolve, every ```python block
that README.md or a docs/ page marks ``<!-- runnable -->`` runs on the shipped model, every
generated section renders from the code and the committed bench JSON, and (where the ``docs``
extra is installed) ``mkdocs build --strict`` passes."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
RUNNABLE = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```$", re.M | re.S)


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runnable_blocks() -> list[tuple[str, str]]:
    """(``file:line``, code) of every marked block, in page order."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in RUNNABLE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", m.group(1)))
    return found


def test_the_marker_finds_blocks_and_only_python_ones() -> None:
    text = "<!-- runnable -->\n```python\nx = 1\n```\n\n<!-- runnable -->\n```bash\nls\n```\n"
    assert [m.group(1) for m in RUNNABLE.finditer(text)] == ["x = 1\n"]
    where = {w.split(":")[0] for w, _ in runnable_blocks()}
    assert "README.md" in where and len(where) >= 5, where


@pytest.mark.parametrize("where,code", runnable_blocks(), ids=[w for w, _ in runnable_blocks()])
def test_runnable_block(where: str, code: str) -> None:
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})


def test_readme_is_a_short_guide_whose_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local and [link for link in local if not (ROOT / link).exists()] == []
    # the two set-up commands .ci/run relies on
    assert 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest' in readme
    assert "pip install torch==2.13.0 -e . && pagedllm generate" in readme
    assert 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest' in (ROOT / ".ci/run").read_text()


def test_generated_sections_render_from_the_code() -> None:
    from pagedllm.args import EngineArgs

    h = hooks()
    rendered = {p: h.render(p.read_text()) for p in DOCS.rglob("*.md")}
    assert all(not re.search(r"^<!-- (generated|bench):", t, re.M) for t in rendered.values())
    table = rendered[DOCS / "reference" / "engine-args.md"]
    rows = re.findall(r"^\| `([a-z_]+)` \|", table, re.M)
    assert rows == [f.name for f in fields(EngineArgs) if "help" in f.metadata]
    cli = rendered[DOCS / "reference" / "cli.md"]
    for command in ("pagedllm generate", "pagedllm serve", "pagedllm bench throughput",
                    "pagedllm plan"):
        assert f"`{command}`" in cli, command
    assert "--kv-cache-memory" in cli and str(ROOT) not in cli
    from pagedllm.vllm_args import VLLM_SETTINGS

    compat = rendered[DOCS / "serving" / "vllm-compatibility.md"]
    assert re.findall(r"^\| `([a-z0-9_]+)` \| (?:yes)? \|", compat, re.M) == list(VLLM_SETTINGS)

    from pagedllm.envs import ENV_VARS

    env = rendered[DOCS / "reference" / "environment.md"]
    assert re.findall(r"^\| `(PAGEDLLM_[A-Z_]+)` \|", env, re.M) == [v.name for v in ENV_VARS]


def test_bench_tables_come_from_the_json(tmp_path: Path) -> None:
    h = hooks()
    data = json.loads((DOCS / "performance/data/throughput.json").read_text())
    table = h.bench_md("performance/data/throughput.json backend output_tokens_per_s peak_running")
    for row in data["results"]:
        assert f"| {row['backend']} | {h._fmt(row['output_tokens_per_s'])} |" in table
    assert "Machine: " in table and "pagedllm/hf" in table


@pytest.mark.skipif(shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None,
                    reason="the docs extra is not installed (pip install -e '.[docs]'); CI "
                           "builds the site with it")
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
