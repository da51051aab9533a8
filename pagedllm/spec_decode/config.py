"""SpeculativeConfig: what ``speculative_config`` (``LLM(speculative_config={...})``,
``--speculative-config JSON``) says, validated once and frozen. Pure Python.

Two methods, vLLM's keys:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"model": "/path/to/draft", "num_speculative_tokens": 4}        (method "draft_model")

A draft model has its own paged KV pool: ``draft_num_kv_blocks`` blocks of the target's block
size (default: as many blocks as the target's pool, so it holds as many tokens).

The adaptive rule's knobs (``pagedllm.spec_decode.adaptive``): ``disable_by_batch_size`` (no
proposals while more requests than this decode in a step; vLLM's name) and
``min_acceptance_rate`` over the last ``acceptance_window`` proposed tokens of a request (below
it the request stops proposing for ``backoff_steps`` steps, then tries again).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
_ALIASES = {"draft": "draft_model", "draft_model": "draft_model", "ngram": "ngram"}
DEFAULT_DISABLE_BY_BATCH_SIZE = 8  # where on/off crossed 1.0: README "Speculative decoding"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model's HF checkpoint directory
    draft_num_kv_blocks: int | None = None  # the draft's KV pool (None: the target's block count)
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    min_acceptance_rate: float = 0.2
    acceptance_window: int = 16
    backoff_steps: int = 16

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"speculative_config {name}={getattr(self, name)!r} is invalid; "
                              f"{allowed} (--speculative-config)")

        if self.method not in METHODS:
            raise bad("method", f"choose one of {', '.join(METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise bad("num_speculative_tokens", "must be an integer in [1, 64]")
        if not isinstance(self.prompt_lookup_min, int) or self.prompt_lookup_min < 1:
            raise bad("prompt_lookup_min", "must be an integer >= 1")
        if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
            raise bad("prompt_lookup_max", f"must be an integer >= prompt_lookup_min="
                      f"{self.prompt_lookup_min}")
        if self.method == "draft_model" and not self.model:
            raise bad("model", "the draft_model method needs the draft's checkpoint directory")
        if self.method == "ngram" and self.model is not None:
            raise bad("model", "the ngram method takes no model; drop it or use method draft_model")
        if self.draft_num_kv_blocks is not None and (
                self.method != "draft_model" or self.draft_num_kv_blocks < 1):
            raise bad("draft_num_kv_blocks", "must be >= 1, with a draft model")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise bad("disable_by_batch_size", "must be >= 1 or null (never disabled)")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise bad("min_acceptance_rate", "must be in [0, 1] (0: never back off)")
        if self.acceptance_window < 1 or self.backoff_steps < 0:
            raise ValueError("speculative_config acceptance_window must be >= 1 and "
                             "backoff_steps >= 0 (--speculative-config)")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A dict, a JSON string (the flag) or None (no speculation) -> the config. Unknown keys
        are an error naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON ({e}); e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        d = dict(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: "
                             f"{sorted(known)} (--speculative-config)")
        method = d.get("method")
        if method is None:
            d["method"] = "draft_model" if d.get("model") else "ngram"
        else:
            d["method"] = _ALIASES.get(str(method), str(method))
        return cls(**d)
