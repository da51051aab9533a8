"""Models by Hugging Face id from the local cache (HF_HUB_OFFLINE honoured, a clear error naming
the id and the cache when absent), and checkpoint formats pagedllm cannot load refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.args import EngineArgs
from pagedllm.config import default_model_path


@pytest.fixture()
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hugging Face cache holding the shipped model as ``pagedllm-test/tiny``, laid
    out as huggingface_hub writes it (refs/main -> snapshots/<commit>/files)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--pagedllm-test--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(default_model_path(), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_cached_hf_id_loads_and_generates_as_the_path(hf_cache: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    by_id = LLM("pagedllm-test/tiny", num_kv_blocks=64).generate("def f(", greedy, use_tqdm=False)
    by_path = LLM(num_kv_blocks=64).generate("def f(", greedy, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == by_path[0].outputs[0].token_ids


def test_an_absent_hf_id_names_the_id_and_the_cache(hf_cache: Path) -> None:
    with pytest.raises(ValueError, match=r"model='nobody/nothing' is not a local directory and "
                       r"not in the Hugging Face cache .*hub \(HF_HUB_OFFLINE is set\)"):
        EngineArgs(model="nobody/nothing").create_engine_config()


def _checkpoint(tmp_path: Path, **extra: Any) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(default_model_path(), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **extra}))
    return path


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_a_quantized_checkpoint_is_refused_by_its_format(tmp_path: Path, method: str) -> None:
    path = _checkpoint(tmp_path, quantization_config={"quant_method": method, "bits": 4})
    with pytest.raises(ValueError, match=f"quantized checkpoint .*quant_method='{method}'"):
        EngineArgs(model=str(path)).create_engine_config()


def test_a_gguf_checkpoint_is_refused_by_its_format(tmp_path: Path) -> None:
    f = tmp_path / "model-Q4_K_M.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00")
    for model in (f, tmp_path):  # the file, and a directory holding only it
        with pytest.raises(ValueError, match="is a GGUF checkpoint"):
            EngineArgs(model=str(model)).create_engine_config()
