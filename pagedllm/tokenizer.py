"""Tokenizer loading and incremental detokenization."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

Decode = Callable[[list[int], bool], str]  # (token ids, skip_special_tokens) -> text
_decoders: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, Decode] = weakref.WeakKeyDictionary()


def get_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """``AutoTokenizer`` on a local directory; a tokenizer with its own code (``auto_map``) runs
    it only with ``trust_remote_code``, as in transformers."""
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - re-raised with a clearer message
        hint = "" if trust_remote_code else " (one with its own code needs trust_remote_code=True)"
        raise ValueError(
            f"cannot load a tokenizer from {path!r} ({type(e).__name__}: {e}); the checkpoint "
            f"directory needs tokenizer.json or tokenizer.model + tokenizer_config.json{hint}"
        ) from e


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def decoder(tokenizer: PreTrainedTokenizerBase) -> Decode:
    """``tokenizer.decode`` as a function, cached per tokenizer. For a transformers fast
    tokenizer whose ``decode`` is the library's own and that asks for no clean-up of spaces, the Rust
    tokenizer's ``decode`` directly: the same text (``TokenizersBackend._decode`` calls exactly
    it) without transformers' per-call Python (argument conversion, dispatch; ~3x the cost of
    the decode itself on the short windows detokenization decodes every token)."""
    fn = _decoders.get(tokenizer)
    if fn is None:
        fn = _rust_decode(tokenizer) or (lambda ids, skip: str(tokenizer.decode(
            ids, skip_special_tokens=skip)))
        _decoders[tokenizer] = fn
    return fn


def _rust_decode(tok: PreTrainedTokenizerBase) -> Decode | None:
    rust = _rust_tokenizer(tok)
    if rust is None:
        return None
    return lambda ids, skip: str(rust.decode(ids, skip_special_tokens=skip))


def _rust_tokenizer(tok: PreTrainedTokenizerBase) -> Any:
    """The Rust tokenizer whose ``decode`` is exactly ``tok.decode``, or None."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers 4: its own decode path
        return None
    cls = type(tok)
    if (not isinstance(tok, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not TokenizersBackend._decode or tok.clean_up_tokenization_spaces):
        return None
    return tok._tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time.

    Byte-level BPE can split one character over several tokens; decoding a window
    ``ids[prefix_offset:]`` and emitting only what extends ``ids[prefix_offset:read_offset]``
    keeps multi-byte characters whole: text ending in U+FFFD (an incomplete UTF-8 sequence) is
    held back until the next token completes it.

    Where the tokenizer is a ``tokenizers`` one decoded by its Rust ``decode`` (``decoder``),
    the library's ``DecodeStream`` does the same per token in Rust (the same text; ~4x faster
    per token on the default model's tokenizer, ``tests/test_detokenizer.py``), primed with the
    same prompt context; a stream that fails falls back to the window for the rest.

    Stop strings are found here, since only text can match them; the output is trimmed at the
    stop string (kept when ``include_stop_str_in_output``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self._decode_fn = decoder(tokenizer)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-6:])  # a little context for spacing rules
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stopped_by: str | None = None
        self._held: tuple[int, int] = (0, 0)  # (len(text), holdback) when last computed
        self._rust = _rust_tokenizer(tokenizer)
        self._stream: Any = None
        if self._rust is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            self._stream_step(self.ids)  # the prompt's context; its text is not output

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, self.skip_special)

    def _stream_step(self, ids: list[int]) -> str | None:
        """The stream's text for ``ids``; None if it failed (the window takes over)."""
        out = []
        try:
            for t in ids:
                chunk = self._stream.step(self._rust, t)
                if chunk is not None:
                    out.append(chunk)
        except Exception:  # noqa: BLE001 - e.g. an id the tokenizer does not know
            self._stream = None
            return None
        return "".join(out)

    def add_tokens(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly readable text (may be "")."""
        if self._stream is not None:
            delta = self._stream_step(new_ids)
            self.ids.extend(new_ids)
            if delta is not None:
                return self._emit(delta)
            # the window restarts after what the stream had read
            self.read_offset = len(self.ids) - len(new_ids)
            self.prefix_offset = max(0, self.read_offset - 6)
        else:
            self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return self._emit(delta)

    def _emit(self, delta: str) -> str:
        if not delta:
            return ""
        before = len(self.text)
        self.text += delta
        if self.stop:
            self._check_stop(len(delta))
        return self.text[before:]

    def _check_stop(self, new_chars: int) -> None:
        for s in self.stop:
            # A stop string may straddle the old text and the new characters.
            start = max(0, len(self.text) - new_chars - len(s) + 1)
            idx = self.text.find(s, start)
            if idx != -1:
                self.stopped_by = s
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                return

    def holdback(self) -> int:
        """Characters a streaming client should not see yet: they may begin a stop string.

        Called every step for every streaming sequence: computed once per new text, and only
        prefixes ending in the text's last character are compared."""
        if not self.stop or self.stopped_by is not None or not self.text:
            return 0
        if self._held[0] != len(self.text):
            last, keep = self.text[-1], 0
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text)), keep, -1):
                    if s[k - 1] == last and self.text.endswith(s[:k]):
                        keep = k
                        break
            self._held = (len(self.text), keep)
        return self._held[1]

def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat_template; use a completion prompt")
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
