"""vLLM's runtime LoRA endpoints (``--allow-runtime-lora-updating``, behind the API key):
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter
{"lora_name"}``. A bad adapter is a 400 naming it and the reason (the server keeps serving, the
engine unchanged); unloading a name not served is a 404. Success answers in vLLM's plain text."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from pagedllm.server.lora import AdapterNotFound, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedllm.server.openapi import REFUSALS, answers
from pagedllm.server.routes.common import AUTH, State
from pagedllm.server.serving import APIError, read_json, validate_body

router = APIRouter(prefix="/v1", dependencies=AUTH)


@router.post("/load_lora_adapter", responses=answers(None, *REFUSALS, 500, 503))
async def load_lora_adapter(request: Request, srv: State) -> PlainTextResponse:
    req = validate_body(LoadLoRAAdapterRequest,
                        await read_json(request, srv.limits.max_request_bytes))
    try:
        await srv.adapters.load(req.lora_name, req.lora_path)
    except ValueError as e:
        raise APIError(400, str(e), param="lora_path", code="invalid_lora_adapter") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/unload_lora_adapter", responses=answers(None, *REFUSALS, 500, 503))
async def unload_lora_adapter(request: Request, srv: State) -> PlainTextResponse:
    req = validate_body(UnloadLoRAAdapterRequest,
                        await read_json(request, srv.limits.max_request_bytes))
    try:
        await srv.adapters.unload(req.lora_name)
    except AdapterNotFound as e:
        raise APIError(404, str(e), param="lora_name", code="model_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
