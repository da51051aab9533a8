"""Helpers for the data-parallel tests: the shipped default model with a small KV pool, greedy
requests through any EngineClient, one engine's reference outputs, and the multi-tenant
shared-prefix workload (several system prompts x users)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from pagedllm import LLM
from pagedllm.args import EngineArgs
from pagedllm.engine.client import EngineClient, OutputStream
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

SETTINGS: dict[str, Any] = dict(num_kv_blocks=256, max_model_len=512, max_num_seqs=8)
SYSTEM = ("You are a careful assistant. Answer in one short sentence, plainly, and never repeat "
          "the question. ")
PROMPTS = [SYSTEM + q for q in ("What is a cat?", "Where is the sea?", "Why is the sky blue?",
                                "How do birds fly?", "What is bread made of?")] + [
    "Once upon a time there was a little dog who", "The river ran past the old mill and",
    SYSTEM + "Tell me about the moon and the stars and the night sky.",
]


def engine_args(**overrides: Any) -> EngineArgs:
    return EngineArgs.from_kwargs({**SETTINGS, **overrides}, "test")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)


def reference(prompts: list[Any], max_tokens: int) -> list[list[int]]:
    """One engine's greedy token ids (in-process, all prompts in one batch)."""
    llm = LLM(**SETTINGS)
    try:
        outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


async def generate(client: EngineClient, rid: str, prompt: Any, sp: SamplingParams,
                   seen: dict[str, int] | None = None) -> list[int]:
    """A request's token ids; ``seen[rid]`` counts the outputs its stream gave."""
    stream = OutputStream()
    await client.add_request(rid, prompt, sp, stream)
    ids: list[int] = []
    async for out in stream:
        ids += out.outputs[0].token_ids
        if seen is not None:
            seen[rid] = seen.get(rid, 0) + 1
    return ids


def tenant_workload(token_seed: int, tenants: int = 4, users: int = 6, system_len: int = 160,
                    user_len: int = 24, order_seed: int = 0) -> list[list[int]]:
    """``tenants`` system prompts x ``users`` questions each, as token ids, shuffled by
    ``order_seed``: two token seeds give the same structure in the same order with other
    tokens (so no cache carries over from one run to the next)."""
    rng = random.Random(token_seed)
    systems = [[rng.randrange(3, 4096) for _ in range(system_len)] for _ in range(tenants)]
    prompts = [s + [rng.randrange(3, 4096) for _ in range(user_len)]
               for s in systems for _ in range(users)]
    random.Random(order_seed).shuffle(prompts)
    return prompts


async def run_workload(client: EngineClient, prompts: list[list[int]], concurrency: int,
                       max_tokens: int, tag: str) -> list[list[int]]:
    """Every prompt, at most ``concurrency`` in flight, in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, p: list[int]) -> list[int]:
        async with gate:
            return await generate(client, f"{tag}-{i}", {"prompt_token_ids": p}, greedy(max_tokens))

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
