"""MkDocs hooks (``mkdocs.yml: hooks``): pages carry markers that are replaced, at build time, by
text generated from the code and from committed bench results, so no reference table or figure
in the docs is typed by hand.

    <!-- generated: engine-args -->          EngineArgs' fields: flag, aliases, type, default, help
    <!-- generated: cli-help -->             ``--help`` of ``pagedllm`` and every subcommand
    <!-- generated: vllm-settings -->        vLLM settings accepted with a warning or refused
    <!-- generated: env-vars -->             ``pagedllm.envs.ENV_VARS``: name, type, default, help
    <!-- bench: FILE col col ... -->         a table of FILE's ``results`` (FILE under docs/), its
                                             ``ratios`` and the machine the run measured

``tests/test_docs.py`` renders every page through ``render`` and runs the runnable blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs"
_MARKER = re.compile(r"^<!-- (generated: [a-z-]+|bench: [^>]+?) -->$", re.M)  # a line of its own


def engine_args_md() -> str:
    """One row per EngineArgs field, in declaration order, from the field's ``setting`` metadata."""
    from pagedllm.args import GROUP_TITLES, EngineArgs

    hints = typing.get_type_hints(EngineArgs)
    rows = ["| option | flag | type | default | help |", "| --- | --- | --- | --- | --- |"]
    group = None
    for f in fields(EngineArgs):
        meta = f.metadata
        if "help" not in meta:
            continue
        if meta["group"] != group:
            group = meta["group"]
            rows.append(f"| **{GROUP_TITLES[group]}** | | | | |")
        flag = "--" + f.name.replace("_", "-")
        flags = ", ".join(f"`{n}`" for n in (flag, *meta["aliases"]))
        typ = _type_name(hints[f.name])
        default = "" if f.default is MISSING or f.default is None else f"`{f.default!r}`"
        text = meta["help"]
        if meta["choices"]:
            text += " (choices: " + ", ".join(f"`{c}`" for c in meta["choices"]) + ")"
        rows.append(f"| `{f.name}` | {flags} | {typ} | {default} | {_cell(text)} |")
    return "\n".join(rows)


def env_vars_md() -> str:
    """One row per environment variable of ``pagedllm.envs``, in declaration order."""
    from pagedllm.envs import CHOICE, ENV_VARS, SWITCH

    rows = ["| variable | values | default | what it does |", "| --- | --- | --- | --- |"]
    for v in ENV_VARS:
        values = {SWITCH: "`auto` / `1` (on), `0` (off)",
                  CHOICE: " / ".join(f"`{c}`" for c in v.choices)}.get(v.type, "text")
        default = "" if v.default is None else f"`{v.default}`"
        rows.append(f"| `{v.name}` | {values} | {default} | {_cell(v.help)} |")
    return "\n".join(rows)


def _type_name(hint: Any) -> str:
    name = str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return "`" + name.replace("|", "\\|") + "`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def vllm_settings_md() -> str:
    """One row per entry of ``pagedllm.vllm_args.VLLM_SETTINGS``: where it is taken, what
    happens to a non-neutral value, and why."""
    from pagedllm.vllm_args import VLLM_SETTINGS, flag

    rows = ["| setting | `LLM(...)` | `serve` | given a non-default value | why |",
            "| --- | --- | --- | --- | --- |"]
    for name, s in VLLM_SETTINGS.items():
        quiet = ", ".join(f"`{v!r}`" for v in s.neutral if v not in (None, False))
        verdict = "refused" + (f" (fine: {quiet})" if quiet else "") if s.refused else "a warning"
        rows.append(f"| `{name}` | {'yes' if s.api else ''} | {f'`{flag(name)}`' if s.cli else ''}"
                    f" | {verdict} | {_cell(s.why)} |")
    return "\n".join(rows)


def cli_help_md() -> str:
    """``--help`` of ``pagedllm`` and each subcommand (and theirs), at a fixed width."""
    from pagedllm.config import default_model_path
    from pagedllm.entrypoints.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        parts: list[str] = []
        _walk(build_parser(), "pagedllm", parts, 2)
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    # The epilog names this checkout's model path; the docs name the package's.
    return "\n".join(parts).replace(str(default_model_path()), "pagedllm/assets/default_model")


def _walk(parser: argparse.ArgumentParser, name: str, parts: list[str], level: int) -> None:
    parts += [f"{'#' * level} `{name}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                _walk(subparser, f"{name} {sub}", parts, min(level + 1, 4))


def bench_md(spec: str) -> str:
    """A table of the chosen ``results`` columns of one bench JSON file, then its ratios and the
    machine it ran on. ``spec`` = 'FILE col col ...', FILE relative to docs/."""
    name, *columns = spec.split()
    data = json.loads((DOCS / name).read_text())
    rows = data["results"]
    cols = columns or [k for k, v in rows[0].items() if not isinstance(v, (list, dict))]
    out = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    if isinstance(data.get("ratios"), dict) and data["ratios"]:
        out += ["", "Ratios: " + "; ".join(_ratio(k, v) for k, v in data["ratios"].items()) + "."]
    for t in data.get("targets") or []:
        verdict = "met" if t.get("met") else "missed"
        out += ["", f"Target {t['target']}: {_fmt(t.get('value'))}, **{verdict}** in this run."]
    if "greedy_output_agreement" in data:
        agree = data["greedy_output_agreement"]
        shares = agree.items() if isinstance(agree, dict) else [("", agree)]
        out += ["", "Greedy outputs identical: "
                + ", ".join(f"{k} {v:.0%}".strip() for k, v in shares) + "."]
    m = data.get("machine", {})
    if m:
        out += ["", f"Machine: {m.get('cpu_count')} x {m.get('cpu_model')} "
                f"(`{m.get('pagedllm_isa', '?')}`), torch {m.get('torch')}, "
                f"{m.get('torch_threads')} thread(s), load average at start "
                f"{', '.join(m.get('loadavg_at_start') or [])}. Source: `docs/{name}`."]
    return "\n".join(out)


def _ratio(key: str, value: Any) -> str:
    if isinstance(value, dict):
        return f"{key}: " + ", ".join(f"{k} {_fmt(v)}x" for k, v in value.items())
    return f"{key} {_fmt(value)}"


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def render(markdown: str) -> str:
    """Replace every marker in ``markdown`` by what it names."""
    def one(m: re.Match[str]) -> str:
        what = m.group(1)
        if what == "generated: engine-args":
            return engine_args_md()
        if what == "generated: cli-help":
            return cli_help_md()
        if what == "generated: vllm-settings":
            return vllm_settings_md()
        if what == "generated: env-vars":
            return env_vars_md()
        if what.startswith("bench: "):
            return bench_md(what[len("bench: "):])
        raise ValueError(f"unknown docs marker {m.group(0)!r} (scripts/docs_hooks.py)")

    with contextlib.redirect_stderr(io.StringIO()):
        return _MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:  # the MkDocs hook
    return render(markdown)
