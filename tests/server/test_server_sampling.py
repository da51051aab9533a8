"""Sampling options through the real server: the mixed batch of tests/test_sampling_engine.py sent
as concurrent /v1/completions requests (top_k / min_p / repetition_penalty as vLLM's extra
fields), every token checked against the independent reference (tests/sampling_reference.py)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sampling_reference import CONFIGS, NUM_TOKENS, PROMPT, SEEDS, race_mismatch
from server_helpers import API_KEY, ServerThread

KEYS = [(name, s) for s in SEEDS for name in CONFIGS]


@pytest.fixture(scope="module")
def sampling_server(sampling_model: Path) -> Iterator[ServerThread]:
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import ServerLimits, build_app

    engine = LLMEngine.from_args(model=str(sampling_model), block_size=4, num_kv_blocks=256,
                                 max_model_len=64)
    with ServerThread(build_app(engine, model_name="tiny", api_key=API_KEY,
                                limits=ServerLimits())) as s:
        yield s


async def _completions(base_url: str) -> list[str]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as client:

        async def one(name: str, seed: int) -> str:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NUM_TOKENS, "seed": seed,
                    "ignore_eos": True, "skip_special_tokens": False, **CONFIGS[name]}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        return await asyncio.gather(*(one(name, s) for name, s in KEYS))


def test_mixed_batch_through_the_server_matches_the_reference(sampling_server: ServerThread,
                                                              sampling_hf: Any) -> None:
    texts = asyncio.run(_completions(sampling_server.base_url))
    assert len(texts) == len(KEYS)
    for (name, s), text in zip(KEYS, texts, strict=True):
        tokens = [int(t) for t in re.findall(r"\bt(\d+)\b", text)]  # word tokenizer: "t17" = 17
        assert len(tokens) == NUM_TOKENS, text
        step = race_mismatch(sampling_hf, CONFIGS[name], s, tokens)
        assert step is None, f"{name} {CONFIGS[name]}, seed {s}: token {step} is not the reference's"
    sampling_server.wait_idle()
