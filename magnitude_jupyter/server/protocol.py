"""The OpenAI wire format: request bodies in, response objects and stream chunks out.

Pure functions, no tornado: the handlers only move bytes. Every problem with a request becomes an
`ApiError` carrying the HTTP status and an OpenAI-shaped body naming the offending field.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine import Priority, SamplingParams
from ..engine.grammar import GrammarError, json_grammar
from ..engine.streams import StreamEvent


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


@dataclass
class GenerationRequest:
    kind: str  # "chat" or "completion"
    model: str | None
    params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    messages: list[Any] | None = None
    prompt: str | None = None
    stream: bool = False
    include_usage: bool = False


def parse_json_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def _number(data: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_param(name, f"'{name}' must be a number, got {json.dumps(value)}")
    if not lo <= value <= hi:
        raise bad_param(name, f"'{name}' must be between {lo:g} and {hi:g}, got {value}")
    return float(value)


def _integer(data: dict[str, Any], name: str, lo: int | None = None) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_param(name, f"'{name}' must be an integer, got {json.dumps(value)}")
    if lo is not None and value < lo:
        raise bad_param(name, f"'{name}' must be at least {lo}, got {value}")
    return value


def _boolean(data: dict[str, Any], name: str, default: bool = False) -> bool:
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_param(name, f"'{name}' must be true or false, got {json.dumps(value)}")
    return value


def _stop(data: dict[str, Any]) -> list[str]:
    stop = data.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise bad_param("stop", "'stop' must be a non-empty string or a list of at most 16 non-empty strings")
    return stop


def _grammar(data: dict[str, Any]) -> str | None:
    """The GBNF grammar `response_format` asks for (or llama.cpp's own `grammar` field gives), if any."""
    response_format, grammar = data.get("response_format"), data.get("grammar")
    if grammar is not None:
        if response_format is not None:
            raise bad_param("grammar", "give 'grammar' or 'response_format', not both")
        if not isinstance(grammar, str) or not grammar.strip():
            raise bad_param("grammar", "'grammar' must be a GBNF grammar with a 'root' rule")
        return grammar
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_param("response_format", "response_format.json_schema.schema must be a JSON Schema object")
        try:
            return json_grammar(schema)
        except GrammarError as exc:
            raise bad_param("response_format", str(exc)) from None
    raise bad_param("response_format", "response_format.type must be 'text', 'json_object' or 'json_schema'")


def parse_generation(data: dict[str, Any], kind: str) -> GenerationRequest:
    """Validate a /v1/chat/completions or /v1/completions body."""
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_param("model", "'model' must be a string")

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

    n = _integer(data, "n", 1)
    if n not in (None, 1):
        raise bad_param("n", "only n=1 is supported")
    max_tokens = _integer(data, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(data, "max_tokens", 1)
    temperature = _number(data, "temperature", 0.0, 2.0)
    top_p = _number(data, "top_p", 0.0, 1.0)
    min_p = _number(data, "min_p", 0.0, 1.0)
    repeat_penalty = _number(data, "repeat_penalty", 0.0, 10.0)
    top_k = _integer(data, "top_k", 0)
    seed = _integer(data, "seed")

    params = SamplingParams(max_tokens=max_tokens, stop=_stop(data), seed=seed)
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("min_p", min_p),
        ("repeat_penalty", repeat_penalty),
        ("top_k", top_k),
    ):
        if value is not None:
            setattr(params, name, value)
    params.reproducible = _boolean(data, "reproducible")
    params.ignore_eos = _boolean(data, "ignore_eos")

    priority_raw = data.get("priority", "interactive")
    try:
        priority = Priority.parse(priority_raw) if isinstance(priority_raw, str) else None
    except ValueError:
        priority = None
    if priority is None:
        raise bad_param("priority", "'priority' must be 'interactive' or 'batch'")

    stream = _boolean(data, "stream")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_param("stream_options", "'stream_options' must be an object")
    include_usage = _boolean(options or {}, "include_usage")

    params.grammar = _grammar(data)

    return GenerationRequest(
        kind=kind,
        model=model,
        params=params,
        priority=priority,
        messages=messages,
        prompt=prompt,
        stream=stream,
        include_usage=include_usage,
    )


# -- responses ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseShape:
    """What every chunk of one generation shares; kept with the request so a resumed stream matches."""

    id: str
    kind: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    include_usage: bool = False

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"


def _choice(shape: ResponseShape, text: str, finish_reason: str | None, first: bool, delta: bool) -> dict[str, Any]:
    if shape.kind == "chat":
        if delta:
            body: dict[str, Any] = {"content": text}
            if first:
                body["role"] = "assistant"
            return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def openai_finish_reason(reason: str | None) -> str | None:
    # OpenAI knows stop and length; a cancelled or failed generation stopped, and says why in `error`.
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_response(shape: ResponseShape, text: str, final: StreamEvent) -> dict[str, Any]:
    return {
        "id": shape.id,
        "object": shape.object,
        "created": shape.created,
        "model": shape.model,
        "choices": [_choice(shape, text, openai_finish_reason(final.finish_reason), first=True, delta=False)],
        "usage": final.usage,
        "timings": final.timings,
        "magnitude": {"finish_reason": final.finish_reason, "error": final.error},
    }


def stream_chunks(shape: ResponseShape, event: StreamEvent) -> list[dict[str, Any]]:
    """The SSE payloads for one engine event (none for a held-back, empty token event)."""
    if not event.is_final and not event.text and event.id != 1:
        return []
    base = {
        "id": shape.id,
        "object": shape.object + ".chunk" if shape.kind == "chat" else shape.object,
        "created": shape.created,
        "model": shape.model,
    }
    finish = openai_finish_reason(event.finish_reason) if event.is_final else None
    chunk = {**base, "choices": [_choice(shape, event.text, finish, first=event.id == 1, delta=True)]}
    if not event.is_final:
        return [chunk]
    chunk["timings"] = event.timings
    chunk["usage"] = event.usage
    chunk["magnitude"] = {"finish_reason": event.finish_reason, "error": event.error}
    chunks = [chunk]
    if shape.include_usage:
        chunks.append({**base, "choices": [], "usage": event.usage})
    return chunks
