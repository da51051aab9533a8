from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A byte-level BPE with few merges, so multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world def foo(): return bar"] * 10, trainer)
    path: Path = tmp_path_factory.mktemp("bytetok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def _stream(tok, ids: list[int], **kw) -> tuple[str, list[str]]:  # type: ignore[no-untyped-def]
    d = IncrementalDetokenizer(tok, [], **{"stop": [], **kw})
    pieces = [d.add_tokens([t]) for t in ids]
    return d.text, pieces


def test_multibyte_characters_split_across_tokens(byte_tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "héllo wörld ✓ 日本語 def foo(): return 🎉"
    ids = byte_tokenizer.encode(text)
    assert len(ids) > len(text) // 2
    full, pieces = _stream(byte_tokenizer, ids)
    assert full == text
    assert all("\ufffd" not in p for p in pieces)  # never emits half a character


def test_stop_string_trims_output(byte_tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = byte_tokenizer.encode("def foo(): return bar")
    d = IncrementalDetokenizer(byte_tokenizer, [], stop=["return"])
    for t in ids:
        d.add_tokens([t])
        if d.stopped_by:
            break
    assert d.stopped_by == "return" and d.text == "def foo(): "
    d2 = IncrementalDetokenizer(byte_tokenizer, [], stop=["return"], include_stop_str_in_output=True)
    for t in ids:
        d2.add_tokens([t])
        if d2.stopped_by:
            break
    assert d2.text == "def foo(): return"


def test_holdback_covers_a_possible_stop_prefix(byte_tokenizer) -> None:  # type: ignore[no-untyped-def]
    d = IncrementalDetokenizer(byte_tokenizer, [], stop=["world"])
    d.add_tokens(byte_tokenizer.encode("hello wor"))
    assert d.text.endswith("wor") and d.holdback() == 3


def test_fast_decoder_equals_the_tokenizers_decode(byte_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The detokenizer's decode (the Rust tokenizer's, where transformers would only wrap it) is
    ``tokenizer.decode``, special tokens skipped or not; a tokenizer that cleans up spaces keeps
    transformers' path (the clean-up changes the text)."""
    import random

    from transformers import AutoTokenizer

    from pagedllm.tokenizer import _rust_decode, decoder

    default = AutoTokenizer.from_pretrained(Path(__file__).parents[1] / "pagedllm/assets/default_model")
    cleaned = AutoTokenizer.from_pretrained(Path(__file__).parents[1] / "pagedllm/assets/default_model",
                                            clean_up_tokenization_spaces=True)
    assert _rust_decode(byte_tokenizer) is not None and _rust_decode(default) is not None
    assert _rust_decode(cleaned) is None
    rng = random.Random(0)
    for tok in (byte_tokenizer, default, cleaned):
        fn = decoder(tok)
        assert decoder(tok) is fn  # built once per tokenizer
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
            for skip in (True, False):
                assert fn(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_decode_stream_gives_the_windows_text(byte_tokenizer, tiny_models) -> None:  # type: ignore[no-untyped-def]
    """Where the tokenizer allows it, the detokenizer steps the library's DecodeStream; its text,
    piece by piece, is the window's (the path kept for the other tokenizers), after a prompt
    context, with multi-byte characters split over tokens, special tokens skipped or not."""
    import random

    from transformers import AutoTokenizer

    default = AutoTokenizer.from_pretrained(Path(__file__).parents[1] / "pagedllm/assets/default_model")
    words = AutoTokenizer.from_pretrained(tiny_models["llama"])
    text = "héllo wörld ✓ 日本語 def foo(): return 🎉 The quick brown fox."
    rng = random.Random(1)
    for tok in (byte_tokenizer, default, words):
        ids = tok.encode(text) if tok is not words else [rng.randrange(5, 60) for _ in range(40)]
        for skip in (True, False):
            for prompt in ([], ids[:5]):
                gen = ids[len(prompt):] + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
                stream = IncrementalDetokenizer(tok, prompt, [], skip_special_tokens=skip)
                window = IncrementalDetokenizer(tok, prompt, [], skip_special_tokens=skip)
                assert stream._stream is not None
                window._stream = None
                pieces = [(stream.add_tokens([t]), window.add_tokens([t])) for t in gen]
                assert stream.text == window.text, (tok, skip, prompt)
                assert "".join(p for p, _ in pieces) == stream.text
