"""The engine, split by job::

    core.py         LLMEngine, the synchronous front end: input -> EngineCore -> OutputProcessor
    engine_core.py  EngineCore: token ids in and out; step() = schedule -> execute -> update ->
                    EngineCoreOutputs; one way a sequence ends (core_outputs.py builds them)
    input.py        prompts -> token ids (tokenize, validate), the n fan-out of a request
    output.py       the front end's detokenization, stop strings (an abort to the core), logprobs,
                    RequestOutputs (cumulative, delta, final)
    beam.py         beam search above the core: rounds of 1-token requests on held KV
    drive.py        drive(): the one offline loop over a workload (LLM, generate, bench, planner)

    messages.py     EngineCoreRequest / EngineCoreOutputs: plain data (msgspec) to and from the core
    core_proc.py    CoreService (EngineCore behind messages), the busy loop, the core process
    client.py       EngineClient: the one async interface of the server (client_inproc.py: the
                    core in a thread; client_mp.py: in its own process over ZMQ)
    snapshot.py     the /kv inspector's snapshot, a named call run on the core
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.engine.core import LLMEngine
    from pagedllm.engine.input import PromptType

__all__ = ["LLMEngine", "PromptType"]


def __getattr__(name: str) -> Any:
    """``LLMEngine`` and ``PromptType`` on first use: the package's torch-free modules
    (``drive``, ``messages``) import without the model code (the planner's replay)."""
    if name == "LLMEngine":
        from pagedllm.engine.core import LLMEngine

        return LLMEngine
    if name == "PromptType":
        from pagedllm.engine.input import PromptType

        return PromptType
    raise AttributeError(f"module 'pagedllm.engine' has no attribute {name!r}")
