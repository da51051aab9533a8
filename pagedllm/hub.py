"""Models by Hugging Face id: a name that is not a local path but looks like ``org/name`` is
found in the local Hugging Face cache (``huggingface_hub.snapshot_download``), downloaded only
when ``HF_HUB_OFFLINE`` is not set. Checkpoint formats pagedllm cannot load (GGUF files,
``quantization_config``) are refused by name before any weight is read."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# what an engine reads from a snapshot: configs, tokenizer files, safetensors weights
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def resolve_model(model: str, flag: str = "model", revision: str | None = None,
                  cache_dir: str | None = None) -> str:
    """A local directory for ``model`` (a path, or a Hugging Face id at ``revision``, found in
    and downloaded to ``cache_dir``, default HF_HUB_CACHE). Raises ValueError naming the id and
    the cache it looked in."""
    if Path(model).exists() or not _REPO_ID.fullmatch(model):
        return model  # a path (or a name that is neither: ModelConfig says what is wrong)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = cache_dir or constants.HF_HUB_CACHE
    fetch = partial(snapshot_download, model, revision=revision, cache_dir=cache,
                    allow_patterns=_PATTERNS)
    what = f"{flag}={model!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        return str(fetch(local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"{what} is not a local directory and not in the Hugging Face "
                         f"cache {cache} (HF_HUB_OFFLINE is set); download it first "
                         f"(`hf download {model}`) or pass a checkpoint directory") from None
    try:
        return str(fetch())
    except Exception as e:  # noqa: BLE001 - no network, no such repo, gated: all say the same
        raise ValueError(f"{what} is not a local directory, not in the Hugging Face "
                         f"cache {cache}, and could not be downloaded ({type(e).__name__}: "
                         f"{str(e)[:200]})") from None


def check_checkpoint_format(model: str, cfg: dict[str, Any] | None) -> None:
    """Refuse a GGUF file and a quantized checkpoint with a message naming the format."""
    path = Path(model)
    gguf = path.suffix.lower() == ".gguf" or (path.is_dir() and cfg is None
                                             and any(path.glob("*.gguf")))
    if gguf:
        raise ValueError(f"model={model!r} is a GGUF checkpoint; pagedllm loads Hugging Face "
                         "safetensors checkpoints (config.json + *.safetensors) only")
    q = (cfg or {}).get("quantization_config")
    if q is not None:
        method = q.get("quant_method", "unknown") if isinstance(q, dict) else "unknown"
        raise ValueError(f"model={model!r} is a quantized checkpoint (quantization_config "
                         f"quant_method={method!r}); pagedllm loads unquantized float32 / "
                         "float16 / bfloat16 weights only (KV-cache quantization is "
                         "--kv-cache-dtype)")
