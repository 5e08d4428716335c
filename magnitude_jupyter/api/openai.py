"""The OpenAI wire format (chat completions and completions): request bodies in (the response objects
and stream chunks out are openai_shapes.py's).

Pure functions, no tornado: the HTTP handlers, the in-process client and the Dask path share them.
Every problem with a request becomes an `ApiError` carrying the HTTP status and an OpenAI-shaped
body naming the offending field.
"""

from __future__ import annotations

from typing import Any

from ..config import parse_keep_alive
from ..engine import Priority
from ..engine.reasoning import Thinking
from ..engine.schema_grammar import SchemaGrammar
from ..engine.tools import ToolError, ToolRequest
from .errors import refuse_unknown_fields
from .generation import (
    GenerationRequest,
    bad_param,
    boolean_param,
    hold_to,
    integer_param,
    json_output,
    model_name,
    parse_json_body,
    sampling_params,
    short_string,
)
from .tools import tool_request

__all__ = ["GenerationRequest", "parse_generation", "parse_json_body"]


# What each endpoint understands. A field outside these is refused by name, never ignored: a client
# that asks for tools, several choices or an echo must learn that it did not get them.
# Fields that go into SamplingParams as they are (its `validate` checks their types and ranges).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "reproducible",
    "ignore_eos",
)
COMMON_FIELDS = {
    *SAMPLING_FIELDS,
    "model",
    "max_tokens",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "response_format",
    "grammar",
    "priority",
    "keep_alive",  # Ollama's: how long the model stays loaded once idle ("5m", seconds, 0 = unload now)
    "user",  # an end-user id: it changes nothing in the answer (with prefix_cache_scope: user, it scopes the cache)
    "cache_salt",  # vLLM's: the prefix cache shares entries only between requests of the same salt
    "origin",  # ours: where the request came from (a notebook cell, a batch row), shown in the panel
}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_format",  # llama.cpp's server's: "none" leaves a thinking model's reasoning in the content
    "chat_template_kwargs",  # vLLM's and llama.cpp's server's; here only {"enable_thinking": bool}
    "thinking_token_budget",  # vLLM's: a thinking model's reasoning is closed after this many tokens
    "reasoning_effort",  # OpenAI's: "none"/"minimal" turn a thinking model's thinking off; others change nothing
}
# Fields that change nothing about the answer here: accepted and ignored, as llama-server, vLLM and
# Ollama do (docs/http-api.md lists them; clients such as Pi Agent send `store` on every request).
IGNORED_FIELDS = {
    "store",  # OpenAI keeps the completion for its dashboard: nothing is kept here
    "metadata",  # tags for OpenAI's dashboard (checked by OpenAI's rule, then dropped)
    "service_tier",  # OpenAI's scheduling tier: one tier here
    "prompt_cache_key",  # OpenAI's routing hint for its cache: the prefix cache needs no hint
    "safety_identifier",  # an end-user id for OpenAI's abuse checks
    "prediction",  # Predicted Outputs: a latency hint; the answer is the same without it
}
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
REASONING_EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh"}
REASONING_FORMATS = {"none": False, "auto": True, "deepseek": True}  # -> reasoning apart from content
TEMPLATE_KWARGS = {"enable_thinking"}
MAX_THINKING_BUDGET = 1 << 20
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS |= IGNORED_FIELDS
COMPLETION_FIELDS |= IGNORED_FIELDS
NOT_SUPPORTED = {
    "tools": "tools are for /v1/chat/completions",
    "tool_choice": "tools are for /v1/chat/completions",
    "parallel_tool_calls": "tools are for /v1/chat/completions",
    "functions": "the legacy 'functions' field is not supported: give 'tools'",
    "function_call": "the legacy 'function_call' field is not supported: give 'tool_choice'",
    "best_of": "best_of is not supported: each request makes one answer",
    "echo": "echo is not supported: the answer never repeats the prompt",
    "suffix": "suffix (insertion) is not supported",
    "logit_bias": "logit_bias is not supported",
}


def _stop(data: dict[str, Any]) -> list[str]:
    stop = data.get("stop")
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop  # SamplingParams.validate checks the rest


