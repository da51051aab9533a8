"""EngineArgs is the one source of engine settings: every field is a flag of every command that
builds an engine, a key of a YAML --config file (command line > file > defaults) and a keyword of
LLM(...); vLLM's names are aliases of the same fields."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

import pagedllm
from pagedllm import LLM, SamplingParams
from pagedllm.args import EngineArgs
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.layers.linear import w16_dtype

FIELDS = dataclasses.fields(EngineArgs)


def _help(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize("command", [("serve",), ("generate",), ("plan",), ("bench", "throughput")])
def test_every_field_is_a_flag_in_help(capsys: pytest.CaptureFixture[str], command: tuple[str, ...]) -> None:
    text = _help(capsys, *command)
    missing = [f.name for f in FIELDS if not re.search(rf"(?<![\w-]){_dashed(f.name)}(?![\w-])", text)]
    assert not missing, f"`pagedllm {' '.join(command)} --help` lacks flags for {missing}"
    for f in FIELDS:  # booleans in both forms
        if f.type == "bool":
            assert f"--no-{f.name.replace('_', '-')}" in text


def _sample(f: dataclasses.Field) -> tuple[list[str], object]:  # type: ignore[type-arg]
    """Command-line words that set field ``f`` to a value other than its default, and that value."""
    flag = _dashed(f.name)
    choices = f.metadata.get("choices")
    if f.type == "bool":
        return ([f"--no-{flag[2:]}"] if f.default else [flag]), not f.default
    if choices:
        value = next(c for c in reversed(choices) if c != f.default)
        return [flag, str(value)], value
    if f.type.startswith("int"):
        return [flag, "7"], 7
    if f.type.startswith("float"):
        return [flag, "0.25"], 0.25
    return [flag, "some-value"], "some-value"


def test_every_flag_sets_its_field() -> None:
    parser = build_parser()
    for f in FIELDS:
        words, value = _sample(f)
        a = parser.parse_args(["generate", "p", *words])
        assert getattr(EngineArgs.from_cli(a), f.name) == value, f.name
        untouched = EngineArgs.from_cli(parser.parse_args(["generate", "p"]))
        assert getattr(untouched, f.name) == f.default, f.name


def test_public_name_and_defaults_written_once() -> None:
    assert pagedllm.EngineArgs is EngineArgs and "EngineArgs" in pagedllm.__all__
    a = EngineArgs()
    assert (a.block_size, a.grow_chunk, a.compact_window_steps) == (
        CacheConfig.block_size, CacheConfig.grow_chunk, CacheConfig.compact_window_steps)
    assert (a.max_num_seqs, a.preemption_mode) == (SchedulerConfig.max_num_seqs,
                                                   SchedulerConfig.preemption_mode)


def test_aliases_reach_the_same_field(tmp_path: Path) -> None:
    parser = build_parser()
    pairs = [(["--kv-cache-memory-bytes", "1GiB"], ["--kv-cache-memory", "1GiB"]),
             (["--num-gpu-blocks-override", "9"], ["--num-kv-blocks", "9"]),
             (["-tp", "2"], ["--tensor-parallel-size", "2"]),
             (["--kv-trace", "t.jsonl"], ["--kv-trace-path", "t.jsonl"])]
    for alias, own in pairs:
        got = EngineArgs.from_cli(parser.parse_args(["generate", "p", *alias]))
        assert got == EngineArgs.from_cli(parser.parse_args(["generate", "p", *own]))
        assert got != EngineArgs()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num-gpu-blocks-override: 11\nkv_cache_memory_bytes: 3MiB\n")
    got = EngineArgs.from_cli(parser.parse_args(["plan", "--config", str(cfg)]))
    assert (got.num_kv_blocks, got.kv_cache_memory) == (11, "3MiB")
    kw = EngineArgs.from_kwargs({"num_gpu_blocks_override": 5, "kv_cache_memory_bytes": 2**20})
    assert (kw.num_kv_blocks, kw.kv_cache_memory) == (5, 2**20)


def test_unknown_keyword_names_the_closest_field(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(TypeError, match=r"LLM got an unknown setting 'num_kv_block'; did you mean 'num_kv_blocks'"):
        LLM(model=str(tiny_models["llama"]), num_kv_block=64)
    with pytest.raises(TypeError, match="'enable_prefix_cache'.*'enable_prefix_caching'"):
        EngineArgs.from_kwargs({"enable_prefix_cache": False})


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_config_file_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 9000\nmax_num_seqs: 4\nenable-prefix-caching: false\ngrow-chunk: 8\n"
                   "dtype: half\nenable_chunked_prefill: false\n")
    a = _serve_args("--config", str(cfg))  # the file beats the defaults
    e = EngineArgs.from_cli(a)
    assert (a.port, e.max_num_seqs, e.enable_prefix_caching, e.grow_chunk, e.dtype) == (
        9000, 4, False, 8, "half")
    assert e.enable_chunked_prefill is False
    # the command line beats the file, also when it says the default
    a = _serve_args("--config", str(cfg), "--port", "8000", "--max-num-seqs", "64",
                    "--enable-prefix-caching", "--grow-chunk", "64", "--enable-chunked-prefill")
    e = EngineArgs.from_cli(a)
    assert (a.port, e.max_num_seqs, e.enable_prefix_caching, e.grow_chunk) == (8000, 64, True, 64)
    assert e.enable_chunked_prefill is True and e.dtype == "half"
    # order does not matter: --config after the flags
    a = _serve_args("--port", "8000", "--config", str(cfg))
    assert a.port == 8000 and EngineArgs.from_cli(a).max_num_seqs == 4
    # generate and plan read files the same way (`port` is not one of their flags)
    cfg.write_text("max_num_seqs: 4\ngrow-chunk: 8\n")
    for command in (["plan"], ["generate", "p"]):
        e = EngineArgs.from_cli(build_parser().parse_args([*command, "--config", str(cfg),
                                                           "--max-num-seqs", "64"]))
        assert (e.max_num_seqs, e.grow_chunk) == (64, 8)


def test_config_file_errors_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-num-seq: 4\n")
    assert main(["plan", "--config", str(cfg)]) == 2
    assert "unknown key 'max-num-seq' (did you mean 'max-num-seqs'?)" in capsys.readouterr().err
    cfg.write_text("enable-prefix-caching: maybe\n")
    assert main(["plan", "--config", str(cfg)]) == 2
    assert "enable-prefix-caching must be true or false" in capsys.readouterr().err
    cfg.write_text("preemption-mode: sometimes\n")
    assert main(["plan", "--config", str(cfg)]) == 2
    assert "preemption-mode='sometimes'; choose one of" in capsys.readouterr().err


def test_new_flags_reach_the_frozen_config(tiny_models: dict[str, Path]) -> None:
    a = build_parser().parse_args([
        "plan", "--model", str(tiny_models["llama"]), "--grow-chunk", "8",
        "--compact-window-steps", "3", "--no-enable-chunked-prefill", "--max-model-len", "128"])
    cfg = EngineArgs.from_cli(a).create_engine_config()
    assert (cfg.cache.grow_chunk, cfg.cache.compact_window_steps) == (8, 3)
    assert cfg.scheduler.enable_chunked_prefill is False


@pytest.mark.parametrize(("flag", "resolved"), [("half", "float16"), ("fp16", "float16"),
                                                ("float", "float32"), ("bf16", "bfloat16")])
def test_dtype_aliases_on_the_command_line(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                           flag: str, resolved: str) -> None:
    assert main(["plan", "--model", str(tiny_models["llama"]), "--dtype", flag]) == 0
    out = capsys.readouterr().out
    cfg = EngineArgs(model=str(tiny_models["llama"]), dtype=flag).create_engine_config()
    if w16_dtype(resolved, "cpu") is None:  # the CPU computes in the dtype itself
        assert cfg.model.dtype == resolved and cfg.model.weight_dtype is None
        assert re.search(rf"head_dim \d+, {resolved}\)", out)
    else:  # no arithmetic for it here: 16-bit weights, float32 compute, and the plan says so
        assert (cfg.model.dtype, cfg.model.weight_dtype) == ("float32", resolved)
        assert re.search(rf"head_dim \d+, float32 compute, {resolved} weights\)", out)


def test_dtype_half_generates_end_to_end(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model = str(tiny_models["llama"])
    assert main(["generate", "t5 t6 t7", "--model", model, "--dtype", "half", "--max-tokens", "5",
                 "--ignore-eos"]) == 0
    out = capsys.readouterr()
    llm = LLM(model=model, dtype="float16")
    m = llm.engine.config.model
    assert (m.weight_dtype or m.dtype) == "float16"  # float16 weights, float32 math without FP16
    expected = llm.generate("t5 t6 t7", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert len(expected.token_ids) == 5
    assert out.out == "t5 t6 t7" + expected.text + "\n"
    assert "5 tokens" in out.err


def test_getting_started_lists_every_option_in_order() -> None:
    readme = (Path(__file__).resolve().parents[1] / "docs" / "getting-started.md").read_text()
    start = readme.index("<!-- engine-options")
    block = readme[readme.index("-->", start) + 3:readme.index("<!-- /engine-options -->")]
    listed = [m for m in re.findall(r"`([a-z_]+)`", block) if m in {f.name for f in FIELDS}]
    assert listed == [f.name for f in FIELDS]


@pytest.mark.parametrize("change,names", [
    ({"device": "cuda", "attention_backend": "torch_ref"}, "--attention-backend triton"),
    ({"linear_backend": "onednn"}, "--linear-backend auto"),
    ({"fused_ops": False}, "--no-fused-ops"),
    ({"tensor_parallel_size": 2}, "-tp 1"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "--speculative-config"),
    ({"enable_lora": True}, "--enable-lora"),
])
def test_batch_invariant_refuses_what_it_does_not_cover(tiny_models: dict[str, Path],
                                                        change: dict[str, object],
                                                        names: str) -> None:
    args = EngineArgs(model=str(tiny_models["llama"]), batch_invariant=True, **change)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--batch-invariant") as e:
        args.create_engine_config()
    assert names in str(e.value)
    EngineArgs(model=str(tiny_models["llama"]), **change).create_engine_config()  # type: ignore[arg-type]


def test_batch_invariant_refuses_a_backend_and_dtype_it_cannot_run(
        tiny_models: dict[str, Path]) -> None:
    from pagedllm import LLM

    with pytest.raises(ValueError, match="--attention-backend cpu"):
        LLM(model=str(tiny_models["llama"]), batch_invariant=True, attention_backend="torch_ref")
    if w16_dtype("float16", "cpu") is None:  # float16 math (AVX512-FP16) is oneDNN's, not the GEMM's
        with pytest.raises(ValueError, match="--dtype float32"):
            LLM(model=str(tiny_models["llama"]), batch_invariant=True, dtype="float16")
    else:  # float16 weights on the GEMM, float32 math: batch-invariant as float32 is
        llm = LLM(model=str(tiny_models["llama"]), batch_invariant=True, dtype="float16")
        assert llm.engine.config.model.weight_dtype == "float16"
