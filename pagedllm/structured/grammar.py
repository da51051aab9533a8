"""Structured-output constraints -> llguidance grammars, validated and cached.

llguidance does the grammar work: JSON schemas, regexes, Lark and GBNF grammars become one
grammar text, and an ``LLMatcher`` over the engine's tokenizer walks it token by token, giving the
set of tokens allowed next as a bitmask (``pagedllm.structured.manager``).

Robust by default, for small models sampling at temperature 1 (a valid object well inside
max_tokens instead of whitespace or digits without end):

- no free whitespace in JSON: ``", "`` and ``": "`` between items, as Python's ``json.dumps``
  writes (``disable_any_whitespace``: ``","`` and ``":"``; ``whitespace_pattern``: that regex
  between tokens instead);
- length and range keywords (``maxLength``, ``maxItems``, ``minimum`` / ``maximum``,
  ``multipleOf``) are enforced by the grammar;
- the schema is tightened where JSON Schema leaves it open-ended, so every output still validates
  against the schema as given: an object with ``properties`` and no ``additionalProperties`` takes
  no other properties (OpenAI's strict mode; vLLM's xgrammar does the same), and a ``number`` with
  no ``multipleOf`` gets at most ``NUMBER_DECIMALS`` decimals (no exponent).
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance
    from transformers import PreTrainedTokenizerBase

NUMBER_DECIMALS = 6
NUMBER_STEP = float(f"1e-{NUMBER_DECIMALS}")  # multipleOf: at most NUMBER_DECIMALS decimals
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; ``field`` names the StructuredOutputsParams
    field, the message says what is wrong."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"structured_outputs.{field}: {problem}")
        self.field, self.problem = field, problem


def tighten_schema(schema: Any, additional_properties: bool = True) -> Any:
    """A copy of ``schema`` narrowed as the module docstring says (``additional_properties``
    False: even schemas that allow extra properties get none, vLLM's
    ``disable_additional_properties``)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        elif not additional_properties and ("object" in types or "properties" in node):
            node["additionalProperties"] = False
        if "number" in types and "multipleOf" not in node:
            node["multipleOf"] = NUMBER_STEP
        for key in _SCHEMA_MAPS:
            sub = node.get(key)
            if isinstance(sub, dict):
                for v in sub.values():
                    walk(v)
        for key in _SCHEMA_LISTS:
            sub = node.get(key)
            for v in sub if isinstance(sub, list) else [sub]:
                walk(v)

    walk(schema)
    return schema


# where a JSON schema holds subschemas: maps of name -> schema, and a schema or a list of them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf",
                 "not", "if", "then", "else", "contains")


def to_grammar(so: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a constraint (not yet checked against a tokenizer)."""
    from llguidance import LLMatcher, grammar_from

    kind = so.kind
    try:
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else so.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise GrammarError(kind, f"not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(kind, "a JSON schema is an object (or true / false)")
            if isinstance(schema, dict):
                schema = tighten_schema(schema, not so.disable_additional_properties)
            return str(LLMatcher.grammar_from_json_schema(schema, defaults=cast(Any, _json_options(so))))
        if kind == "regex":
            return str(LLMatcher.grammar_from_regex(so.regex or ""))
        if kind == "choice":
            assert so.choice is not None
            return str(LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in so.choice)))
        return str(grammar_from("grammar", so.grammar or ""))
    except GrammarError:
        raise
    except ValueError as e:
        raise GrammarError(kind, str(e)) from None


def _json_options(so: StructuredOutputsParams) -> dict[str, Any]:
    if so.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": so.whitespace_pattern,
                "item_separator": ",", "key_separator": ":"}
    if so.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Constraints -> checked grammars over one tokenizer, cached by the constraint's canonical
    text. Thread-safe: the server compiles off the engine thread, the engine hits the cache."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self._hf = tokenizer
        self._vocab = vocab_size
        self._eos = list(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance sees it (built on first use: tens of ms)."""
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self._hf, self._vocab, self._eos)
            return self._ll

    def compile(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the start of ``so``'s grammar. Raises GrammarError."""
        from llguidance import LLMatcher

        key = so.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return template.deep_copy()
        grammar = to_grammar(so)
        try:
            tok = self.ll_tokenizer
        except ValueError as e:  # a tokenizer llguidance cannot read: no request can use one
            raise GrammarError(so.kind, str(e)) from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            raise GrammarError(so.kind, messages[0].strip())
        template = LLMatcher(tok, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(so.kind, template.get_error().strip())
        with self._lock:
            self.misses += 1
            self._cache[key] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()


def _ll_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                  eos: list[int]) -> llguidance.LLTokenizer:
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(cast(Any, tokenizer), n_vocab=vocab_size, eos_token=eos or None)
    except ValueError as e:  # a slow (Python) tokenizer
        raise ValueError("this model's tokenizer cannot drive a grammar (structured outputs need "
                         f"a byte-level BPE or SentencePiece fast tokenizer; llguidance: {e})"
                         ) from None
