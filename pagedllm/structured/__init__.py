"""Structured outputs: grammar constraints compiled by llguidance (``grammar``) and the per-step
token masks of the requests that use them (``manager``)."""

from pagedllm.structured.grammar import GrammarCompiler, GrammarError, tighten_schema, to_grammar

__all__ = ["GrammarCompiler", "GrammarError", "tighten_schema", "to_grammar"]
