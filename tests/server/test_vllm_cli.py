"""A vLLM user's ``serve`` command line: harmless vLLM flags accepted with a warning, harmful ones
refused naming the flag, several --served-model-name (flag and YAML), --enable-log-requests."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from server_helpers import API_KEY, ServerThread

from pagedllm.entrypoints.cli import build_parser
from pagedllm.server.cli import apply_config_file
from pagedllm.server.vllm_flags import HARMLESS, check_vllm_flags


def _serve(argv: list[str], tmp_path: Path | None = None, yaml: str | None = None):  # type: ignore[no-untyped-def]
    parser = build_parser()
    if yaml is not None:
        assert tmp_path is not None
        (tmp_path / "s.yaml").write_text(yaml)
        argv = [*argv, "--config", str(tmp_path / "s.yaml")]
    sub = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    return apply_config_file(parser.parse_args(["serve", *argv]), sub)


def test_harmless_vllm_flags_warn(capsys: pytest.CaptureFixture[str]) -> None:
    check_vllm_flags(_serve(list(HARMLESS)))
    err = capsys.readouterr().err
    for flag in HARMLESS:
        assert f"warning: {flag} has no effect here" in err
    check_vllm_flags(_serve([]))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("argv", "flag"), [
    (["--quantization", "awq"], "--quantization"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
    (["--load-format", "gguf"], "--load-format"),
])
def test_harmful_vllm_flags_are_refused(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=f"{flag} is not supported by pagedllm serve"):
        check_vllm_flags(_serve(argv))


def test_pipeline_parallel_one_is_harmless() -> None:
    check_vllm_flags(_serve(["--pipeline-parallel-size", "1"]))


def test_several_served_model_names(tmp_path: Path) -> None:
    assert _serve(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    assert _serve([], tmp_path, "served-model-name: [c, d]\n").served_model_name == ["c", "d"]
    assert _serve([], tmp_path, "served-model-name: e\n").served_model_name == "e"

    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import build_app

    engine = LLMEngine.from_args(num_kv_blocks=32)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with ServerThread(build_app(engine, model_name=["a", "b"], api_key=API_KEY,
                                log_requests=True)) as s:
        models = httpx.get(s.base_url + "/v1/models", headers=auth).json()["data"]
        assert [m["id"] for m in models] == ["a", "b"]
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
        api_log = logging.getLogger("pagedllm.server.routes")
        api_log.addHandler(handler)
        api_log.setLevel(logging.INFO)  # the suite runs at WARNING
        try:
            for name in ("a", "b"):
                r = httpx.post(s.base_url + "/v1/completions", headers=auth,
                               json={"model": name, "prompt": "x", "max_tokens": 2})
                assert r.status_code == 200 and r.json()["model"] == "a"
        finally:
            api_log.removeHandler(handler)
            api_log.setLevel(logging.NOTSET)
        assert sum("/v1/completions: SamplingParams(" in m for m in seen) == 2
        r = httpx.post(s.base_url + "/v1/completions", headers=auth,
                       json={"model": "c", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 404
