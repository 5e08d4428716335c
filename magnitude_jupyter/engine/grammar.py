"""Grammars for structured answers: any JSON object, or JSON that follows a JSON Schema.

llama.cpp constrains sampling with a GBNF grammar (see `LlamaRunner.start_sequence`). The JSON
grammar is llama-cpp-python's; schemas go through its converter with the bounds it leaves out
(schema_grammar.py).
"""

from __future__ import annotations

from typing import Any

from .schema_grammar import GrammarError, schema_grammar

__all__ = ["GrammarError", "json_grammar"]


def json_grammar(schema: dict[str, Any] | None = None) -> str:
    """GBNF for one JSON object, or for JSON that follows `schema`."""
    from llama_cpp.llama_grammar import JSON_GBNF

    if schema is None:
        return JSON_GBNF
    return schema_grammar(schema)
