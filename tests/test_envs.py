"""pagedllm's environment variables are declared once (``pagedllm/envs.py``) and read through it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pagedllm import envs

PKG = Path(__file__).resolve().parents[1] / "pagedllm"
NAME = re.compile(r"\bPAGEDLLM_[A-Z][A-Z0-9_]*")


def _reads(path: Path) -> list[str]:
    """``os.environ.get("PAGEDLLM_X")``, ``os.environ["PAGEDLLM_X"]``, ``os.getenv(...)``,
    ``"PAGEDLLM_X" in os.environ`` and ``env.get("PAGEDLLM_X")`` on any mapping but
    ``envs``, by line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            through_envs = isinstance(node.func.value, ast.Name) and node.func.value.id == "envs"
            if node.func.attr in ("get", "getenv", "pop", "setdefault") and not through_envs:
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn))
                                                   for o in node.ops):
            key = node.left
        if (isinstance(key, ast.Constant) and isinstance(key.value, str)
                and key.value.startswith("PAGEDLLM_")):
            found.append(f"{path.name}:{node.lineno} {key.value}")
    return found


def test_only_envs_reads_pagedllm_variables() -> None:
    bad = [r for p in PKG.rglob("*.py") if p.name != "envs.py" for r in _reads(p)]
    assert not bad, f"read through pagedllm.envs.get / is_on instead: {bad}"


def test_the_read_finder_finds_reads(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text('import os\na = os.environ.get("PAGEDLLM_A")\nb = os.environ["PAGEDLLM_B"]\n'
                 'c = "PAGEDLLM_C" in os.environ\nd = env.get("PAGEDLLM_D", "1")\n'
                 'os.environ["PAGEDLLM_E"] = "1"\ne = os.environ.get("OTHER")\n'
                 'f = envs.get("PAGEDLLM_F")\n')
    assert [r.split()[-1] for r in _reads(f)] == ["PAGEDLLM_A", "PAGEDLLM_B", "PAGEDLLM_C",
                                                  "PAGEDLLM_D"]


def test_every_variable_the_code_names_is_declared() -> None:
    declared = {v.name for v in envs.ENV_VARS}
    named = {m for p in PKG.rglob("*.py") for m in NAME.findall(p.read_text())}
    assert named - declared == set(), "declare these in pagedllm/envs.py ENV_VARS"
    assert declared - named == set(), "declared but never used"


def test_get_checks_values_and_falls_back_to_the_default() -> None:
    assert envs.get("PAGEDLLM_ISA", {}) == "auto"
    assert envs.get("PAGEDLLM_ISA", {"PAGEDLLM_ISA": " AVX2 "}) == "avx2"
    assert envs.get("PAGEDLLM_ISA", {"PAGEDLLM_ISA": ""}) == "auto"  # empty = unset
    with pytest.raises(ValueError, match=r"PAGEDLLM_ISA='sse': use auto, avx512 or avx2"):
        envs.get("PAGEDLLM_ISA", {"PAGEDLLM_ISA": "sse"})
    assert envs.is_on("PAGEDLLM_THP", {})
    assert not envs.is_on("PAGEDLLM_THP", {"PAGEDLLM_THP": "off"})
    with pytest.raises(ValueError, match="PAGEDLLM_THP='yes': use auto or 0"):
        envs.is_on("PAGEDLLM_THP", {"PAGEDLLM_THP": "yes"})
    assert envs.get("PAGEDLLM_API_KEY", {"PAGEDLLM_API_KEY": "K ey"}) == "K ey"  # text as given
    assert envs.get("PAGEDLLM_API_KEY", {}) is None
    with pytest.raises(KeyError):
        envs.get("PAGEDLLM_NOT_DECLARED", {})


def test_the_isa_choices_are_the_kernels() -> None:
    from pagedllm import kernels

    isa = next(v for v in envs.ENV_VARS if v.name == "PAGEDLLM_ISA")
    assert set(isa.choices) == {"auto"} | (set(kernels.ISA_NEEDS) - {"generic"})
