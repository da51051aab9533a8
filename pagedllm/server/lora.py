"""The LoRA adapters a server serves by name (``--enable-lora``; vLLM's API).

``--lora-modules NAME=PATH ...`` loads adapters at start-up, ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (with ``--allow-runtime-lora-updating``) while serving. A request's
``model: NAME`` runs adapter NAME: the engine core learns each adapter once, by the ``add_lora``
utility call (name, a fresh int id, path), and a request carries only the name
(``EngineCoreRequest.lora_id``). Every engine core (each data-parallel replica) gets the call.

Unloading an adapter while requests run it lets those requests finish with it; a request that
names it afterwards is a 404. A name is never reused for other weights under the same int id: each
load takes a fresh id, so the prefix cache (keyed by the id) never mixes two adapters.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from pagedllm.engine.client import EngineClient


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; ignored (the name says which)


class AdapterNotFound(LookupError):
    """A name that is no served adapter (a 404)."""


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    path: str
    int_id: int


def parse_lora_modules(specs: list[str] | str | None) -> dict[str, str]:
    """``--lora-modules NAME=PATH ...`` -> {name: path}; ValueError naming a malformed one."""
    out: dict[str, str] = {}
    for spec in specs.split() if isinstance(specs, str) else specs or []:
        name, eq, path = spec.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {spec!r}: give NAME=PATH")
        name = name.strip()
        if name in out:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out[name] = path.strip()
    return out


class ServedAdapters:
    """The adapters served, by name; every change goes through the engine client first."""

    def __init__(self, client: EngineClient, base_names: set[str]) -> None:
        self.client = client
        self.enabled = client.config.lora is not None
        self.base_names = base_names  # the base model's names: no adapter may take one
        self.by_name: dict[str, ServedAdapter] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    def lora_of(self, model: str | None) -> str | None:
        """The adapter a request's ``model`` selects (None: the base model)."""
        return model if model is not None and model in self.by_name else None

    async def load(self, name: str, path: str) -> ServedAdapter:
        """Load adapter ``name`` from ``path`` into every engine core. ValueError naming it and
        the reason (LoRA off, a name taken, a missing file, a rank over --max-lora-rank, shapes
        that do not fit the base); the engine is unchanged then."""
        if not self.enabled:
            raise ValueError(f"LoRA adapter {name!r}: the server was started without --enable-lora")
        if not name or name in self.base_names:
            raise ValueError(f"LoRA adapter {name!r}: the name is empty or the base model's")
        async with self._lock:
            if name in self.by_name:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            adapter = ServedAdapter(name, path, next(self._ids))
            try:
                await self.client.utility("add_lora", name, adapter.int_id, path)
            except ValueError:
                await self._forget_in_core(name)  # replicas that took it (data parallel)
                raise
            self.by_name[name] = adapter
            return adapter

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` (``AdapterNotFound`` if it is not served); requests running it
        finish with it."""
        async with self._lock:
            if name not in self.by_name:
                raise AdapterNotFound(f"LoRA adapter {name!r} is not loaded")
            del self.by_name[name]  # refused at once, even before every core has heard
            await self._forget_in_core(name)

    async def _forget_in_core(self, name: str) -> None:
        try:
            await self.client.utility("remove_lora", name)
        except ValueError:
            pass  # a core that never took it
