"""Beam search runs above the engine core, in rounds of 1-token requests inside LLMEngine.step()
(``pagedllm.engine.beam``): its beams are bit-identical to those of the search that ran inside
the core, an elastic pool grows for it, the allocation trace records it like any step, it shares
the engine with other requests, and it aborts cleanly. (Beams and scores against HF
transformers: tests/test_memory_management.py; held KV: tests/test_holds.py.)"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams, kernels
from pagedllm._cpu import cpu_model
from pagedllm.engine.beam import KEEP_KV_S, BeamSearchDriver
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from pagedllm.kv.trace import load, replay


def _prompts(n: int, seed: int = 3) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(4, 512) for _ in range(rng.randrange(6, 30))]}
            for _ in range(n)]


def _llm(tiny_models: dict[str, Path], **kw: object) -> LLM:
    args: dict[str, object] = dict(block_size=4, num_kv_blocks=256, max_model_len=128)
    args.update(kw)
    return LLM(model=str(tiny_models["llama"]), **args)


def _beams(outs: list) -> list:  # type: ignore[type-arg]
    return [[(s.token_ids, s.cumulative_logprob, s.text) for s in o.sequences] for o in outs]


def _same(got: list, want: list) -> bool:  # type: ignore[type-arg]
    """Same beams in the same order with the same text; scores within 1e-5 (other batches sum
    the same logits in another order: ~1e-7 apart in float32)."""
    assert len(got) == len(want) and all(len(g) == len(w) for g, w in zip(got, want))
    return all(gt == wt and gx == wx and abs(gs - ws) < 1e-5
               for g, w in zip(got, want) for (gt, gs, gx), (wt, ws, wx) in zip(g, w))


@pytest.fixture(scope="module")
def roomy(tiny_models: dict[str, Path]) -> list:  # type: ignore[type-arg]
    return _beams(_llm(tiny_models).beam_search(_prompts(3), beam_width=4, max_tokens=8))


def test_beam_search_grows_an_elastic_pool(tiny_models: dict[str, Path], roomy: list) -> None:  # type: ignore[type-arg]
    llm = _llm(tiny_models, num_kv_blocks=200, initial_num_kv_blocks=4, grow_chunk=4)
    eng = llm.engine
    assert eng.kv.num_blocks == 4
    outs = llm.beam_search(_prompts(3), beam_width=4, max_tokens=8)
    assert _same(_beams(outs), roomy)
    assert all(len(o.sequences) == 4 for o in outs)
    assert eng.memory.num_grows > 0 and eng.memory.num_shrinks > 0
    assert eng.kv.num_blocks == 4 == eng.runner.kv_cache.num_blocks  # idle: back to the start
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_beam_search_is_traced_like_any_step(tiny_models: dict[str, Path], tmp_path: Path,
                                             roomy: list) -> None:  # type: ignore[type-arg]
    path = tmp_path / "kv.jsonl"
    llm = _llm(tiny_models, kv_trace_path=str(path))
    assert _same(_beams(llm.beam_search(_prompts(3), beam_width=4, max_tokens=8)), roomy)
    steps_taken = llm.engine.scheduler.num_steps
    llm.engine.shutdown()
    events = load(path)
    ops = Counter(e["op"] for e in events)
    assert ops["fork"] > 0 and ops["cow_copy"] > 0 and ops["free"] > 0
    steps = [e["step"] for e in events]
    assert steps == sorted(steps) and steps[-1] == steps_taken >= 8
    forks = {e["step"] for e in events if e["op"] == "fork"}
    assert len(forks) > 1  # beams fork at several steps, each stamped with its own step
    kv = replay(path)
    assert kv.num_free_blocks == kv.num_blocks == llm.engine.kv.num_blocks


def test_beam_search_beside_other_requests_and_abort(tiny_models: dict[str, Path],
                                                     roomy: list) -> None:  # type: ignore[type-arg]
    llm = _llm(tiny_models)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate("t5 t6 t7", sp, use_tqdm=False)[0].outputs[0].token_ids
    eng.add_request("other", "t5 t6 t7", sp)
    for _ in range(3):
        eng.step()
    # beam search no longer needs an idle engine; both share the steps
    assert _same(_beams(llm.beam_search(_prompts(3), beam_width=4, max_tokens=8)), roomy)
    done = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            done = out
    assert done is not None and done.request_id == "other" and done.outputs[0].token_ids == alone
    eng.add_beam_search("b", _prompts(1)[0], beam_width=3, max_tokens=20)
    eng.step()
    eng.step()
    assert eng.abort_request("b") and not eng.has_unfinished_requests()
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    with pytest.raises(ValueError, match="beam_width=21 must be in"):
        eng.add_beam_search("c", "t5", beam_width=21, max_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_model_len=128"):
        eng.add_beam_search("c", "t5", beam_width=2, max_tokens=200)
    assert not eng.has_unfinished_requests()


GOLDEN = Path(__file__).resolve().parent / "data" / "beam_search_golden.json"


def test_beam_search_is_bit_identical_to_the_in_core_search(tiny_models: dict[str, Path]) -> None:
    """Widths 1..20, token ids and scores as the search inside the engine core gave them
    (``scripts/beam_golden.py`` wrote the file before beam search moved above the core).

    The scores' bits are those of the CPU that wrote the file: the tiny model's forward rounds
    differently on another CPU (an Intel Xeon gives scores up to 5.7e-6 off an AMD EPYC's, every
    token the same). So the whole output is compared exactly where the file names this CPU and
    ISA (files written since it records them), and elsewhere the token ids exactly and the
    scores to a relative 1e-5: any change to what a score sums is larger than that."""
    want = json.loads(GOLDEN.read_text())
    exact = want.get("cpu") == cpu_model() and want.get("isa") == kernels.isa()
    llm = LLM(model=str(tiny_models["llama"]), **want["engine"])
    prompts = [{"prompt_token_ids": p} for p in want["prompts"]]
    for w, expected in want["widths"].items():
        outs = llm.beam_search(prompts, beam_width=int(w), max_tokens=want["max_tokens"])
        got = [[[s.token_ids, s.cumulative_logprob] for s in o.sequences] for o in outs]
        if exact:
            assert got == expected, f"beam_width={w}"
            continue
        assert [[t for t, _ in o] for o in got] == [[t for t, _ in o] for o in expected], w
        assert [[sc for _, sc in o] for o in got] == [
            [pytest.approx(sc, rel=1e-5) for _, sc in o] for o in expected], f"beam_width={w}"
    eng = llm.engine
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and not eng.scheduler.holds


def _round_done(rid: str, topk: list[tuple[int, float]]) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=rid, new_token_ids=[topk[0][0]], finish_reason="length",
                            new_logprobs=[TokenLogprobs(topk[0][1], 1, topk)])


def test_the_driver_holds_each_round_for_the_next_and_releases_every_hold() -> None:
    """The driver's messages alone (no core): keep_kv_s on every round but the last, fork_of the
    parent's round request, the previous round's holds released once the next is submitted, an
    abort ends live requests and holds, a failed round request ends its search."""
    sent: list[EngineCoreRequest] = []
    released: list[list[str]] = []
    d = BeamSearchDriver(sent.append, released.append)
    d.add("s", [1, 2, 3], width=2, max_tokens=3, arrival=0.0)
    (r0,) = sent
    assert (r0.request_id, r0.prompt_token_ids, r0.fork_of, r0.keep_kv_s) == ("s#r0b0", [1, 2, 3], None, KEEP_KV_S)
    assert r0.sampling_params.logprobs == 2 and r0.sampling_params.max_tokens == 1
    assert d.process([_round_done("s#r0b0", [(7, -0.5), (8, -1.0)])]) == []
    assert [(r.request_id, r.prompt_token_ids, r.fork_of) for r in sent[1:]] == [
        ("s#r1b0", [1, 2, 3, 7], "s#r0b0"), ("s#r1b1", [1, 2, 3, 8], "s#r0b0")]
    assert released == [["s#r0b0"]]
    # beam 1 (token 8) has both survivors: beam 0 is pruned, its hold released all the same
    assert d.process([_round_done("s#r1b0", [(5, -3.0), (6, -4.0)])]) == []
    assert d.process([_round_done("s#r1b1", [(5, -0.1), (6, -0.2)])]) == []
    last = sent[3:]
    assert [(r.prompt_token_ids[3:], r.fork_of, r.keep_kv_s) for r in last] == [
        ([8, 5], "s#r1b1", None), ([8, 6], "s#r1b1", None)]  # the last round holds nothing
    assert released[-1] == ["s#r1b0", "s#r1b1"]
    done = d.process([_round_done("s#r2b0", [(9, -0.1), (4, -0.3)]),
                      _round_done("s#r2b1", [(9, -0.4), (4, -0.5)])])
    assert done == [("s", [([8, 5, 9], -1.0 + -0.1 + -0.1), ([8, 5, 4], -1.0 + -0.1 + -0.3)],
                      "length")]
    assert not d.searches and not d.owns("s#r2b0")
    d.add("t", [1], width=2, max_tokens=4, arrival=0.0)
    d.process([_round_done("t#r0b0", [(7, -0.5), (8, -1.0)])])
    d.process([_round_done("t#r1b0", [(5, -3.0), (6, -4.0)])])  # held; t#r1b1 still runs
    assert d.abort("t") and released[-1] == ["t#r1b1", "t#r1b0"] and not d.abort("t")
    d.add("u", [1], width=2, max_tokens=4, arrival=0.0)
    failed = EngineCoreOutput(request_id="u#r0b0", error="failed")
    assert d.process([failed]) == [("u", [([], 0.0)], "failed")] and not d.searches
