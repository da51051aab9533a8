"""A tiny OpenAI-style streaming server for testing ``bench serve`` without the real one.

``POST /v1/completions`` with ``stream: true`` answers ``max_tokens`` SSE chunks (one token
each, ``delay_s`` apart), a usage chunk, then ``data: [DONE]``; ``GET /v1/models`` lists one
model. HTTP/1.0 framing: the body ends when the connection closes.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    delay_s = 0.001
    model = "fake-model"

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        if self.path != "/v1/models":
            self.send_error(404)
            return
        body = json.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_POST(self) -> None:  # noqa: N802
        n = int(self.headers.get("Content-Length", 0))
        req = json.loads(self.rfile.read(n))
        if self.path != "/v1/completions" or not req.get("stream") or req.get("model") != self.model:
            self.send_error(400)
            return
        prompt = req["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(int(req["max_tokens"])):
            time.sleep(self.delay_s)
            chunk = {"id": "c", "object": "text_completion", "model": self.model,
                     "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": n_prompt, "completion_tokens": int(req["max_tokens"]),
                 "total_tokens": n_prompt + int(req["max_tokens"])}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


class FakeServer:
    def __init__(self) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
