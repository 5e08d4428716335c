"""Anthropic's Messages API (what Claude Code and the `anthropic` SDK speak), in and out.

A Messages body becomes the engine's request directly, with the checks every API shares
(generation.py: sampling limits, grammars, tools), each problem named by Anthropic's field. The
engine's answer and stream events are shaped as Anthropic's: content blocks, `stop_reason`, `usage`
with `cache_read_input_tokens`, the `message_start` ... `message_stop` event sequence, and errors as
`{"type": "error", "error": {"type", "message"}}`. Pure functions, no tornado.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine.reasoning import Thinking
from ..engine.schema_grammar import SchemaGrammar
from ..engine.streams import StreamEvent
from ..engine.tools import ParsedAnswer, ToolRequest, ToolSpec, parse_answer
from .errors import ApiError, refuse_unknown_fields
from .generation import (
    GenerationRequest,
    bad_param,
    boolean_param,
    hold_to,
    json_output,
    model_name,
    sampling_params,
    tool_choice,
    tools_of,
)
from .openai import MAX_THINKING_BUDGET
from .usage import TokenCounts

FIELDS = {
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "metadata",
    "output_config",
    "thinking",  # {"type": "disabled"} turns a thinking model's thinking off where its template can
    "ignore_eos",  # llama.cpp's extra, as on every route: the answer runs to max_tokens
}
# Hints that change nothing here: accepted, and listed in docs/http-api.md as ignored.
IGNORED = {
    "service_tier",
    "context_management",
    "cache_control",
    "diagnostics",
    "inference_geo",
    "speed",
    "user_profile_id",
    "workspace_id",
}
ACCEPTED = FIELDS | IGNORED
REFUSED = {
    "mcp_servers": "MCP servers are not supported: give the tools themselves",
    "container": "code-execution containers are not supported",
}
BLOCKS_REFUSED = {
    "image": "image blocks are not supported: the models served here read text",
    "document": "document blocks are not supported: send the text",
    "search_result": "search_result blocks are not supported: send the text",
    "server_tool_use": "server tools are not supported",
    "web_search_tool_result": "server tools are not supported",
}
DEFAULT_TEMPERATURE = 1.0  # the Messages API's own default
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    410: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn", "error": "end_turn"}


def error_body(err: ApiError) -> dict[str, Any]:
    """An error in Anthropic's shape (the message names the field, as ours always do)."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _text_of(content: Any, where: str) -> str:
    """The text of a string, or of a list of text blocks (anything else is refused by name)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(where, f"{where} must be a string or a list of text blocks")
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and not isinstance(block.get("text"), str):
            raise bad_param(f"{where}[{i}].text", f"{where}[{i}].text must be a string")
        if kind != "text":
            reason = BLOCKS_REFUSED.get(str(kind), f"{where}[{i}] must be a text block")
            raise bad_param(f"{where}[{i}]", reason)
        parts.append(block["text"])
    return "\n\n".join(parts)


BILLING_HEADER = "x-anthropic-billing-header:"


def _without_billing_header(system: Any) -> Any:
    """The `system` blocks but Claude Code's attribution block (`x-anthropic-billing-header:
    cc_version=...; cc_entrypoint=...;`): metadata for Anthropic's billing, not an instruction, and
    it differs from one session to the next at the very top of the prompt, so every new session
    would compute again all the rest (docs/decisions.md, "Claude Code's attribution block")."""
    if not isinstance(system, list):
        return system
    return [
        block
        for block in system
        if not (
            isinstance(block, dict)
            and block.get("type") == "text"
            and isinstance(block.get("text"), str)
            and block["text"].lstrip().startswith(BILLING_HEADER)
        )
    ]


def _messages(raw: Any) -> list[dict[str, Any]]:
    """Messages API messages as the engine's chat messages (OpenAI's roles: tool calls and results)."""
    if not isinstance(raw, list) or not raw:
        raise bad_param("messages", "'messages' must be a non-empty list of {role, content} objects")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise bad_param(f"{where}.role", f"{where}.role must be 'user', 'assistant' or 'system'")
        content = message.get("content")
        if role == "system":  # an instruction in the middle of the conversation (Claude Code sends them)
            out.append({"role": "system", "content": _text_of(content, f"{where}.content")})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_param(f"{where}.content", f"{where}.content must be a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise bad_param(f"{at}.text", f"{at}.text must be a string")
                texts.append(block["text"])
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning: the models served here do not read it back
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad_param(at, f"{at} needs an 'id' and a 'name'")
                arguments = json.dumps(block.get("input") or {})
                calls.append(
                    {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
                )
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_param(at, f"{at} needs a 'tool_use_id'")
                text = _text_of(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            else:
                reason = BLOCKS_REFUSED.get(
                    str(kind), f"{at} is a {kind!r} block, which a {role} message cannot hold here"
                )
                raise bad_param(at, reason)
        out.extend(results)
        if role == "assistant":
            if texts or calls:
                out.append(
                    {
                        "role": "assistant",
                        "content": "\n\n".join(texts) or None,
                        **({"tool_calls": calls} if calls else {}),
                    }
                )
        elif texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _tool_specs(raw: Any) -> list[ToolSpec]:
    """The tools' shape checked; their schemas are checked once the model may call them (`tools_of`)."""
    if not isinstance(raw, list) or not raw:
        raise bad_param("tools", "'tools' must be a non-empty list of {name, description, input_schema}")
    specs = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise bad_param(f"tools[{i}]", f"tools[{i}] must be an object")
        if tool.get("type") not in (None, "custom"):
            raise bad_param(
                f"tools[{i}]", f"tools[{i}] is a server tool ({tool['type']!r}), which this server does not run"
            )
        specs.append(
            ToolSpec(tool.get("name"), tool.get("description"), tool.get("input_schema"), f"tools[{i}]", "input_schema")
        )
    return specs


def _tool_choice(raw: Any) -> tuple[str, str | None, bool | None]:
    """(the engine's choice, the function it names, parallel calls) of Anthropic's
    {type: auto|any|tool|none, disable_parallel_tool_use}."""
    if raw is None:
        return "auto", None, None
    kind = raw.get("type") if isinstance(raw, dict) else None
    parallel = (
        None
        if not isinstance(raw, dict) or raw.get("disable_parallel_tool_use") is None
        else not raw["disable_parallel_tool_use"]
    )
    if parallel is not None and not isinstance(raw["disable_parallel_tool_use"], bool):
        raise bad_param("tool_choice", "tool_choice.disable_parallel_tool_use must be true or false")
    if kind in ("auto", "none"):
        return kind, None, parallel
    if kind == "any":
        return "required", None, parallel
    if kind == "tool" and isinstance(raw.get("name"), str):
        return "function", raw["name"], parallel
    raise bad_param("tool_choice", "tool_choice.type must be 'auto', 'any', 'tool' (with a name) or 'none'")


def _tool_request(data: dict[str, Any]) -> ToolRequest | None:
    """`tools` and `tool_choice` as the engine's ToolRequest; none when they ask for nothing (no
    tools, as Claude Code's `--tools ""` sends, or `tool_choice: none`)."""
    choice, function, parallel = _tool_choice(data.get("tool_choice"))
    if data.get("tools") in (None, []):
        if choice not in ("auto", "none"):
            raise bad_param("tool_choice", "'tool_choice' needs 'tools'")
        return None
    specs = _tool_specs(data["tools"])
    if choice == "none":  # the model may not call them: as if none were given
        return None
    return tool_choice(tools_of(specs), choice, function, bool(parallel), "tool_choice")


def _output_format(config: Any) -> SchemaGrammar | None:
    """`output_config.format` (a JSON schema the answer follows); `effort` is a hint for reasoning
    models, ignored here."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad_param("output_config", "'output_config' must be an object")
    unknown = set(config) - {"format", "effort"}
    if unknown:
        raise bad_param("output_config", f"output_config.{sorted(unknown)[0]} is not supported")
    output_format = config.get("format")
    if output_format is None:
        return None
    if not isinstance(output_format, dict) or output_format.get("type") != "json_schema":
        raise bad_param("output_config.format", "output_config.format must be {type: 'json_schema', schema: {...}}")
    if not isinstance(output_format.get("schema"), dict):
        raise bad_param("output_config.format", "output_config.format.schema must be a JSON Schema object")
    return json_output(output_format["schema"], "output_config.format")


def _user_id(value: Any) -> str | None:
    """metadata.user_id as the request's `user` (the prefix cache's scope under `prefix_cache_scope:
    user`): clients send long opaque ids (Claude Code a JSON object), so a long one is hashed."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_param("metadata.user_id", "metadata.user_id must be a non-empty string")
    return value if len(value) <= 256 else "sha256:" + hashlib.sha256(value.encode()).hexdigest()


SAMPLING_NAMES = {"stop": "stop_sequences"}


def parse_messages(data: dict[str, Any]) -> GenerationRequest:
    """Validate a /v1/messages body into the engine's request."""
    refuse_unknown_fields(data, ACCEPTED, REFUSED)
    max_tokens = data.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_param("max_tokens", "'max_tokens' is required: a positive integer")
    messages = _messages(data.get("messages"))
    if data.get("system") is not None:
        system = _text_of(_without_billing_header(data["system"]), "system")
        if system or not isinstance(data["system"], list):
            messages.insert(0, {"role": "system", "content": system})
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_param("metadata", "'metadata' must be an object")
    stops = data.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
        raise bad_param("stop_sequences", "'stop_sequences' must be a list of non-empty strings")
    temperature = data.get("temperature")
    values = {
        "max_tokens": max_tokens,
        "stop": stops or [],
        "temperature": DEFAULT_TEMPERATURE if temperature is None else temperature,
        "top_p": data.get("top_p"),
        "top_k": data.get("top_k"),
        "ignore_eos": data.get("ignore_eos"),
    }
    params = sampling_params(values, SAMPLING_NAMES)
    tools = _tool_request(data)
    hold_to(params, _output_format(data.get("output_config")), tools, "output_config.format")
    return GenerationRequest(
        model=model_name(data),
        params=params,
        messages=messages,
        stream=boolean_param(data, "stream"),
        tools=tools,
        user=_user_id((metadata or {}).get("user_id")),
        thinking=_thinking(data.get("thinking")),
    )


def _thinking(config: Any) -> Thinking:
    """`thinking`: enabled (the model thinks as its template lets it, its reasoning closed after
    `budget_tokens`), adaptive (thinks as it likes) or disabled (the template is asked not to think)."""
    if config is None:
        return Thinking()
    if not isinstance(config, dict) or config.get("type") not in ("enabled", "disabled", "adaptive"):
        raise bad_param("thinking", '\'thinking\' must be {"type": "enabled" | "adaptive" | "disabled", ...}')
    budget = config.get("budget_tokens") if config["type"] == "enabled" else None
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise bad_param("thinking.budget_tokens", "'thinking.budget_tokens' must be a positive integer")
    if budget is not None and budget > MAX_THINKING_BUDGET:
        raise bad_param("thinking.budget_tokens", f"'thinking.budget_tokens' is at most {MAX_THINKING_BUDGET}")
    return Thinking(enabled=config["type"] != "disabled", budget_tokens=budget)


def count_tokens_body(data: dict[str, Any]) -> GenerationRequest:
    """/v1/messages/count_tokens: the same body as a message, max_tokens not needed."""
    return parse_messages({**data, "max_tokens": data.get("max_tokens") or 1, "stream": None})


# -- responses ------------------------------------------------------------------------------------


@dataclass
class MessageShape:
    """What one answer's message object and events share."""

    id: str
    model: str
    input_tokens: int
    tool_form: str | None = None
    created: float = field(default_factory=time.time)

    def tool_use_id(self, index: int) -> str:
        return f"toolu_{self.id.removeprefix('msg_')}_{index}"


def _usage(counts: TokenCounts | None) -> dict[str, Any]:
    counts = counts or TokenCounts(0, 0, 0)
    return {
        "input_tokens": counts.prompt - counts.cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": counts.cached,
        "output_tokens": counts.output,
    }


def _blocks(shape: MessageShape, text: str) -> tuple[list[dict[str, Any]], bool]:
    """The answer's content blocks, and whether it called tools."""
    answer = parse_answer(text, shape.tool_form) if shape.tool_form else None
    if answer is None or not answer.is_call:
        return [{"type": "text", "text": answer.content if answer is not None else text}], False
    blocks: list[dict[str, Any]] = [{"type": "text", "text": answer.content}] if answer.content.strip() else []
    for i, call in enumerate(answer.calls):
        try:
            arguments = json.loads(call.arguments or "{}")
        except ValueError:
            arguments = {}
        blocks.append({"type": "tool_use", "id": shape.tool_use_id(i), "name": call.name, "input": arguments})
    return blocks, True


def _stop(final: StreamEvent, called: bool) -> tuple[str, str | None]:
    if called and final.finish_reason == "stop":
        return "tool_use", None
    if final.finish_reason == "stop" and final.stopped_by:
        return "stop_sequence", final.stopped_by
    return STOP_REASONS.get(final.finish_reason or "stop", "end_turn"), None


def _thinking_block(reasoning: str) -> dict[str, Any]:
    # The signature proves Anthropic's own thinking to its API; a local model's has none to prove.
    return {"type": "thinking", "thinking": reasoning, "signature": ""}


def message_object(shape: MessageShape, text: str, final: StreamEvent, reasoning: str = "") -> dict[str, Any]:
    """The whole answer as a Messages API message (a thinking model's reasoning as a thinking block)."""
    blocks, called = _blocks(shape, text)
    if reasoning:
        blocks.insert(0, _thinking_block(reasoning))
    stop_reason, stop_sequence = _stop(final, called)
    return {
        "id": shape.id,
        "type": "message",
        "role": "assistant",
        "model": shape.model,
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(final.counts),
    }


_EMPTY_TEXT = {"type": "text", "text": ""}


class MessageEvents:
    """The Messages API's stream for one answer, event by event of the engine's stream: text streams
    as `text_delta`s, with tools offered too, once the answer is known to be text (it cannot be a
    call's opening any more); a call opens its `tool_use` block once its name is whole, and its input
    streams as `input_json_delta`s as it is generated. What the check after generation finds still
    ends the stream with an error."""

    def __init__(self, shape: MessageShape) -> None:
        self.shape = shape
        self.text = ""
        self.started = False
        self.block_open = False  # the text block
        self.thinking_open = False
        self.first = 0  # the index of the text (or first tool) block: 1 after a thinking block
        self.sent = ParsedAnswer()  # with tools: what the blocks sent so far hold
        self.open_call: int | None = None  # with tools: the call whose block is open

    def __call__(self, event: StreamEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            start: dict[str, Any] = {
                "id": self.shape.id,
                "type": "message",
                "role": "assistant",
                "model": self.shape.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": self.shape.input_tokens, "output_tokens": 0},
            }
            out += [{"type": "message_start", "message": start}, {"type": "ping"}]
        self.text += event.text
        if event.reasoning and not self.block_open:
            if not self.thinking_open:
                out.append({"type": "content_block_start", "index": 0, "content_block": _thinking_block("")})
                self.thinking_open, self.first = True, 1
            delta = {"type": "thinking_delta", "thinking": event.reasoning}
            out.append({"type": "content_block_delta", "index": 0, "delta": delta})
        if self.thinking_open and (event.text or event.is_final):
            out.append({"type": "content_block_stop", "index": 0})
            self.thinking_open = False
        first = self.first
        if self.shape.tool_form is None:
            if event.text:
                out += self._text(event.text)
        else:
            out += self._tool_form_deltas()
        if not event.is_final:
            return out
        if event.finish_reason == "error":
            message = event.error or "the generation failed"
            return [*out, {"type": "error", "error": {"type": "api_error", "message": message}}]
        called = self.sent.is_call and bool(self.sent.calls)  # only an answer held to a tool form reads calls
        if not self.block_open:  # an empty answer still has its (empty) text block
            out.append({"type": "content_block_start", "index": first, "content_block": _EMPTY_TEXT})
            self.block_open = True
        out.append({"type": "content_block_stop", "index": self._open_index()})
        stop_reason, stop_sequence = _stop(event, called)
        usage = _usage(event.counts)
        out.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {
                    "output_tokens": usage["output_tokens"],
                    "input_tokens": usage["input_tokens"],
                    "cache_read_input_tokens": usage["cache_read_input_tokens"],
                },
            }
        )
        out.append({"type": "message_stop"})
        return out

    def _open_index(self) -> int:
        return self.first + (self.open_call if self.open_call is not None else 0)

    def _text(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.block_open:
            out.append({"type": "content_block_start", "index": self.first, "content_block": _EMPTY_TEXT})
            self.block_open = True
        out.append({"type": "content_block_delta", "index": self.first, "delta": {"type": "text_delta", "text": text}})
        return out

    def _tool_form_deltas(self) -> list[dict[str, Any]]:
        """With tools offered: the answer so far read again, and what it added since the last event,
        as text deltas or as calls' blocks (the block of call i at index `first + i`)."""
        assert self.shape.tool_form is not None
        answer = parse_answer(self.text, self.shape.tool_form)
        out: list[dict[str, Any]] = []
        if not answer.is_call:
            if answer.content[len(self.sent.content) :]:
                out += self._text(answer.content[len(self.sent.content) :])
            self.sent = answer
            return out
        for i, call in enumerate(answer.calls):
            if i >= len(self.sent.calls):
                if self.block_open:
                    out.append({"type": "content_block_stop", "index": self._open_index()})
                block = {"type": "tool_use", "id": self.shape.tool_use_id(i), "name": call.name, "input": {}}
                out.append({"type": "content_block_start", "index": self.first + i, "content_block": block})
                self.block_open, self.open_call = True, i
                piece = call.arguments
            else:
                piece = call.arguments[len(self.sent.calls[i].arguments) :]
            if piece:
                delta = {"type": "input_json_delta", "partial_json": piece}
                out.append({"type": "content_block_delta", "index": self.first + i, "delta": delta})
        self.sent = answer  # a new object at each reading: what was sent stays as it was
        return out
