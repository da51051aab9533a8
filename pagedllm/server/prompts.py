"""Prompt sources for the OpenAI app: a completion prompt (text, ids, or a batch of them) or a
chat conversation becomes functions run on the engine client's tokenizer thread, which tokenize
(the tokenizer stays single-threaded, the event loop free) and check the prompt against
--max-prompt-tokens and the context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.chat import render_chat
from pagedllm.engine import PromptType
from pagedllm.engine.client import FrontEnd, PromptSource
from pagedllm.server.serving import APIError, FieldError, ServerState


@dataclass(frozen=True)
class Budget:
    """The request's explicit output budget and the field that set it (checked against the
    context once the prompt's length is known)."""

    max_tokens: int | None
    field: str = "max_tokens"
    truncate: int | None = None  # truncate_prompt_tokens: only the prompt's last k tokens run

    def cut(self, ids: list[int]) -> list[int]:
        return ids if self.truncate is None else ids[-self.truncate:]


def _check_prompt(srv: ServerState, ids: list[int], param: str, budget: Budget) -> None:
    """On the tokenizer thread, once the prompt's length is known: --max-prompt-tokens, and the
    prompt plus an explicit max_tokens must fit the context (vLLM's message)."""
    lim = srv.limits.max_prompt_tokens
    if lim is not None and len(ids) > lim:
        raise ValueError(f"{param} has {len(ids)} tokens; this server accepts at most {lim} "
                         f"(--max-prompt-tokens)")
    total = len(ids) + (budget.max_tokens or 0)
    if budget.max_tokens is not None and total > srv.max_model_len:
        raise FieldError(
            f"This model's maximum context length is {srv.max_model_len} tokens. However, you "
            f"requested {budget.max_tokens} output tokens and your prompt contains {len(ids)} "
            f"input tokens, for a total of {total} tokens. Please reduce the length of the "
            f"input prompt or the number of requested output tokens.", budget.field)


def completion_prompts(srv: ServerState, prompt: str | list[str] | list[int] | list[list[int]],
                        budget: Budget) -> tuple[list[str], list[PromptSource]]:
    """(texts for echo, prompt sources). Strings are tokenized on the tokenizer thread."""
    items: list[str | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    elif all(isinstance(p, int) for p in prompt):
        items = [prompt]  # type: ignore[list-item]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if len(items) > srv.limits.max_prompts:
        raise APIError(400, f"{len(items)} prompts in one request; the limit is {srv.limits.max_prompts}",
                       param="prompt")
    texts, sources = [], []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
            sources.append(_text_prompt(srv, item, budget))
        else:
            texts.append("")
            sources.append(_ids_prompt(srv, list(item), budget))
    return texts, sources


def _text_prompt(srv: ServerState, text: str, budget: Budget) -> PromptSource:
    def prepare(engine: FrontEnd) -> PromptType:
        ids = budget.cut(engine.tokenizer.encode(text))
        _check_prompt(srv, ids, "prompt", budget)
        return {"prompt_token_ids": ids}

    return prepare


def _ids_prompt(srv: ServerState, ids: list[int], budget: Budget) -> PromptSource:
    def prepare(engine: FrontEnd) -> PromptType:
        kept = budget.cut(ids)
        _check_prompt(srv, kept, "prompt", budget)
        return {"prompt_token_ids": kept}

    return prepare


def chat_prompt(srv: ServerState, messages: list[dict[str, Any]], budget: Budget,
                 **render: Any) -> PromptSource:
    """``render``: ``pagedllm.chat.render_chat``'s keywords (tools, template, its kwargs)."""
    def prepare(engine: FrontEnd) -> PromptType:
        ids = budget.cut(render_chat(engine.tokenizer, messages, **render))
        _check_prompt(srv, ids, "messages", budget)
        return {"prompt_token_ids": ids}

    return prepare
