"""Input processing: a prompt becomes token ids (tokenized, checked against the vocabulary), a
request's parameters are checked against the vocabulary and the context, and a request becomes
its ``n`` child sequences. Touches no engine state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagedllm.checks import check_text, check_token_ids
from pagedllm.config import EngineConfig
from pagedllm.lora.request import LoRARequest
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
            check_text("prompt", prompt)
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
        check_token_ids("prompt_token_ids", ids, self.config.model.vocab_size)
        return None, list(ids)

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """What ``SamplingParams`` cannot know alone: its token ids must be in the vocabulary and
        its min_tokens must fit what max_model_len leaves after the prompt. Raises ValueError."""
        for name, ids in params.token_id_fields().items():
            check_token_ids(name, ids, self.config.model.vocab_size)
        max_len = self.config.scheduler.max_model_len
        room = max_len - num_prompt_tokens
        if params.min_tokens > room:
            raise ValueError(f"min_tokens={params.min_tokens} is more than the {room} tokens "
                             f"max_model_len={max_len} leaves after a prompt of {num_prompt_tokens}; "
                             f"lower min_tokens or shorten the prompt")

    def check_logprobs(self, params: SamplingParams) -> None:
        """A request may ask for at most ``max_logprobs`` logprobs (vLLM's limit, default 20)."""
        cap = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > cap:
                raise ValueError(f"{name}={k} exceeds max_logprobs={cap}; ask for fewer or raise "
                                 f"LLM(max_logprobs=...) / --max-logprobs (-1: the vocabulary)")

    def check_request(self, req: Request) -> ValueError | None:
        """Re-validate a live request (its tokens and parameters as they are now); the error that
        admission would raise for it, or None."""
        try:
            check_token_ids("token_ids", req.token_ids, self.config.model.vocab_size)
            req.params.clone()  # runs SamplingParams' own checks
            self.check_params(req.params, req.num_prompt_tokens)
        except ValueError as e:
            return e
        return None

    def bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """``SamplingParams.bad_words`` as token sequences, as vLLM tokenizes them: each word
        alone (it may start the output) and after a space (mid-text), the latter kept only where
        the space makes a different first token of as many tokens. Raises ValueError for ids
        outside the model's vocabulary."""
        out: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not alone:
                raise ValueError(f"bad_words entry {word!r} encodes to no token of this model's "
                                 "tokenizer; remove it")
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        check_token_ids("bad_words", [t for w in out for t in w], self.config.model.vocab_size)
        return tuple(dict.fromkeys(out))

    def fan_out(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                priority: int, arrival: float,
                lora_request: LoRARequest | None = None) -> list[Request]:
        """The ``n`` sequences of one request: ``request_id`` itself for n=1, else
        ``request_id#i`` with seed + i. Raises ValueError if n cannot run at once."""
        limit = self.config.scheduler.max_num_seqs
        if params.n > limit:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={limit}: the n sequences of a "
                             f"request run together; lower n or raise --max-num-seqs")
        bad_words = self.bad_words_token_ids(params.bad_words or [])
        children = []
        for i in range(params.n):
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params, child_id = params.clone(n=1, seed=seed), f"{request_id}#{i}"
            else:  # a copy: the caller's later edits to its params change nothing here
                child_params, child_id = params.clone(), request_id
            children.append(Request(
                request_id=child_id, prompt_token_ids=prompt_ids, params=child_params,
                eos_token_ids=self.eos_token_ids, max_model_len=self.config.scheduler.max_model_len,
                priority=priority, arrival_time=arrival, lora_request=lora_request,
                bad_words_token_ids=bad_words,
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
