"""Chat prompts: messages -> token ids through a Jinja chat template (the tokenizer's, or one
given as a file or a string), shared by ``LLM.chat`` and the server."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

# apply_chat_template arguments a caller's chat_template_kwargs may not replace
_RESERVED = frozenset({"conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                       "continue_final_message", "chat_template", "return_dict", "return_tensors"})
BOTH_PROMPTS = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


def load_chat_template(value: str | None, flag: str = "--chat-template") -> str | None:
    """A template given as a file path or as the Jinja text itself."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value)
    if path.is_file():
        return path.read_text()
    raise ValueError(f"{flag} {value!r} is neither a file nor a Jinja template "
                     "(a template holds '{{' or '{%')")


def check_chat_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    extra = dict(kwargs or {})
    bad = sorted(_RESERVED & set(extra))
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}")
    return extra


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None,
                chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None,
                add_special_tokens: bool = False) -> list[int]:
    """The prompt's token ids. ``ValueError`` names what is wrong (no template, a reserved
    ``chat_template_kwargs`` key, a template that rejects the messages).
    ``add_special_tokens``: the tokenizer's own (BOS, ...) around the rendered text as well; off
    by default, as the template writes them (vLLM's default for chat).
    ``continue_final_message``: the prompt ends inside the last message (no end-of-turn after it,
    no generation prompt), so the model continues it (vLLM's; transformers' rendering); it needs
    ``add_generation_prompt=False``."""
    if continue_final_message and add_generation_prompt:
        raise ValueError(BOTH_PROMPTS)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat_template; pass chat_template "
                         "(--chat-template FILE|TEMPLATE) or send plain prompts (/v1/completions)")
    extra = check_chat_template_kwargs(chat_template_kwargs)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=cast(Any, tools), chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **extra)
    except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception) are bad input
        raise ValueError(f"the chat template rejected these messages: {e}") from None
    return list(tokenizer.encode(cast(str, text), add_special_tokens=add_special_tokens))
