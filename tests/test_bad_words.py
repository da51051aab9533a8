"""``SamplingParams.bad_words`` (vLLM's): token sequences the output never contains. Greedy
outputs are compared with HF's greedy decoding with the same rule applied to HF's logits (the last
token of a word is -inf wherever the output so far ends with the word's other tokens): the ban
changes exactly the tokens it must, and a request without bad words in the same batch is
unchanged.

The tiny models' word-level tokenizer maps "t17" <-> 17, so "t5 t9" is the two-token word (5, 9)
(but see ``_words``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.decoder import can_speculate

PROMPT = [1, 17, 5, 233, 42, 9]
N = 16


def _hf_greedy(hf: Any, bad: list[tuple[int, ...]]) -> list[int]:
    ids, out = list(PROMPT), []
    for _ in range(N):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        for w in bad:
            if len(w) - 1 <= len(out) and tuple(out[len(out) - len(w) + 1:]) == w[:-1]:
                logits[w[-1]] = float("-inf")
        ids.append(int(logits.argmax()))
        out.append(ids[-1])
    return out


def _contains(seq: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(word)]) == word for i in range(len(seq) - len(word) + 1))


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(model=str(tiny_models["llama"]), block_size=4, max_model_len=64, num_kv_blocks=128)


def _generate(llm: LLM, *bad_words: list[str] | None) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, bad_words=b)
              for b in bad_words]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _words(llm: LLM, plain: list[int], size: int) -> tuple[str, tuple[int, ...]]:
    """A word of ``size`` tokens that greedy decoding produces, and its ids. Not every id's text
    encodes back to it alone ("t307" is the special "t3" then "07"), so the word is picked where
    its text tokenizes to exactly those ids."""
    tok = llm.get_tokenizer()
    for i in range(len(plain) - size + 1):
        ids = tuple(plain[i:i + size])
        text = " ".join(f"t{t}" for t in ids)
        if tuple(tok.encode(text, add_special_tokens=False)) == ids:
            return text, ids
    raise AssertionError(f"no {size}-token word in {plain}")


def test_bad_words_are_never_generated_and_nothing_else_changes(llm: LLM, hf_llama: Any) -> None:
    (plain,) = _generate(llm, None)
    assert plain == _hf_greedy(hf_llama, [])
    # a token greedy decoding produces; a pair it produces (banned only right after its first)
    words = [_words(llm, plain, 1), _words(llm, plain, 2)]
    got = _generate(llm, *[[text] for text, _ in words], None)  # the plain one in the same batch
    for (text, word), tokens in zip(words, got):
        assert tokens == _hf_greedy(hf_llama, [word]), text
        assert not _contains(tokens, word) and tokens != plain
    assert got[2] == plain
    llm.engine.check_integrity()


def test_bad_words_with_n_and_sampling(llm: LLM) -> None:
    (plain,) = _generate(llm, None)
    tok = llm.get_tokenizer()
    banned = sorted({t for t in plain if tok.encode(f"t{t}", add_special_tokens=False) == [t]})
    assert len(banned) >= 3
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=N, ignore_eos=True,
                            bad_words=[f"t{t}" for t in banned])
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert all(not set(c.token_ids) & set(banned) for c in out.outputs)


@pytest.mark.parametrize("bad", [[""], ["  "], "t5", [5], ["t5", None]])
def test_bad_words_must_be_a_list_of_words(bad: Any) -> None:
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=bad)


def test_a_word_is_banned_alone_and_after_a_space(bpe_model: Path) -> None:
    """With a byte-level BPE tokenizer "hello" and " hello" are different tokens: both are
    banned (vLLM's rule), each as all the ids the tokenizer splits it into."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_model)
    llm = LLM(model=str(bpe_model), block_size=4, max_model_len=64, num_kv_blocks=64)
    got = llm.engine.input.bad_words_token_ids(["hello", "  paged cache"])
    alone = tuple(tok.encode("hello", add_special_tokens=False))
    spaced = tuple(tok.encode(" hello", add_special_tokens=False))
    assert alone != spaced and alone in got and spaced in got
    assert tuple(tok.encode("paged cache", add_special_tokens=False)) in got  # lstripped
    assert any(len(w) > 1 for w in got)


def test_bad_words_under_speculative_decoding(tiny_models: dict[str, Path], llm: LLM,
                                              hf_llama: Any) -> None:
    """A request with bad words never speculates (a word's ban at one proposal depends on the
    ones before it); its tokens are the reference's beside requests that do."""
    (plain,) = _generate(llm, None)
    text, word = _words(llm, plain, 2)
    spec = LLM(model=str(tiny_models["llama"]), block_size=4, max_model_len=64, num_kv_blocks=128,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    got = _generate(spec, [text], None)
    assert got == [_hf_greedy(hf_llama, [word]), plain]
    assert spec.engine.core.spec is not None and spec.engine.core.spec.total.num_drafts > 0
    spec.engine.check_integrity()
    req = spec.engine.input.fan_out("r", PROMPT, SamplingParams(bad_words=[text]), 0, 0.0)[0]
    assert req.bad_words_token_ids == (word,) and not can_speculate(req)
