"""Input processing: a prompt becomes token ids (tokenized, checked against the vocabulary), and
a request becomes its ``n`` child sequences. Touches no engine state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagedllm.config import EngineConfig
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids): text, ``{"prompt": text}``,
        ``{"prompt_token_ids": ids}`` or a list of ids. Raises ValueError for anything else or
        for ids outside the vocabulary."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        else:
            ids = prompt
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        vocab = self.config.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside [0, {vocab}): {bad[:5]}")
        return None, list(ids)

    def fan_out(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                priority: int, arrival: float) -> list[Request]:
        """The ``n`` sequences of one request: ``request_id`` itself for n=1, else
        ``request_id#i`` with seed + i. Raises ValueError if n cannot run at once."""
        limit = self.config.scheduler.max_num_seqs
        if params.n > limit:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={limit}: the n sequences of a "
                             f"request run together; lower n or raise --max-num-seqs")
        children = []
        for i in range(params.n):
            child_params, child_id = params, request_id
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params, child_id = params.clone(n=1, seed=seed), f"{request_id}#{i}"
            children.append(Request(
                request_id=child_id, prompt_token_ids=prompt_ids, params=child_params,
                eos_token_ids=self.eos_token_ids, max_model_len=self.config.scheduler.max_model_len,
                priority=priority, arrival_time=arrival,
            ))
        return children


def load_prompts(path: str) -> list[str | list[int]]:
    """One prompt per non-empty line: a JSON list of token ids, or text (JSON-quoted or raw)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"preheat_prompts={path!r} is not a file; pass a list of prompts or a "
                         "file with one prompt per line")
    out: list[str | list[int]] = []
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            v = json.loads(line)
        except json.JSONDecodeError:
            v = line
        out.append(v if isinstance(v, (list, str)) else line)
    return out
