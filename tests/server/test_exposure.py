"""What the server shows of itself: the docs pages need the API key (or are switched off with
--disable-fastapi-docs) while /health and /metrics stay open for probes and scrapers; the shipped
model is served as ``default_model``, never by its path on this machine."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient
from server_helpers import API_KEY, ServerThread

from pagedllm.config import default_model_path

AUTH = {"Authorization": f"Bearer {API_KEY}"}
DOCS = ("/docs", "/redoc", "/openapi.json")


def test_docs_need_the_key_and_health_and_metrics_stay_open(server: ServerThread) -> None:
    for path in DOCS:
        r = httpx.get(server.base_url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert httpx.get(server.base_url + path, headers=AUTH).status_code == 200, path
    assert "/v1/completions" in httpx.get(server.base_url + "/openapi.json", headers=AUTH).json()["paths"]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_disable_fastapi_docs_removes_the_pages(server: ServerThread) -> None:
    from pagedllm.server.api import build_app

    app = build_app(server.app.state.engine, model_name="tiny", disable_docs=True)
    client = TestClient(app)  # no lifespan: these routes never reach the engine
    for path in DOCS:
        assert client.get(path).status_code == 404, path
    open_app = TestClient(build_app(server.app.state.engine, model_name="tiny"))  # no key: open
    assert all(open_app.get(path).status_code == 200 for path in DOCS)


def test_the_shipped_model_is_served_as_default_model() -> None:
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import build_app

    engine = LLMEngine.from_args(block_size=16, num_kv_blocks=64, max_model_len=256)
    with ServerThread(build_app(engine)) as s:
        assert [m["id"] for m in httpx.get(s.base_url + "/v1/models").json()["data"]] == ["default_model"]
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "def", "model": "llama"})
        assert r.status_code == 404 and "'default_model'" in r.json()["error"]["message"]
        ok = httpx.post(s.base_url + "/v1/completions",
                        json={"prompt": "def", "model": "default_model", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["model"] == "default_model"
        metrics = httpx.get(s.base_url + "/metrics").text
        assert 'model_name="default_model"' in metrics
        for text in (r.text, ok.text, metrics, httpx.get(s.base_url + "/v1/models").text):
            assert default_model_path() not in text and "assets" not in text
