"""A vLLM script's ``LLM(...)`` runs unchanged: every vLLM setting in ``pagedllm.vllm_args`` is
accepted with a warning saying why it changes nothing, or refused naming it where it would change
outputs (the same table and reasons as ``pagedllm serve``'s flags); ``trust_remote_code``,
``revision``, ``download_dir``, ``hf_overrides`` and ``max_logprobs`` are honoured; and
``llm.llm_engine``, ``llm.reset_prefix_cache()`` and ``generate(lora_request=None)`` exist."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from server_helpers import captured_log

from pagedllm import LLM, SamplingParams
from pagedllm.args import EngineArgs
from pagedllm.config import ModelConfig
from pagedllm.vllm_args import VLLM_SETTINGS

SMALL = dict(num_kv_blocks=64, block_size=8, max_model_len=256)
API = [n for n, s in VLLM_SETTINGS.items() if s.api]


@pytest.fixture()
def warnings() -> Iterator[list[str]]:
    """The pagedllm warnings logged meanwhile (the suite logs at WARNING)."""
    with captured_log() as lines:
        yield lines


def test_a_typical_vllm_script_builds_and_generates(tiny_models: dict[str, Path],
                                                     warnings: list[str]) -> None:
    llm = LLM(model=str(tiny_models["llama"]), trust_remote_code=True, disable_log_stats=True,
              revision=None, tokenizer_mode="auto", download_dir=None, load_format="auto",
              hf_overrides=None, quantization=None, gpu_memory_utilization=0.9,
              enforce_eager=False, seed=0, swap_space=0, max_logprobs=20, dtype="auto", **SMALL)
    assert warnings == [f"disable_log_stats=True has no effect here "
                        f"({VLLM_SETTINGS['disable_log_stats'].why})"]
    assert llm.llm_engine is llm.engine
    out = llm.generate("t5 t6", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False,
                       lora_request=None)
    assert len(out[0].outputs[0].token_ids) == 3


def _given(name: str) -> object:
    """A value that is not neutral for any setting of the table."""
    return 7 if VLLM_SETTINGS[name].takes_value else True


@pytest.mark.parametrize("name", API)
def test_every_vllm_setting_warns_or_is_refused_naming_why(name: str, warnings: list[str]) -> None:
    s, value = VLLM_SETTINGS[name], _given(name)
    if s.refused:
        with pytest.raises(ValueError, match=f"^{name}={value!r} is not supported by LLM: "):
            EngineArgs.from_kwargs({name: value}, "LLM")
        assert warnings == []
    else:
        EngineArgs.from_kwargs({name: value}, "LLM")
        assert warnings == [f"{name}={value!r} has no effect here ({s.why})"]
    warnings.clear()
    EngineArgs.from_kwargs({name: s.neutral[-1]}, "LLM")  # vLLM's default: quiet
    assert warnings == []


def test_the_cli_and_the_api_give_the_same_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.server.vllm_flags import check_vllm_flags

    parser = build_parser()
    why = re.escape(VLLM_SETTINGS["quantization"].why)
    with pytest.raises(ValueError, match=f"--quantization is not supported by pagedllm serve: {why}"):
        check_vllm_flags(parser.parse_args(["serve", "--quantization", "awq"]))
    with pytest.raises(ValueError, match=f"quantization='awq' is not supported by LLM: {why}"):
        EngineArgs.from_kwargs({"quantization": "awq"}, "LLM")
    check_vllm_flags(parser.parse_args(["serve", "--max-seq-len-to-capture", "8192",
                                        "--gpu-memory-utilization", "0.5"]))
    err = capsys.readouterr().err
    assert VLLM_SETTINGS["max_seq_len_to_capture"].why in err
    assert "gpu_memory_utilization=0.5 has no effect on the CPU" in err
    with pytest.raises(TypeError, match="unknown setting 'lora_modules'"):  # a server flag only
        EngineArgs.from_kwargs({"lora_modules": "a=/x"}, "LLM")


def test_cuda_settings_on_the_cpu_warn(warnings: list[str]) -> None:
    EngineArgs.from_kwargs({"gpu_memory_utilization": 0.5, "enforce_eager": True}, "LLM")
    assert [w.split(" has")[0] for w in warnings] == ["gpu_memory_utilization=0.5",
                                                      "enforce_eager=True"]
    warnings.clear()
    EngineArgs.from_kwargs({"gpu_memory_utilization": 0.5, "device": "cuda"}, "LLM")
    assert warnings == []


def test_max_logprobs_is_honoured(tiny_models: dict[str, Path], hf_llama: object) -> None:
    llm = LLM(model=str(tiny_models["llama"]), max_logprobs=3, **SMALL)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field}=4 exceeds max_logprobs=3"):
            llm.generate("t5 t6", SamplingParams(max_tokens=2, **{field: 4}), use_tqdm=False)
    assert llm.engine.has_unfinished_requests() is False
    out = llm.generate("t5 t6", SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 3

    llm = LLM(model=str(tiny_models["llama"]), max_logprobs=-1, **SMALL)  # the vocabulary
    assert llm.engine.config.max_logprobs == llm.engine.config.model.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=30)
    lps = llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)[0].outputs[0].logprobs
    with torch.no_grad():
        ref = hf_llama(torch.tensor([[5, 6, 7]])).logits[0, -1].float().log_softmax(-1)  # type: ignore[operator]
    top = ref.topk(30)
    assert set(top.indices.tolist()) <= set(lps[0])
    for tok, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert abs(lps[0][tok].logprob - lp) < 1e-4
    with pytest.raises(ValueError, match="max_logprobs=-2 must be >= 0"):
        EngineArgs(model=str(tiny_models["llama"]), max_logprobs=-2).create_engine_config()


def test_hf_overrides_change_the_config_before_it_is_read(tiny_models: dict[str, Path]) -> None:
    path = str(tiny_models["llama"])
    cfg = EngineArgs(model=path, hf_overrides={"max_position_embeddings": 128}).create_engine_config()
    assert (cfg.model.max_position_embeddings, cfg.scheduler.max_model_len) == (128, 128)
    cfg = EngineArgs(model=path, hf_overrides='{"rms_norm_eps": 0.01}').create_engine_config()
    assert cfg.model.rms_norm_eps == 0.01  # the flag's JSON form
    for bad, match in [("{x", "is not JSON"), (["a"], "must be a dict")]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(model=path, hf_overrides=bad).create_engine_config()


CUSTOM_CONFIG = '''
from transformers import LlamaConfig


class CustomLlamaConfig(LlamaConfig):
    model_type = "{model_type}"

    def __init__(self, rms_norm_eps=1e-3, **kwargs):
        super().__init__(rms_norm_eps=rms_norm_eps, **kwargs)
'''


def _custom_code_checkpoint(src: Path, dst: Path, model_type: str) -> Path:
    """``src`` whose config.json names its own config class (auto_map), which defaults
    rms_norm_eps, a key the file leaves out, to 1e-3."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["rms_norm_eps"]
    cfg.update(model_type=model_type,
               auto_map={"AutoConfig": "configuration_custom.CustomLlamaConfig"})
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "configuration_custom.py").write_text(CUSTOM_CONFIG.format(model_type=model_type))
    return dst


