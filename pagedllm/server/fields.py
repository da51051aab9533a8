"""No silent ignoring: the request fields that are not plain sampling parameters.

``check_extras``: the fields a request model does not declare (``model_extra``) are refused with
a 400 naming them, except OpenAI's harmless no-ops (``HARMLESS``), the vLLM fields that change
nothing here, accepted with a warning (``WARNED``), and vLLM fields sent at their default value
(``AT_DEFAULT``).
``structured_outputs``: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and the older
``guided_*`` fields -> one ``StructuredOutputsParams`` and the field it came from (more than one
is a 400: which constraint would win is not the client's guess to make).
"""

from __future__ import annotations

from typing import Any

from pagedllm.logging_utils import init_logger
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.server.protocol import SamplingFields
from pagedllm.server.serving import APIError

# OpenAI fields that change nothing a client can observe here (accounting, storage, routing)
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier",
                      "prompt_cache_key", "prompt_cache_retention"})
# vLLM fields that change no output here, at any value: accepted, with a warning (once per field
# per process) that says why
WARNED = {
    "cache_salt": "one prefix cache serves every request here; a salt only isolates tenants",
    "kv_transfer_params": "this server does no KV transfer between instances",
    "mm_processor_kwargs": "the models served here are text-only",
    "vllm_xargs": "no custom sampling extensions read them",
    "session_id": "requests are not grouped by session",
}
_warned: set[str] = set()
logger = init_logger(__name__)
# vLLM fields pagedllm does not implement: accepted at their default value only
AT_DEFAULT: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
    "return_token_ids": False,
    "echo": False, "documents": None,
    "watermarking": None, "logprob_token_ids": None,
    "structural_tag": None, "reasoning_effort": None, "thinking_token_budget": None,
    "include_reasoning": True,
}
_HINTS = {
    "use_beam_search": "beam search runs offline only (LLM.beam_search)",
}
BACKENDS = (None, "auto", "guidance", "llguidance")


def check_extras(req: SamplingFields) -> None:
    """400 for any undeclared field but the accepted ones."""
    for name, value in (req.model_extra or {}).items():
        if name in HARMLESS:
            continue
        if name in WARNED:
            if name not in _warned:
                _warned.add(name)
                logger.warning("request field %s is accepted and has no effect: %s", name,
                               WARNED[name])
            continue
        if name in AT_DEFAULT:
            if value == AT_DEFAULT[name]:
                continue
            hint = _HINTS.get(name, f"only its default, {AT_DEFAULT[name]!r}, is accepted")
            raise APIError(400, f"{name}={value!r} is not supported by this server; {hint}",
                           param=name, code="unsupported_field")
        raise APIError(400, f"{name} is not a field this server supports; remove it",
                       param=name, code="unsupported_field")


def structured_outputs(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's output constraint, the field it came from), or (None, None)."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            js = rf.json_schema
            if js is None or js.schema_ is None:
                raise APIError(400, "response_format of type 'json_schema' needs "
                               "json_schema.schema", param="response_format")
            found.append(("response_format", {"json": js.schema_}))
    if req.structured_outputs is not None:
        so = req.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
        found.append(("structured_outputs", so))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if req.guided_whitespace_pattern is not None:
        if not found or found[-1][0] != "guided_json" or len(found) > 1:
            raise APIError(400, "guided_whitespace_pattern applies to guided_json alone",
                           param="guided_whitespace_pattern")
        found[-1][1]["whitespace_pattern"] = req.guided_whitespace_pattern
    if req.guided_decoding_backend not in BACKENDS:
        raise APIError(400, f"guided_decoding_backend={req.guided_decoding_backend!r}: this "
                       "server's structured outputs are llguidance's; send 'guidance' or omit it",
                       param="guided_decoding_backend")
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(400, f"{found[0][0]} and {found[1][0]} both constrain the output; send one",
                       param=found[1][0])
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), field
    except (TypeError, ValueError) as e:
        msg = str(e).replace("structured_outputs", field, 1) if field != "structured_outputs" else str(e)
        raise APIError(400, msg, param=field) from None
