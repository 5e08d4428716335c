"""Grammars for structured answers: any JSON object, or JSON that follows a JSON Schema.

llama.cpp constrains sampling with a GBNF grammar (see `LlamaRunner.start_sequence`). The JSON
grammar and the JSON-Schema-to-GBNF converter are llama-cpp-python's, in pure Python.
"""

from __future__ import annotations

import json
from typing import Any


class GrammarError(ValueError):
    """A schema that cannot become a grammar; the message says why."""


def json_grammar(schema: dict[str, Any] | None = None) -> str:
    """GBNF for one JSON object, or for JSON that follows `schema`."""
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if schema is None:
        return JSON_GBNF
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter raises whatever its walk of the schema hits
        raise GrammarError(f"the JSON schema cannot be turned into a grammar: {exc}") from None
