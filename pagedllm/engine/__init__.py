"""The engine, split by job::

    core.py     LLMEngine: add / abort requests, step() = schedule -> execute -> update -> outputs
    input.py    prompts -> token ids (tokenize, validate), the n fan-out of a request
    output.py   detokenization, stop strings, logprobs, RequestOutputs (cumulative, delta, final)
    beam.py     beam search as a kind of request, advanced inside step()
"""

from pagedllm.engine.core import LLMEngine
from pagedllm.engine.input import PromptType

__all__ = ["LLMEngine", "PromptType"]
