"""schemathesis (a third-party fuzzer, its own CLI) against a served ``/openapi.json``: its four
phases (the documented examples, a coverage of each schema's boundaries, random fuzzing, and
stateful sequences), schema-valid and schema-violating requests, to every operation of a real
server. Every check but one must pass: no 5xx; status codes, content types, bodies and headers as
documented; invalid data refused; 405s with ``Allow``; operations behind the key refuse requests
without it. Left out: ``positive_data_acceptance`` (the document gives types and shapes, while
ranges that depend on the server -- ``--max-n``, the context, the vocabulary -- are 400s the
document cannot know).

The server counts what it answered (a middleware added here). The default run fuzzes a bounded
number of examples per operation; ``-m slow`` adds the coverage phase (each schema's boundaries,
~1,400 requests) and fuzzes for 8 minutes. Each prints ``fuzzed N requests: K 5xx``
(the README's figures)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from server_helpers import API_KEY, ServerThread


class _Statuses:
    """ASGI middleware: counts the status of every HTTP response the app starts."""

    def __init__(self, app: Any, seen: Counter[int]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def count(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.seen[message["status"]] += 1
            await send(message)

        await self.app(scope, receive, count if scope["type"] == "http" else send)


def _fuzz(chat_model: Path, tmp_path: Path, max_examples: int, max_time: int | None,
          phases: str) -> None:
    """``max_time``: fuzz (repeating) for that long; None: ``max_examples`` per operation once."""
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import ServerLimits, build_app

    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe is not None, "schemathesis is not installed (pip install -e '.[dev]')"
    engine = LLMEngine.from_args(model=str(chat_model), block_size=4, num_kv_blocks=512,
                                 max_model_len=64, max_num_seqs=16)
    limits = ServerLimits(max_request_bytes=64 * 1024, max_n=4, max_prompts=4)
    app = build_app(engine, model_name="tiny", api_key=API_KEY, limits=limits)
    seen: Counter[int] = Counter()
    app.add_middleware(_Statuses, seen=seen)
    with ServerThread(app) as s:
        run = subprocess.run(
            [exe, "run", s.base_url + "/openapi.json", "-H", f"Authorization: Bearer {API_KEY}",
             "--exclude-checks", "positive_data_acceptance", "--max-examples", str(max_examples),
             "--seed", "35", "--workers", "1", "--output-sanitize", "false", "--request-timeout", "60", "--no-color",
             "--phases", phases,
             *(["--max-time", str(max_time)] if max_time else [])],
            capture_output=True, text=True, timeout=(max_time or 0) + 300, cwd=tmp_path)
        s.wait_idle()
    fuzzed = sum(seen.values()) - 1  # less the fuzzer's GET of /openapi.json
    fivexx = sum(n for code, n in seen.items() if code >= 500)
    print(f"\nfuzzed {fuzzed} requests: {fivexx} 5xx; statuses {dict(sorted(seen.items()))}")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert fivexx == 0 and fuzzed > 0


def test_fuzz_the_served_spec(chat_model: Path, tmp_path: Path) -> None:
    _fuzz(chat_model, tmp_path, max_examples=60, max_time=None, phases="examples,fuzzing")


@pytest.mark.slow
def test_fuzz_the_served_spec_long(chat_model: Path, tmp_path: Path) -> None:
    _fuzz(chat_model, tmp_path, max_examples=1000, max_time=480,
          phases="examples,coverage,fuzzing,stateful")


def test_the_served_document_describes_the_api(server: ServerThread) -> None:
    """Request bodies, 200 bodies and the error answers as components; /metrics as text; the
    key as a bearer scheme. (It listed 8 paths and 0 schemas.)"""
    import httpx

    doc = httpx.get(server.base_url + "/openapi.json",
                    headers={"Authorization": f"Bearer {API_KEY}"}).json()
    schemas = doc["components"]["schemas"]
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}

    def resolve(ref: dict[str, Any]) -> dict[str, Any]:
        return schemas[ref["$ref"].rsplit("/", 1)[1]]  # type: ignore[no-any-return]

    bodies = {"/v1/completions": "prompt", "/v1/chat/completions": "messages",
              "/tokenize": "prompt", "/detokenize": "tokens"}
    for path, field in bodies.items():
        op = doc["paths"][path]["post"]
        assert op["security"] == [{"bearer": []}]
        req = resolve(op["requestBody"]["content"]["application/json"]["schema"])
        assert field in req["properties"], (path, req)
        for status in ("400", "401", "404", "413", "415"):
            err = resolve(op["responses"][status]["content"]["application/json"]["schema"])
            assert resolve(err["properties"]["error"])["required"] == ["message", "type"]
        assert "properties" in resolve(op["responses"]["200"]["content"]["application/json"]["schema"])
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "ModelList" in schemas and "ChatCompletionResponse" in schemas
