"""``pagedllm serve``: the YAML config merge, and the real command as a subprocess."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from serve_process import child_pids, serve_process

from pagedllm import LLM, SamplingParams
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
    cfg.write_text("block-size: 4\nnum_kv_blocks: 256\nmax-model-len: 512\nserved-model-name: tiny-cli\n"
                   "max-num-seqs: 1\ndrain-timeout: 1\n")
    with serve_process(str(chat_model), "--config", str(cfg), "--api-key", "sk-cli",
                       "--log-level", "warning") as (proc, base):
        client = OpenAI(base_url=base + "/v1", api_key="sk-cli", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-cli"]
        r = client.completions.create(model="tiny-cli", prompt="t5 t6", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and len(r.choices[0].text.split()) == 4
        assert httpx.post(base + "/v1/completions", json={"prompt": "t5"}).status_code == 401
        # SIGTERM drains: the in-flight stream still finishes; what --drain-timeout (1 s) cannot
        # finish (48 requests of 480 tokens queued behind it, one at a time: more than any machine
        # decodes in the drain, and both kinds are among those cut) ends cleanly: a 503 JSON body,
        # or an error event and [DONE] on a stream; then the server exits 0.
        headers = {"Authorization": "Bearer sk-cli"}
        body = {"prompt": "t5 t6", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
        long = {"prompt": "t7 t8", "max_tokens": 480, "ignore_eos": True}
        n = 48
        with ThreadPoolExecutor(n) as pool, \
                httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=30) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: {")
            futures = [pool.submit(_drained, base, headers, {**long, "stream": i % 2 == 1}) for i in range(n)]
            deadline = time.monotonic() + 90  # 30 s was once too short at load average 9
            while _arrived(base) < n + 2:  # all n are in (with the 4-token request and the stream)
                assert time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
            ends = [f.result() for f in futures]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert "503" in ends and "error event" in ends, ends
        assert set(ends) <= {"503", "error event", "finished"}, ends
        assert proc.wait(timeout=30) == 0



def test_serve_engine_in_process(chat_model: Path) -> None:
    """``--engine-in-process``: the core runs as a thread of the server (no engine-core child
    process), answers what the offline engine answers, and SIGTERM still exits 0."""
    flags = ("--block-size", "4", "--num-kv-blocks", "64", "--max-model-len", "128")
    body = {"prompt": "t5 t6 t7", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with serve_process(str(chat_model), *flags, "--engine-in-process") as (proc, base):
        assert child_pids(proc.pid) == []  # the default starts the core as a child process
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(base + "/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    expected = LLM(model=str(chat_model), block_size=4, num_kv_blocks=64, max_model_len=128).generate(
        "t5 t6 t7", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == expected


def _arrived(base: str) -> float:
    """Requests the engine has seen: running, waiting, or finished."""
    text = httpx.get(base + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
                                   "pagedllm:request_success_total")))


def _drained(base: str, headers: dict[str, str], body: dict) -> str:
    """How a request ended during the drain: "finished", "503" (a JSON body saying the server is
    shutting down) or "error event" (a stream's last event before [DONE]); else what it got."""
    if not body["stream"]:
        r = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60)
        if r.status_code == 503:
            err = r.json()["error"]
            assert err["code"] == "server_shutting_down" and "request id cmpl-" in err["message"], err
            return "503"
        return "finished" if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}"
    events: list[str] = []
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=60) as s:
            events += [line for line in s.iter_lines() if line]
    except httpx.TransportError as e:
        return f"cut: {e!r}"
    if events[-1:] != ["data: [DONE]"]:
        return f"cut: {events[-2:]}"
    last = json.loads(events[-2][len("data: "):])
    if "error" in last:
        assert last["error"]["code"] == "server_shutting_down", last
        return "error event"
    return "finished" if last["choices"][0]["finish_reason"] else f"no finish: {last}"


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1, made by the openssl command line."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return key, cert


def test_serve_over_tls(chat_model: Path, tmp_path: Path) -> None:
    """--ssl-keyfile / --ssl-certfile: uvicorn serves HTTPS with them (the "listening on" line
    says https); plain HTTP gets no answer."""
    key, cert = _self_signed(tmp_path)
    flags = ("--block-size", "4", "--num-kv-blocks", "64", "--max-model-len", "128",
             "--engine-in-process", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    with serve_process(str(chat_model), *flags) as (_, base):
        assert base.startswith("https://127.0.0.1:")
        r = httpx.post(base + "/v1/completions", json={"prompt": "t5 t6", "max_tokens": 2},
                       verify=False, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        with pytest.raises(httpx.ConnectError):  # the certificate is nobody's: refused by default
            httpx.get(base + "/health", timeout=10)
        with pytest.raises(httpx.HTTPError):
            httpx.get(base.replace("https://", "http://") + "/health", timeout=10)


def test_tls_flags_are_checked_before_start(tmp_path: Path) -> None:
    from pagedllm.server.args import ServerArgs

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    cert.write_text("x")
    assert ServerArgs().ssl_config() == {}
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        ServerArgs(ssl_keyfile=str(key)).ssl_config()
    with pytest.raises(ValueError, match="--ssl-keyfile '.*key.pem' is not a file"):
        ServerArgs(ssl_keyfile=str(key), ssl_certfile=str(cert)).ssl_config()
    assert ServerArgs(ssl_certfile=str(cert), ssl_cert_reqs=2).ssl_config() == {
        "ssl_certfile": str(cert), "ssl_keyfile": None, "ssl_ca_certs": None, "ssl_cert_reqs": 2}
    _, serve = _serve_parser()
    ns = serve.parse_args(["--ssl-keyfile", "k", "--ssl-certfile", "c", "--ssl-ca-certs", "ca",
                           "--ssl-cert-reqs", "1"])
    args = ServerArgs.from_cli(ns)
    assert (args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs) == (
        "k", "c", "ca", 1)
