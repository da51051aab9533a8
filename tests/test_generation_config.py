"""generation_config.json defaults (vLLM's --generation-config auto): the sampling settings a
request does not set come from the model's file, its eos ids stop generation; ``vllm`` ignores
it; a request's own values win, offline and on the server."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import API_KEY, ServerThread

from pagedllm import LLM, SamplingParams
from pagedllm.config import default_model_path

GEN = {"temperature": 0.0, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.1,
       "eos_token_id": [1, 17], "do_sample": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(default_model_path(), path)
    (path / "generation_config.json").write_text(json.dumps(GEN))
    return path


def test_defaults_offline(model: Path) -> None:
    llm = LLM(str(model), num_kv_blocks=64)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty) == (0.0, 0.9, 7, 1.1)
    assert 17 in llm.engine.eos_token_ids and 1 in llm.engine.eos_token_ids
    # no sampling_params: greedy (temperature 0 from the file), whatever the seed
    a = llm.generate("def f(", use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate("def f(", SamplingParams(temperature=0.0, top_p=0.9, top_k=7,
                                             repetition_penalty=1.1, max_tokens=16),
                     use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
    plain = LLM(str(model), num_kv_blocks=64, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1.0
    assert 17 not in plain.engine.eos_token_ids
    with pytest.raises(ValueError, match="generation_config='/nowhere'"):
        LLM(str(model), num_kv_blocks=64, generation_config="/nowhere")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerThread]:
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import build_app

    engine = LLMEngine.from_args(model=str(model), num_kv_blocks=128)
    with ServerThread(build_app(engine, model_name="m", api_key=API_KEY)) as s:
        yield s


def test_defaults_on_the_server(server: ServerThread) -> None:
    def complete(**kw: object) -> str:
        body = {"prompt": "def f(", "max_tokens": 12, "ignore_eos": True, **kw}
        r = httpx.post(server.base_url + "/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    unset = {complete(seed=s) for s in range(3)}  # temperature 0 from the file: one answer
    assert len(unset) == 1
    assert unset == {complete(temperature=0.0, top_p=0.9, top_k=7, repetition_penalty=1.1)}
    sampled = {complete(temperature=1.0, top_k=0, top_p=1.0, seed=s) for s in range(4)}
    assert len(sampled) > 1  # the request's own values win
    server.wait_idle()


def test_one_merge_the_caller_then_the_file_then_the_fallback() -> None:
    from pagedllm.generation_config import GenerationDefaults

    d = GenerationDefaults({"temperature": 0.6, "top_p": 0.9})
    assert d.merge(temperature=None, top_k=None) == {"temperature": 0.6, "top_p": 0.9}
    assert d.merge(temperature=0.0, top_k=5) == {"temperature": 0.0, "top_p": 0.9, "top_k": 5}
    p = d.sampling_params({"temperature": 0.0, "min_p": 0.1}, top_p=None, max_tokens=3)
    assert (p.temperature, p.top_p, p.min_p, p.max_tokens) == (0.6, 0.9, 0.1, 3)
    p = GenerationDefaults().sampling_params({"temperature": 0.0}, temperature=None)
    assert (p.temperature, p.top_p) == (0.0, 1.0)  # the file silent: the fallback, then defaults


def test_pagedllm_generate_takes_the_file_s_defaults(tmp_path: Path) -> None:
    """The CLI was greedy whatever the file said; now the file's repetition penalty applies
    (flags still win), the same merge as LLM.generate."""
    import os
    import subprocess
    import sys

    path = tmp_path / "m"
    shutil.copytree(default_model_path(), path)
    (path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 3.0}))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def cli(*flags: str) -> str:
        r = subprocess.run([sys.executable, "-m", "pagedllm", "generate", "def f(", "--model",
                            str(path), "--num-kv-blocks", "64", "--max-tokens", "24",
                            "--ignore-eos", *flags], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout[len("def f("):-1]

    llm = LLM(str(path), num_kv_blocks=64)

    def offline(rep: float) -> str:
        sp = SamplingParams(temperature=0.0, repetition_penalty=rep, max_tokens=24,
                            ignore_eos=True)
        return llm.generate("def f(", sp, use_tqdm=False)[0].outputs[0].text

    assert offline(3.0) != offline(1.0)  # the penalty shows in 24 tokens of this model
    assert cli() == offline(3.0)
    assert cli("--temperature", "0", "--generation-config", "vllm") == offline(1.0)
