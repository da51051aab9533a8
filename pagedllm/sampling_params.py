"""Sampling parameters, vLLM-compatible names and defaults."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pagedllm.checks import lone_surrogate


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's names)."""

    CUMULATIVE = "cumulative"  # everything so far, every step the request produced a token
    DELTA = "delta"  # only the text, tokens and logprobs new since the request's last output
    FINAL_ONLY = "final_only"  # one output, when the request finishes


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): exactly one of

    - ``json``: a JSON schema (a dict or its JSON text); the output is one JSON value valid
      against it,
    - ``regex``: the output matches the regular expression (Rust ``regex`` syntax),
    - ``choice``: the output is one of these strings,
    - ``grammar``: a context-free grammar, GBNF/EBNF (``root ::= ...``) or Lark (``start: ...``),
    - ``json_object=True``: any JSON object.

    JSON is written compactly by default: no free whitespace, ``", "`` and ``": "`` between
    items (``disable_any_whitespace``: ``","`` and ``":"``; ``whitespace_pattern``: a regex for
    the whitespace allowed between tokens instead). Objects of a schema take no properties beyond
    the listed ones unless the schema says ``additionalProperties`` (OpenAI's strict mode), and
    numbers come out without exponents; see ``pagedllm.structured.grammar``.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [n for n in _CONSTRAINTS if getattr(self, n) not in (None, False)]
        if len(given) != 1:
            what = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)} "
                             f"({what})")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema: an object or its "
                             "JSON text")

    @property
    def kind(self) -> str:
        return next(n for n in _CONSTRAINTS if getattr(self, n) not in (None, False))

    def key(self) -> str:
        """A canonical text of the constraint and its options (the compiled-grammar cache key)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(self.json, str):
            try:
                d["json"] = json.loads(self.json)
            except ValueError:
                pass  # reported when compiled
        return json.dumps(d, sort_keys=True, default=str)


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ``ValueError`` naming the field and range.

    temperature 0 means greedy. top_k 0 or -1 disables top-k. logprobs=k returns, for every
    generated token, the k most likely tokens plus the chosen one (raw model log-probabilities,
    before penalties and temperature). prompt_logprobs=k does the same for prompt tokens (such
    requests bypass prefix-cache hits, since the logits of cached positions are not recomputed).
    ``output_kind``: see ``RequestOutputKind`` (``LLM.generate`` asks for FINAL_ONLY, the server
    for DELTA). ``structured_outputs``: constrain the output (``StructuredOutputsParams``).
    ``logit_bias``: token id -> a value in [-100, 100] added to its logit before sampling
    (OpenAI's semantics: -100 bans the token in practice, 100 all but forces it).
    ``allowed_token_ids``: only these tokens may be sampled.
    ``bad_words``: words the output may never contain as generated tokens (vLLM's): each word is
    tokenized at admission, alone and after a space, and the last token of a word's tokens is
    banned whenever the output so far ends with the others (a one-token word is always banned).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # a single str is accepted too
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        stop: object = self.stop
        self.stop = [stop] if isinstance(stop, str) else list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (not isinstance(ids, (list, tuple)) or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids (ints)")
            self.allowed_token_ids = sorted(set(ids))
        if self.bad_words is not None:
            words = self.bad_words
            if (not isinstance(words, (list, tuple))
                    or not all(isinstance(w, str) and w.strip() for w in words)):
                raise ValueError("bad_words must be a list of words (non-blank strings)")
            self.bad_words = list(words) or None
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is invalid; {allowed}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100] (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 disables top-k)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None (up to max_model_len)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):  # cap: max_logprobs
                raise bad(name, "must be None or an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        # generated text is valid Unicode: a stop string with a lone surrogate could never match
        for name in ("stop", "bad_words"):
            where = next((w for w in map(lone_surrogate, getattr(self, name) or ())
                          if w is not None), None)
            if where is not None:
                raise bad(name, f"contains a lone UTF-16 surrogate ({where}); send valid Unicode "
                                "text")

    def token_id_fields(self) -> dict[str, list[int]]:
        """The token ids this request carries, by field name; the engine checks every one against
        the vocabulary at admission (a field that carries ids belongs here)."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias or ()),
                "allowed_token_ids": self.allowed_token_ids or []}

    @property
    def masks_tokens(self) -> bool:
        """Whether sampling this request needs a per-row token mask or bias."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)  # type: ignore[arg-type]


LOGIT_BIAS_LIMIT = 100.0


def _logit_bias(bias: object) -> dict[int, float]:
    """{token id: bias}; keys may be ints or their decimal text (JSON object keys)."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be a mapping of token id -> bias")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            tid = int(k) if not isinstance(k, bool) else None
        except (TypeError, ValueError):
            tid = None
        if tid is None:
            raise ValueError(f"logit_bias key {k!r} is not a token id; keys are token ids")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT):
            raise ValueError(f"logit_bias[{k}]={v!r} is invalid; must be a number in "
                             f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        out[tid] = float(v)
    return out
