"""Server fixtures: a tiny random-weight Llama with a chat template, served in-process by uvicorn
on a free loopback port (the engine thread and the event loop run exactly as in ``pagedllm serve``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import API_KEY, CHAT_TEMPLATE, ServerThread


@pytest.fixture(scope="session")
def chat_model(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "llama-chat"
    shutil.copytree(tiny_models["llama"], path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def server(chat_model: Path) -> Iterator[ServerThread]:
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import ServerLimits, build_app

    engine = LLMEngine.from_args(model=str(chat_model), block_size=4, num_kv_blocks=512, max_model_len=128,
                                 max_num_seqs=64)
    limits = ServerLimits(max_request_bytes=64 * 1024, max_n=4, max_prompt_tokens=100, max_prompts=4)
    app = build_app(engine, model_name="tiny", api_key=API_KEY, limits=limits)
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def tools_server(bpe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A BPE model whose chat template renders tools and tool calls, the hermes parser, served
    as ``m``; the template comes as a file, as ``pagedllm serve --chat-template FILE`` passes it."""
    from structured_helpers import TOOLS_TEMPLATE

    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import build_app

    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    engine = LLMEngine.from_args(model=str(bpe_model), num_kv_blocks=512, max_num_seqs=16)
    with ServerThread(build_app(engine, model_name="m", api_key=API_KEY,
                                tool_call_parser="hermes", chat_template=str(template))) as s:
        yield s
