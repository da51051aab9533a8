"""OpenAI-compatible request and response models (pydantic 2).

Requests are validated in strict mode: ``"1"`` is not an integer and ``true`` is not a number, so
a wrong type is a 400 naming the field rather than a silent coercion. Nothing is silently ignored:
every field declared here is honoured, and the top-level request models keep the fields they do
not declare (``model_extra``) for ``server.fields`` to judge: a few harmless OpenAI no-ops
(``user``, ``metadata``, ...) and vLLM fields sent at their default are accepted, anything else
is a 400 naming it. Nested models forbid unknown fields outright. Range checks live in
``SamplingParams`` (one place, one message per field); the few checks here are the ones
``SamplingParams`` cannot know about (types, shapes, sizes of lists).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedllm.server.strict import StrictModel

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_BAD_WORDS = 256  # each checked at every sampled token of the request


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks; none is sent here


class JsonSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(StrictModel):
    """vLLM's ``structured_outputs`` request field (``pagedllm.StructuredOutputsParams``)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class SamplingFields(StrictModel):
    """Fields shared by completions and chat completions (OpenAI names plus vLLM extras)."""

    model_config = ConfigDict(strict=True, extra="allow")  # judged by server.fields

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras (the openai client sends them through ``extra_body``)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # keep the prompt's last k
    request_id: str | None = Field(default=None, min_length=1, max_length=256)  # the response's id
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:<id>"
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(v) > 64:
            raise ValueError("at most 64 stop_token_ids are allowed")
        return v


PromptInput = str | list[str] | list[int] | list[list[int]]
_HAIKU: Any = [{"role": "user", "content": "Write a haiku about memory."}]  # the docs' example


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [  # the document's (/docs) examples
        {"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0},
        {"prompt": ["Once upon a time", "The KV cache"], "max_tokens": 16, "n": 2, "seed": 1,
         "stream": True, "stream_options": {"include_usage": True}, "logprobs": 2}]})

    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(StrictModel):
    type: str
    text: str | None = None


class FunctionDef(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    # undeclared keys are judged by server.tools.messages_for_template (clients replaying a
    # response message send its null fields: refusal, audio, ...)
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise ValueError(f"content part of type {p.type!r} is not supported; send text parts")
            parts.append(p.text)
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": _HAIKU, "max_tokens": 32},
        {"messages": _HAIKU, "max_completion_tokens": 16, "n": 2, "stream": True,
         "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"}}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the last message (needs the above off)
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(StrictModel):
    """``/tokenize``: either ``prompt`` (completions) or ``messages`` (chat), as vLLM takes them."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "def fibonacci(n):", "return_token_strs": True},
        {"messages": _HAIKU, "add_special_tokens": True}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [5, 6, 7]}]})

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


# -- responses ---------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape of one prompt position's entry (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's path (vLLM's)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """An error's text is escaped where it is not valid Unicode (a lone surrogate from a JSON
    ``\\ud800`` escape, echoed from the request): an error path must never fail to encode."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None

    @field_validator("message", "type", "param", "code")
    @classmethod
    def _escape(cls, v: str | None) -> str | None:
        return None if v is None else v.encode("utf-8", "backslashreplace").decode("utf-8")


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    """``degraded``: fewer engine replicas than at start (``detail`` says which are down)."""

    status: Literal["ok", "degraded"]
    detail: str | None = None


class VersionResponse(BaseModel):
    version: str