def _logprobs(data: dict[str, Any], kind: str) -> tuple[bool, int]:
    """(report logprobs, how many alternatives): chat has a flag and `top_logprobs`, completions a count."""
    if kind == "chat":
        wanted = boolean_param(data, "logprobs")
        top = integer_param(data, "top_logprobs", 0)
        if top is not None and not wanted:
            raise bad_param("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return wanted, top or 0
    count = integer_param(data, "logprobs", 0)
    if count is not None and count > 5:
        raise bad_param("logprobs", f"'logprobs' on /v1/completions is at most 5, got {count}")
    return count is not None, count or 0


def _grammar(data: dict[str, Any]) -> SchemaGrammar | None:
    """The GBNF grammar `response_format` asks for (or llama.cpp's own `grammar` field gives), if any,
    with what of a JSON schema it leaves to the check after generation."""
    response_format, grammar = data.get("response_format"), data.get("grammar")
    if grammar is not None:
        if response_format is not None:
            raise bad_param("grammar", "give 'grammar' or 'response_format', not both")
        if not isinstance(grammar, str) or not grammar.strip():
            raise bad_param("grammar", "'grammar' must be a GBNF grammar with a 'root' rule")
        return SchemaGrammar(grammar)
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_output(None, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_param("response_format", "response_format.json_schema.schema must be a JSON Schema object")
        return json_output(schema, "response_format")
    raise bad_param("response_format", "response_format.type must be 'text', 'json_object' or 'json_schema'")


def _without_no_ops(data: dict[str, Any]) -> dict[str, Any]:
    """The body without what asks for nothing: an empty `tools` list (and the tool settings that then
    have nothing to apply to, unless they demand a call), an empty `logit_bias`, `modalities: ["text"]`."""
    out = dict(data)
    if out.get("tools") == []:
        del out["tools"]
        if out.get("tool_choice") in ("auto", "none"):
            del out["tool_choice"]
    if out.get("tools") is None:
        out.pop("parallel_tool_calls", None)
    if out.get("logit_bias") == {}:
        del out["logit_bias"]
    if out.get("modalities") == ["text"]:
        del out["modalities"]
    return out


def check_metadata(raw: Any) -> None:
    """OpenAI's rule for `metadata`: at most 16 pairs, keys of up to 64 characters, string values of up
    to 512."""
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise bad_param("metadata", "'metadata' must be an object of up to 16 string pairs")
    if len(raw) > METADATA_KEYS:
        raise bad_param("metadata", f"'metadata' has {len(raw)} keys; the limit is {METADATA_KEYS}")
    for key, value in raw.items():
        if len(key) > METADATA_KEY_CHARS:
            raise bad_param("metadata", f"a 'metadata' key is {len(key)} characters; the limit is {METADATA_KEY_CHARS}")
        if not isinstance(value, str):
            raise bad_param("metadata", f"'metadata.{key[:64]}' must be a string")
        if len(value) > METADATA_VALUE_CHARS:
            raise bad_param(
                "metadata", f"'metadata.{key[:64]}' is {len(value)} characters; the limit is {METADATA_VALUE_CHARS}"
            )


def _check_ignored(data: dict[str, Any]) -> None:
    """The ignored fields still have their documented types (a client's typo is told, not hidden)."""
    if data.get("store") is not None and not isinstance(data["store"], bool):
        raise bad_param("store", "'store' must be true or false")
    check_metadata(data.get("metadata"))
    for name in ("service_tier", "prompt_cache_key", "safety_identifier"):
        if data.get(name) is not None and (not isinstance(data[name], str) or len(data[name]) > 512):
            raise bad_param(name, f"'{name}' must be a string")
    effort = data.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_param("reasoning_effort", f"'reasoning_effort' must be one of {', '.join(sorted(REASONING_EFFORTS))}")


def _tools(data: dict[str, Any]) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked (schemas become grammars here)."""
    if data.get("tools") is None:
        for name in ("tool_choice", "parallel_tool_calls"):
            if data.get(name) is not None:
                raise bad_param(name, f"'{name}' needs 'tools'")
        return None
    for name in ("response_format", "grammar"):
        if data.get(name) is not None and not (name == "response_format" and _is_text_format(data[name])):
            raise bad_param(name, f"give 'tools' or '{name}', not both: a tool call is already held to its schema")
    try:
        return tool_request(data["tools"], data.get("tool_choice"), data.get("parallel_tool_calls"))
    except ToolError as exc:
        raise bad_param(exc.param, str(exc)) from None


def _thinking(data: dict[str, Any]) -> Thinking:
    """`reasoning_format` and `chat_template_kwargs.enable_thinking`: a thinking model's reasoning
    apart from its content or inline, and thinking on or off where the template reads the flag."""
    fmt = data.get("reasoning_format", "auto")
    if fmt not in REASONING_FORMATS:
        raise bad_param("reasoning_format", f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}")
    kwargs = data.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_param("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    unknown = sorted(set(kwargs) - TEMPLATE_KWARGS)
    if unknown:
        raise bad_param(
            "chat_template_kwargs", f"chat_template_kwargs.{unknown[0]} is not supported (only enable_thinking is)"
        )
    enabled = kwargs.get("enable_thinking")
    if enabled is None and data.get("reasoning_effort") in ("none", "minimal"):
        enabled = False  # a thinking model's template is asked not to think
    if enabled is not None and not isinstance(enabled, bool):
        raise bad_param("chat_template_kwargs", "chat_template_kwargs.enable_thinking must be true or false")
    budget = data.get("thinking_token_budget")
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or not 0 <= budget <= MAX_THINKING_BUDGET:
            raise bad_param(
                "thinking_token_budget", f"'thinking_token_budget' must be an integer from 0 to {MAX_THINKING_BUDGET}"
            )
        if budget == 0:  # no thinking at all: the template is asked not to
            enabled, budget = False, None
    return Thinking(split=REASONING_FORMATS[fmt], enabled=enabled, budget_tokens=budget)


def _is_text_format(response_format: Any) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") == "text"


def parse_generation(data: dict[str, Any], kind: str) -> GenerationRequest:
    """Validate a /v1/chat/completions or /v1/completions body."""
    known = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    data = _without_no_ops(data)
    refuse_unknown_fields(data, known, NOT_SUPPORTED, code="unsupported_parameter")
    _check_ignored(data)
    model = model_name(data)

    messages = prompt = None
    if kind == "chat":
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_param("messages", "'messages' must be a non-empty list of {role, content} objects")
    else:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise bad_param("prompt", "'prompt' must be a non-empty string")

    n = integer_param(data, "n", 1)
    if n not in (None, 1):
        raise bad_param("n", "only n=1 is supported: each request makes one answer")
    max_tokens = integer_param(data, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = integer_param(data, "max_tokens", 1)

    # Types and ranges are checked once, by SamplingParams.validate, which names the field.
    logprobs, top_logprobs = _logprobs(data, kind)
    values = {name: data.get(name) for name in SAMPLING_FIELDS}
    params = sampling_params(
        {**values, "max_tokens": max_tokens, "stop": _stop(data), "logprobs": logprobs, "top_logprobs": top_logprobs}
    )

    priority_raw = data.get("priority", "interactive")
    try:
        priority = Priority.parse(priority_raw) if isinstance(priority_raw, str) else None
    except ValueError:
        priority = None
    if priority is None:
        raise bad_param("priority", "'priority' must be 'interactive' or 'batch'")

    stream = boolean_param(data, "stream")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_param("stream_options", "'stream_options' must be an object")
    include_usage = boolean_param(options or {}, "include_usage")

    hold_to(params, _grammar(data))  # what the grammar could not hold is checked once the answer is whole
    tools = _tools(data) if kind == "chat" else None
    keep_alive = None
    if data.get("keep_alive") is not None:
        try:
            keep_alive = parse_keep_alive(data["keep_alive"])
        except ValueError as exc:
            raise bad_param("keep_alive", str(exc)) from None

    cache_salt, user, origin = (short_string(data, name) for name in ("cache_salt", "user", "origin"))
    thinking = _thinking(data) if kind == "chat" else Thinking()
    return GenerationRequest(
        origin=origin,
        thinking=thinking,
        cache_salt=cache_salt,
        user=user,
        model=model,
        params=params,
        priority=priority,
        messages=messages,
        prompt=prompt,
        stream=stream,
        include_usage=include_usage,
        keep_alive=keep_alive,
        tools=tools,
    )
