"""``pagedllm serve``: the YAML config merge, and the real command as a subprocess."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from serve_process import serve_process

from pagedllm.entrypoints.cli import build_parser
from pagedllm.server.cli import apply_config_file


def _serve_parser():  # type: ignore[no-untyped-def]
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return parser, sub.choices["serve"]  # type: ignore[union-attr]


def test_config_file_fills_defaults_and_cli_wins(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_num_seqs: 4\nblock-size: 8\nno-enable-prefix-caching: true\nport: 9001\n"
                   "api_key: k1\nmodel: /from/file\n")
    parser, serve = _serve_parser()
    a = apply_config_file(parser.parse_args(["serve", "--max-num-seqs", "16", "--config", str(cfg)]), serve)
    assert (a.max_num_seqs, a.block_size, a.enable_prefix_caching, a.port, a.api_key) == (16, 8, False, 9001, "k1")
    assert a.model == "/from/file" and a.host == "127.0.0.1"
    cfg.write_text("enable_prefix_caching: false\nbatch_wait_ms: 2\n")
    a = apply_config_file(parser.parse_args(["serve", "m", "--config", str(cfg)]), serve)
    assert a.enable_prefix_caching is False and a.batch_wait_ms == 2.0 and a.model_pos == "m"
    cfg.write_text("max-num-sequences: 4\n")
    with pytest.raises(ValueError, match="unknown key"):
        apply_config_file(parser.parse_args(["serve", "--config", str(cfg)]), serve)
    cfg.write_text("port: eighty\n")
    with pytest.raises(ValueError, match="port"):
        apply_config_file(parser.parse_args(["serve", "--config", str(cfg)]), serve)


def test_serve_subprocess_end_to_end(chat_model: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("block-size: 4\nnum_kv_blocks: 128\nmax-model-len: 64\nserved-model-name: tiny-cli\n")
    with serve_process(str(chat_model), "--config", str(cfg), "--api-key", "sk-cli",
                       "--log-level", "warning") as (proc, base):
        client = OpenAI(base_url=base + "/v1", api_key="sk-cli", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-cli"]
        r = client.completions.create(model="tiny-cli", prompt="t5 t6", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and len(r.choices[0].text.split()) == 4
        assert httpx.post(base + "/v1/completions", json={"prompt": "t5"}).status_code == 401
        # SIGTERM drains: an in-flight stream still finishes, then the server exits 0
        body = {"prompt": "t5 t6", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
        headers = {"Authorization": "Bearer sk-cli"}
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=30) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert proc.wait(timeout=30) == 0
