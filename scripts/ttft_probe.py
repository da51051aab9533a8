"""Where TTFT goes when N streamed requests arrive at once: each of N httpx streams (the
longtail workload of ``pagedllm bench serve``, seed 0, on the shipped model's tokenizer) records
when it was sent, when its response headers came and when its first token came.

    python scripts/ttft_probe.py http://127.0.0.1:8000 128      # against a running server
    python scripts/ttft_probe.py --trivial 8012 &                  # a server that answers at once
    python scripts/ttft_probe.py http://127.0.0.1:8012 128      # = the client's own cost

pagedllm sends the headers once the engine core accepted the request, so headers - sent is the
intake (HTTP, validation, the core's acceptance) and first token - headers the first step."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parents[1] / "pagedllm" / "assets" / "default_model"


async def probe(url: str, n: int) -> None:
    import httpx

    from pagedllm.bench.workload import build_workload

    _, reqs, _ = build_workload({"model": str(MODEL)}, {"kind": "longtail", "num_prompts": n,
                                                        "seed": 0})
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n)) as c:
        t0 = time.perf_counter()

        async def one(r: object) -> tuple[float, float, float]:
            body = {"model": None, "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens,  # type: ignore[attr-defined]
                    "temperature": 0, "stream": True, "ignore_eos": True}
            sent = time.perf_counter() - t0
            async with c.stream("POST", url + "/v1/completions", json=body) as resp:
                headers = time.perf_counter() - t0
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and '"text"' in line:
                        break
                return sent, headers, time.perf_counter() - t0

        res = await asyncio.gather(*(one(r) for r in reqs))

    def pct(xs: list[float]) -> list[int]:
        xs = sorted(xs)
        return [round(1e3 * xs[int(q * (len(xs) - 1))]) for q in (0, .1, .25, .5, .75, .9, 1)]

    print("ms since the first send, percentiles 0/10/25/50/75/90/100")
    for i, name in enumerate(("sent", "headers", "first token")):
        print(f"  {name:12s}", pct([r[i] for r in res]))


async def trivial(port: int) -> None:
    """An HTTP server that answers every POST at once with one streamed token."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await reader.read(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        size = next(int(x.split(b":")[1]) for x in head.split(b"\r\n")
                    if x.lower().startswith(b"content-length"))
        while len(body) < size:
            body += await reader.read(65536)
        msg = b'data: {"choices":[{"text":"x"}]}\n\n'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(msg), msg))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if sys.argv[1] == "--trivial":
        asyncio.run(trivial(int(sys.argv[2])))
    else:
        asyncio.run(probe(sys.argv[1].rstrip("/"), int(sys.argv[2])))
