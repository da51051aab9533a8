"""The executor's input is plain data (issue #27): every step's ``ModelInput`` of a real engine run
(structured output, n-gram speculation, n > 1 forks, penalties, logprobs, prompt logprobs, token
constraints) round-trips through msgspec and through pickle without any live engine object, and
an engine whose runner runs only the decoded copies produces exactly the outputs of one that runs
the originals."""

from __future__ import annotations

import io
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_checks import step_until_idle
from structured_helpers import SMALL_SCHEMA

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.runner.model_input import ModelInput, decoder, encoder

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "min_acceptance_rate": 0.0, "disable_by_batch_size": None}
# the pagedllm classes a step's message may name; anything else (a Request, a scheduler) is a
# live engine object that cannot cross a process boundary
PLAIN = {("pagedllm.runner.model_input", "ModelInput"), ("pagedllm.runner.model_input", "SeqInput"),
         ("pagedllm.sched.output", "KVUpdate"), ("pagedllm.sampling_params", "SamplingParams"),
         ("pagedllm.sampling_params", "StructuredOutputsParams"),
         ("pagedllm.sampling_params", "RequestOutputKind"), ("pagedllm.structured.masks", "TokenMasks")}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """A repeated random phrase and a tail: the n-gram lookup finds matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(4, 4000) for _ in range(rng.randrange(3, 7))]
        out.append(phrase * rng.randrange(2, 4) + [rng.randrange(4, 4000)])
    return out


def _params() -> list[SamplingParams]:
    greedy: dict[str, Any] = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    return [
        SamplingParams(temperature=0.0, max_tokens=60,
                       structured_outputs=StructuredOutputsParams(json=SMALL_SCHEMA)),
        SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(**greedy),
        SamplingParams(**greedy, logprobs=0),
        SamplingParams(**greedy, frequency_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(**greedy, prompt_logprobs=2),
        SamplingParams(**greedy, logit_bias={5: 3.0}, allowed_token_ids=list(range(4, 400))),
    ]


class _PlainOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("pagedllm") and (module, name) not in PLAIN:
            raise AssertionError(f"the step's message holds a live {module}.{name}")
        return super().find_class(module, name)


def _assert_same(copy: ModelInput, step: ModelInput) -> None:
    assert copy.seqs == step.seqs and copy.kv == step.kv
    assert (copy.token_masks is None) == (step.token_masks is None)
    if step.token_masks is not None and copy.token_masks is not None:
        assert copy.token_masks.rows == step.token_masks.rows
        assert np.array_equal(copy.token_masks.bits(), step.token_masks.bits())


def _outputs(done: dict[str, Any]) -> dict[str, Any]:
    return {rid: [(list(c.token_ids), c.text, c.finish_reason,
                   None if c.logprobs is None else [{t: p.logprob for t, p in pos.items()}
                                                    for pos in c.logprobs]) for c in outs]
            for rid, outs in done.items()}


@pytest.fixture(scope="module")
def engine_kwargs(bpe_model: Path) -> dict[str, Any]:
    return {"model": str(bpe_model), "block_size": 4, "num_kv_blocks": 1024, "max_model_len": 128,
            "max_num_seqs": 16, "speculative_config": NGRAM}


def test_step_messages_round_trip_and_run_the_same(engine_kwargs: dict[str, Any]) -> None:
    prompts, params = _prompts(len(_params())), _params()
    want = _outputs(step_until_idle(LLM(**engine_kwargs).engine, prompts, params))

    engine = LLM(**engine_kwargs).engine
    run = engine.executor.execute
    enc, dec = encoder(), decoder()
    seen = {"spec": 0, "masks": 0, "forks": 0, "penalty": 0, "prompt": 0}

    def execute_copy(step: ModelInput) -> Any:
        copy = dec.decode(enc.encode(step))
        _assert_same(copy, step)
        _assert_same(_PlainOnly(io.BytesIO(pickle.dumps(step))).load(), step)
        seen["spec"] += any(s.spec_token_ids for s in step.seqs)
        seen["masks"] += step.token_masks is not None
        seen["forks"] += sum("#" in s.request_id for s in step.seqs) >= 2
        seen["penalty"] += any(s.output_token_ids is not None for s in step.seqs)
        seen["prompt"] += any(s.params.prompt_logprobs is not None for s in step.seqs)
        return run(copy)  # the runner sees only the decoded message

    engine.executor.execute = execute_copy  # type: ignore[method-assign]
    got = _outputs(step_until_idle(engine, prompts, params))
    assert got == want
    assert all(seen.values()), f"every feature must be in some step's message: {seen}"
    assert engine.kv_stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_live_object_fails_both_checks() -> None:
    """The checks above can fail: a message that holds a Request does not come back equal from
    the typed decoder, and the pickle allow-list refuses it."""
    from pagedllm.request import Request
    from pagedllm.runner.model_input import SeqInput

    live = Request("r", [1, 2], SamplingParams())
    row = SeqInput("r", [2], 1, [0], [], True, live, 2, 0, ())  # type: ignore[arg-type]
    step = ModelInput(seqs=[row])
    with pytest.raises(AssertionError):
        _assert_same(decoder().decode(encoder().encode(step)), step)
    with pytest.raises(AssertionError, match="live pagedllm.request.Request"):
        _PlainOnly(io.BytesIO(pickle.dumps(step))).load()
