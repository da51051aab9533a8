"""Each closed list of ``pagedllm.choices`` is what the code behind it implements, and the flags,
the configs and the server take exactly it."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from pagedllm import choices
from pagedllm.args import EngineArgs
from pagedllm.config import ParallelConfig, SchedulerConfig


def test_each_list_is_what_the_code_implements() -> None:
    from pagedllm.attention.cpu import CpuBackend
    from pagedllm.attention.quant import QUANT_DTYPES
    from pagedllm.attention.torch_ref import TorchRefBackend

    builtin = [TorchRefBackend.name, CpuBackend.name]
    if importlib.util.find_spec("triton") is not None:
        from pagedllm.attention.triton.backend import TritonBackend

        builtin.append(TritonBackend.name)
        assert tuple(builtin) == choices.ATTENTION_BACKENDS
    assert set(builtin) <= set(choices.ATTENTION_BACKENDS)
    assert set(choices.KV_CACHE_DTYPES) == {"auto", *QUANT_DTYPES}
    assert set(choices.KV_CACHE_DTYPE_ALIASES.values()) <= set(choices.KV_CACHE_DTYPES)
    assert set(choices.DTYPE_ALIASES.values()) == set(choices.SUPPORTED_DTYPES)


def test_the_configs_take_exactly_the_lists() -> None:
    for mode in choices.PREEMPTION_MODES:
        SchedulerConfig(preemption_mode=mode)
    with pytest.raises(ValueError, match="'recompute', 'swap', 'auto'"):
        SchedulerConfig(preemption_mode="drop")
    for backend in choices.EXECUTOR_BACKENDS:
        ParallelConfig(distributed_executor_backend=backend)
    with pytest.raises(ValueError, match="'mp', 'ray'"):
        ParallelConfig(distributed_executor_backend="slurm")


@pytest.mark.parametrize(("flag", "values"), [
    ("--dtype", choices.DTYPE_NAMES), ("--kv-cache-dtype", choices.KV_CACHE_DTYPE_NAMES),
    ("--v-cache-dtype", choices.KV_CACHE_DTYPE_NAMES),
    ("--linear-backend", choices.LINEAR_BACKENDS), ("--preemption-mode", choices.PREEMPTION_MODES),
    ("--distributed-executor-backend", choices.EXECUTOR_BACKENDS),
])
def test_the_flags_take_exactly_the_lists(flag: str, values: tuple[str, ...]) -> None:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    for v in values:
        p.parse_args([flag, v])
    with pytest.raises(SystemExit):
        p.parse_args([flag, "nonsense"])


def test_the_server_takes_the_tool_parsers() -> None:
    from pagedllm.server.args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    assert [p.parse_args(["--tool-call-parser", t]).tool_call_parser
            for t in choices.TOOL_CALL_PARSERS] == list(choices.TOOL_CALL_PARSERS)