def test_trust_remote_code_runs_a_configs_own_code_only_when_set(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    unknown = str(_custom_code_checkpoint(tiny_models["llama"], tmp_path / "a", "custom_llama"))
    with pytest.raises(ValueError, match="model_type='custom_llama'.*trust_remote_code=True"):
        ModelConfig.from_hf(unknown)
    assert ModelConfig.from_hf(unknown, trust_remote_code=True).rms_norm_eps == 1e-3
    # a model_type transformers knows: without the flag, the file as written (pagedllm's default)
    known = str(_custom_code_checkpoint(tiny_models["llama"], tmp_path / "b", "llama"))
    assert ModelConfig.from_hf(known).rms_norm_eps == 1e-6
    assert ModelConfig.from_hf(known, trust_remote_code=True).rms_norm_eps == 1e-3


def test_trust_remote_code_reaches_the_tokenizer(tiny_models: dict[str, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import tokenizer

    seen: list[object] = []
    real = tokenizer.AutoTokenizer.from_pretrained

    def recording(path: str, **kwargs: object) -> object:
        seen.append(kwargs.get("trust_remote_code"))
        return real(path, **kwargs)

    monkeypatch.setattr(tokenizer.AutoTokenizer, "from_pretrained", recording)
    llm = LLM(model=str(tiny_models["llama"]), trust_remote_code=True, **SMALL)
    assert llm.engine.config.model.trust_remote_code and seen and all(s is True for s in seen)
    seen.clear()
    LLM(model=str(tiny_models["llama"]), **SMALL)
    assert seen and all(s is False for s in seen)


def test_revision_and_download_dir_pick_the_snapshot(tiny_models: dict[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "dl" / "models--pagedllm-test--tiny"
    commits = {"main": "a" * 40, "v1": "b" * 40}
    (repo / "refs").mkdir(parents=True)
    for ref, commit in commits.items():
        shutil.copytree(tiny_models["llama"], repo / "snapshots" / commit)
        (repo / "refs" / ref).write_text(commit)
    for rev, commit in [(None, commits["main"]), ("v1", commits["v1"])]:
        cfg = EngineArgs(model="pagedllm-test/tiny", revision=rev,
                         download_dir=str(tmp_path / "dl")).create_engine_config()
        assert Path(cfg.model.model).name == commit and Path(cfg.tokenizer).name == commit
    with pytest.raises(ValueError, match=r"\(revision 'v2'\) is not a local directory"):
        EngineArgs(model="pagedllm-test/tiny", revision="v2",
                   download_dir=str(tmp_path / "dl")).create_engine_config()


def test_reset_prefix_cache(tiny_models: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_models["llama"]), **SMALL)
    prompt = {"prompt_token_ids": list(range(4, 40))}
    sp = SamplingParams(max_tokens=1)
    for expect_hits in (False, True):
        before = llm.get_prefix_cache_stats()["hits"]
        llm.generate(prompt, sp, use_tqdm=False)
        assert (llm.get_prefix_cache_stats()["hits"] > before) is expect_hits
    assert llm.reset_prefix_cache()
    before = llm.get_prefix_cache_stats()["hits"]
    llm.generate(prompt, sp, use_tqdm=False)
    assert llm.get_prefix_cache_stats()["hits"] == before  # cold again
    llm.engine.check_integrity()
