"""Assertions shared by the engine tests: outputs compared token by token *and* by logprob, with
lengths checked first (``zip`` alone passes when the engine returns nothing)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


def chosen_logprobs(c: Any) -> list[float]:
    """Logprob of each generated token of a ``CompletionOutput`` (run with ``logprobs >= 0``)."""
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids), "no logprobs returned"
    return [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)]


def assert_same_completion(got: Any, want: Any, tol: float, what: str = "") -> float:
    """Same token ids (non-empty) and chosen-token logprobs within ``tol``; returns max |Δ|."""
    assert len(want.token_ids) > 0, f"{what}: the reference generated nothing"
    assert list(got.token_ids) == list(want.token_ids), f"{what}: tokens diverged"
    a, b = chosen_logprobs(got), chosen_logprobs(want)
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst < tol, f"{what}: a logprob moved by {worst:.3g} (tolerance {tol:g})"
    return worst


def assert_same_outputs(got: Sequence[Any], want: Sequence[Any], tol: float, what: str = "") -> float:
    """Two lists of ``CompletionOutput`` (one per request), compared pairwise; returns max |Δ|."""
    assert len(want) > 0, f"{what}: empty reference"
    assert len(got) == len(want), f"{what}: {len(got)} outputs for {len(want)} requests"
    return max(assert_same_completion(g, w, tol, f"{what} request {i}")
               for i, (g, w) in enumerate(zip(got, want)))


def audit_kv_moves(llm: Any) -> dict[str, int]:
    """Wrap the runner's block moves so that every block swapped back in is bit-identical to what
    was swapped out, and every device copy (copy-on-write, compaction) to its source as it was
    before the copy; returns live counts of the blocks checked."""
    import torch

    from pagedllm.attention.quant import raw

    cache = llm.engine.runner.kv_cache
    real_out, real_in, real_copy = cache.swap_out, cache.swap_in, cache.copy_blocks
    on_host: dict[int, list[torch.Tensor]] = {}
    counts = {"swapped_in": 0, "copied": 0}

    def block(b: int) -> list[torch.Tensor]:  # every plane (values and scales) of one block
        return [raw(p[:, :, b]).clone() for p in cache.planes]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    def swap_out(pairs: list[tuple[int, int]]) -> None:
        on_host.update({h: block(d) for d, h in pairs})
        real_out(pairs)

    def swap_in(pairs: list[tuple[int, int]]) -> None:
        real_in(pairs)
        for h, d in pairs:
            assert same(block(d), on_host.pop(h)), f"host block {h} came back changed in {d}"
            counts["swapped_in"] += 1

    def copy_blocks(pairs: list[tuple[int, int]]) -> None:
        before = {s: block(s) for s, _ in pairs}
        real_copy(pairs)
        for s, d in pairs:
            assert same(block(d), before[s]), f"block {d} is not a copy of block {s}"
            counts["copied"] += 1

    cache.swap_out, cache.swap_in, cache.copy_blocks = swap_out, swap_in, copy_blocks
    return counts


def hf_beams(model: Any, prompt: list[int], width: int, steps: int) -> tuple[list[list[int]], list[float]]:
    """HF ``generate`` beam search (no EOS, length_penalty 0: scores are summed logprobs, the
    engine's convention): the ``width`` generated sequences best first and their scores."""
    import torch

    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=width, num_return_sequences=width, do_sample=False,
                             length_penalty=0.0, max_new_tokens=steps, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    seqs = [s[len(prompt):].tolist() for s in ref.sequences]
    assert len(seqs) == width and all(len(s) == steps for s in seqs)
    return seqs, ref.sequences_scores.tolist()


# A beam's score is a sum of ``steps`` fp32 logprobs; measured max |Δ| against HF 8.8e-6 over 18
# beams (3 prompts x width 3 x 6 tokens, block sizes 4 and 16).
BEAM_SCORE_TOL = 5e-5


def assert_beams_match_hf(outs: Sequence[Any], model: Any, prompts: Sequence[list[int]], width: int,
                          steps: int) -> None:
    """``LLM.beam_search`` outputs: HF's sequences in HF's order, scores within BEAM_SCORE_TOL."""
    assert len(outs) == len(prompts) > 0
    for p, o in zip(prompts, outs, strict=True):
        seqs, scores = hf_beams(model, p, width, steps)
        assert [s.token_ids for s in o.sequences] == seqs
        for s, score in zip(o.sequences, scores, strict=True):
            assert abs(s.cumulative_logprob - score) < BEAM_SCORE_TOL, (s.cumulative_logprob, score)


def step_until_idle(engine: Any, prompts: Sequence[list[int]], params: Any,
                    after_step: Any = None, max_steps: int = 2000) -> dict[str, Any]:
    """Add ``prompts`` as q0, q1, ... (``params``: one SamplingParams or one per prompt) and step
    until idle, with ``check_integrity()`` and ``after_step(step_number)`` after every step;
    request id -> its finished outputs."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        engine.add_request(f"q{i}", {"prompt_token_ids": p}, sp)
    done: dict[str, Any] = {}
    for step in range(1, max_steps + 1):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs
        engine.check_integrity()
        if after_step is not None:
            after_step(step)
    assert not engine.has_unfinished_requests()
    return done


def repetitive_prompts(n: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """Prompts that repeat a random phrase (as code repeats names), with a random tail: the
    lookup finds matches, and the random model's continuation often leaves them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(4, vocab) for _ in range(rng.randrange(3, 9))]
        tail = [rng.randrange(4, vocab) for _ in range(rng.randrange(0, 6))]
        out.append(phrase * rng.randrange(2, 5) + tail)
    return out
