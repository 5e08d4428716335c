"""The request every API builds, in the engine's own types, and the checks its parts share.

Each wire format (chat completions and completions in openai.py, Messages in anthropic.py, Responses
in responses.py) reads its own fields and builds a `GenerationRequest` with these helpers, handing
each value under the name the client sent it: a bad `max_output_tokens` or `stop_sequences` is
reported by that name, never by another API's. Pure functions, no tornado.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine import Priority, SamplingParams
from ..engine.grammar import GrammarError, json_grammar
from ..engine.reasoning import Thinking
from ..engine.schema_grammar import SchemaGrammar, grammar_for_schema
from ..engine.tools import Tool, ToolError, ToolRequest, ToolSpec, check_tools
from .errors import ApiError

MAX_JSON_DEPTH = 64
MAX_ID_CHARS = 256  # `user`, `cache_salt`, `origin`


@dataclass
class GenerationRequest:
    model: str | None
    params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    messages: list[Any] | None = None
    prompt: str | None = None
    stream: bool = False
    include_usage: bool = False
    keep_alive: float | None = None  # seconds the model stays loaded after this (Ollama's); None: as set
    tools: ToolRequest | None = None
    cache_salt: str | None = None
    user: str | None = None
    thinking: Thinking = field(default_factory=Thinking)
    origin: str | None = None

    @property
    def logprobs(self) -> bool:
        return self.params.logprobs


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than `limit` (walked without recursion, whatever the depth)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            raise ApiError(400, f"the request body is nested more than {limit} levels deep", code="invalid_json")
        stack.extend((child, depth + 1) for child in children)


def parse_json_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"")
    except RecursionError:
        raise ApiError(
            400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    check_depth(data)
    return data


def integer_param(data: Mapping[str, Any], name: str, lo: int | None = None) -> int | None:
    """`data[name]` as an integer (at least `lo`), None when absent; a 400 naming the field otherwise."""
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_param(name, f"'{name}' must be an integer, got {json.dumps(value)}")
    if lo is not None and value < lo:
        raise bad_param(name, f"'{name}' must be at least {lo}, got {value}")
    return value


def boolean_param(data: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_param(name, f"'{name}' must be true or false, got {json.dumps(value)}")
    return value


def short_string(data: Mapping[str, Any], name: str) -> str | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise bad_param(name, f"'{name}' must be a string of 1 to {MAX_ID_CHARS} characters")
    return value


def model_name(data: Mapping[str, Any]) -> str | None:
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_param("model", "'model' must be a string")
    return model


def sampling_params(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> SamplingParams:
    """SamplingParams with `values` (by the engine's names; None: the default) set and checked. A bad
    value is reported by the client's name for it (`names`: engine name -> the API's field)."""
    params = SamplingParams()
    for name, value in values.items():
        if value is not None:
            setattr(params, name, value)
    try:
        params.validate()
    except ValueError as exc:
        param: str | None = getattr(exc, "param", None)
        field_name = (names or {}).get(param, param) if param else None
        message = str(exc)
        if param and field_name and field_name != param and message.startswith(f"{param}:"):
            message = field_name + message[len(param) :]
        raise ApiError(400, message, param=field_name, code="invalid_value") from None
    return params


def json_output(schema: Any, param: str) -> SchemaGrammar:
    """The grammar for answers that follow a JSON Schema (what of it a grammar cannot hold is checked
    once the answer is whole); None as the schema: any JSON object."""
    if schema is None:
        return SchemaGrammar(json_grammar())
    if not isinstance(schema, dict):
        raise bad_param(param, f"{param} must be a JSON Schema object")
    try:
        return grammar_for_schema(schema)
    except GrammarError as exc:
        raise bad_param(param, str(exc)) from None


def hold_to(
    params: SamplingParams, structured: SchemaGrammar | None, tools: ToolRequest | None = None, param: str = ""
) -> None:
    """The answer held to `structured`'s grammar, and checked against its schema where it could not be;
    with `tools` too, a 400 naming `param` (the API's format field): a call is held to its schema."""
    if structured is not None and tools is not None:
        raise bad_param(param, f"give 'tools' or '{param}', not both: a tool call is already held to its schema")
    if structured is not None:
        params.grammar, params.unheld, params.answer_schema = (
            structured.grammar,
            structured.unheld,
            structured.checked_after,
        )


def tool_choice(tools: list[Tool], choice: str, function: str | None, parallel: bool, param: str) -> ToolRequest:
    """The engine's ToolRequest, a problem reported under `param` (the API's tool-choice field)."""
    try:
        return ToolRequest.of(tools, choice, function, parallel)
    except ToolError as exc:
        message = str(exc).replace("'tool_choice'", f"'{param}'")
        raise bad_param(param if exc.param == "tool_choice" else exc.param, message) from None


def tools_of(specs: list[ToolSpec]) -> list[Tool]:
    """The engine's tools, checked; a problem is the API's 400 naming the client's field."""
    try:
        return check_tools(specs)
    except ToolError as exc:
        raise bad_param(exc.param, str(exc)) from None
