"""OpenAI's Responses API (what Codex CLI and the OpenAI Agents SDK speak by default), in and out.

A Responses body becomes the engine's request directly, with the checks every API shares
(generation.py), each problem named by the Responses field:
`instructions` and `developer` items are system messages, `function_call` / `function_call_output`
items are the assistant's tool calls and the tool results, and `previous_response_id` puts a stored
response's conversation first. The answer is shaped as a `response` object with `output` items and
streamed as the documented `response.*` events, each with its `sequence_number`. Pure functions.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..engine.reasoning import Thinking
from ..engine.schema_grammar import SchemaGrammar
from ..engine.streams import StreamEvent
from ..engine.tools import ToolRequest, ToolSpec, parse_answer
from .errors import ApiError, refuse_unknown_fields
from .generation import (
    GenerationRequest,
    bad_param,
    boolean_param,
    hold_to,
    integer_param,
    json_output,
    model_name,
    sampling_params,
    short_string,
    tool_choice,
    tools_of,
)
from .openai import check_metadata
from .usage import TokenCounts

FIELDS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "stream",
    "store",
    "previous_response_id",
    "metadata",
    "user",
    "ignore_eos",  # llama.cpp's extra, as on every route: the answer runs to max_output_tokens
}
# Hints that change nothing here: accepted, and listed in docs/http-api.md as ignored.
IGNORED = {
    "prompt_cache_key",
    "service_tier",
    "include",
    "reasoning",
    "truncation",
    "safety_identifier",
    "client_metadata",
}
ACCEPTED = FIELDS | IGNORED
REFUSED = {
    "background": "background responses are not supported: stream, or wait for the answer",
    "conversation": "server-side conversations are not supported: give previous_response_id",
    "prompt": "stored prompt templates are not supported: send the input",
}
STORE_COUNT = 1000  # finished responses kept for previous_response_id and GET, oldest dropped first
STORE_SECONDS = 3600.0


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(where, f"{where} must be a string or a list of text parts")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal":
            parts.append(str(part.get("refusal", "")))
        else:
            raise bad_param(f"{where}[{i}]", f"{where}[{i}] is a {kind!r} part: only text parts are supported")
    return "".join(parts)


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """`input` (a string or items) as the engine's chat messages."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_param("input", "'input' must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_param(where, f"{where} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_param(f"{where}.role", f"{where}.role must be user, assistant, system or developer")
            role = "system" if role == "developer" else role
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue  # earlier reasoning: the models served here do not read it back
        else:
            raise bad_param(where, f"{where} is a {kind!r} item, which this server does not take")
    return out


def _tool_specs(raw: Any) -> list[ToolSpec]:
    """The function tools, their shape checked (their schemas: `tools_of`). Hosted tools (web search,
    file search, …) and namespaces are not offered to the model: this server runs none of them, and
    clients such as Codex CLI send them on every turn (docs/http-api.md lists them as ignored)."""
    if not isinstance(raw, list):
        raise bad_param("tools", "'tools' must be a list")
    specs = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise bad_param(f"tools[{i}]", f"tools[{i}] must be an object")
        if tool.get("type") == "function":
            specs.append(
                ToolSpec(
                    tool.get("name"),
                    tool.get("description"),
                    tool.get("parameters"),
                    f"tools[{i}]",
                    strict=tool.get("strict"),
                )
            )
    return specs


def _tool_choice(raw: Any) -> tuple[str, str | None]:
    """(the engine's choice, the function it names)."""
    if raw is None:
        return "auto", None
    if raw in ("auto", "required", "none"):
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return "function", raw["name"]
    raise bad_param("tool_choice", "tool_choice must be 'auto', 'required', 'none' or {type: 'function', name}")


def _tool_request(data: dict[str, Any]) -> ToolRequest | None:
    specs = _tool_specs(data["tools"]) if data.get("tools") is not None else []
    if not specs:  # no function the model may call (hosted tools only): its settings apply to nothing
        return None
    choice, function = _tool_choice(data.get("tool_choice"))
    if choice == "none":  # the model may not call them: as if none were given
        return None
    parallel = data.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", "'parallel_tool_calls' must be true or false")
    return tool_choice(tools_of(specs), choice, function, bool(parallel), "tool_choice")


def _format(text: Any) -> SchemaGrammar | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_param("text", "'text' must be an object, as {format: {type: 'text' | 'json_object' | 'json_schema'}}")
    form = text.get("format")
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_output(None, "text.format")
    if kind == "json_schema":
        if not isinstance(form.get("schema"), dict):
            raise bad_param("text.format", "text.format.schema must be a JSON Schema object")
        return json_output(form["schema"], "text.format")
    raise bad_param("text.format", "text.format.type must be text, json_object or json_schema")


def _thinking(reasoning: Any) -> Thinking:
    """`reasoning.effort: none` asks a thinking model's template not to think; other efforts change nothing."""
    if isinstance(reasoning, dict) and reasoning.get("effort") == "none":
        return Thinking(enabled=False)
    return Thinking()


SAMPLING_NAMES = {"max_tokens": "max_output_tokens"}


def parse_responses(data: dict[str, Any], previous: list[dict[str, Any]] | None = None) -> GenerationRequest:
    """Validate a /v1/responses body (after `previous`, a stored conversation) into the engine's request."""
    refuse_unknown_fields(data, ACCEPTED, REFUSED)
    check_metadata(data.get("metadata"))
    if data.get("store") is not None and not isinstance(data["store"], bool):
        raise bad_param("store", "'store' must be true or false")
    messages = [*(previous or []), *input_messages(data.get("input"))]
    if data.get("instructions") is not None:
        if not isinstance(data["instructions"], str):
            raise bad_param("instructions", "'instructions' must be a string")
        messages.insert(0, {"role": "system", "content": data["instructions"]})
    values = {
        "max_tokens": integer_param(data, "max_output_tokens", 1),
        "temperature": data.get("temperature"),
        "top_p": data.get("top_p"),
        "ignore_eos": data.get("ignore_eos"),
    }
    params = sampling_params(values, SAMPLING_NAMES)
    tools = _tool_request(data)
    hold_to(params, _format(data.get("text")), tools, "text.format")
    return GenerationRequest(
        model=model_name(data),
        params=params,
        messages=messages,
        stream=boolean_param(data, "stream"),
        tools=tools,
        user=short_string(data, "user"),
        thinking=_thinking(data.get("reasoning")),
    )


# -- responses ------------------------------------------------------------------------------------


@dataclass
class ResponseMeta:
    """What a response echoes of its request, and what it needs to shape its output."""

    id: str
    model: str
    body: dict[str, Any]
    tool_form: str | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))

    def item_id(self, kind: str, index: int) -> str:
        return f"{kind}_{self.id.removeprefix('resp_')}_{index}"

    def call_id(self, index: int) -> str:
        return self.item_id("call", index)


def _usage(counts: TokenCounts | None) -> dict[str, Any]:
    counts = counts or TokenCounts(0, 0, 0)
    return {
        "input_tokens": counts.prompt,
        "input_tokens_details": {"cached_tokens": counts.cached},
        "output_tokens": counts.output,
        "output_tokens_details": {"reasoning_tokens": counts.reasoning},
        "total_tokens": counts.prompt + counts.output,
    }


def reasoning_item(meta: ResponseMeta, reasoning: str, status: str = "completed") -> dict[str, Any]:
    """A thinking model's reasoning as the Responses API's reasoning item (its text, no summary)."""
    content = [{"type": "reasoning_text", "text": reasoning}] if reasoning else []
    return {"type": "reasoning", "id": meta.item_id("rs", 0), "status": status, "summary": [], "content": content}


def output_items(meta: ResponseMeta, text: str, status: str = "completed", reasoning: str = "") -> list[dict[str, Any]]:
    """The answer as output items: its reasoning (a thinking model's), then a message, or function
    calls (after any text)."""
    answer = parse_answer(text, meta.tool_form) if meta.tool_form else None
    content = answer.content if answer is not None else text
    items: list[dict[str, Any]] = [reasoning_item(meta, reasoning, status)] if reasoning else []
    if answer is None or not answer.is_call or content.strip():
        part = {"type": "output_text", "text": content, "annotations": []}
        items.append(
            {"type": "message", "id": meta.item_id("msg", 0), "status": status, "role": "assistant", "content": [part]}
        )
    if answer is not None and answer.is_call:
        for i, call in enumerate(answer.calls):
            items.append(
                {
                    "type": "function_call",
                    "id": meta.item_id("fc", i),
                    "call_id": meta.call_id(i),
                    "name": call.name,
                    "arguments": call.arguments or "{}",
                    "status": "completed",
                }
            )
    return items


STATUS = {"stop": "completed", "length": "incomplete", "cancelled": "cancelled", "error": "failed"}


def response_object(
    meta: ResponseMeta,
    text: str | None,
    final: StreamEvent | None,
    output: list[dict[str, Any]] | None = None,
    reasoning: str = "",
) -> dict[str, Any]:
    """A response object: in progress (no final event yet), or finished."""
    body = meta.body
    status = "in_progress" if final is None else STATUS.get(final.finish_reason or "stop", "completed")
    if output is not None:
        items = output
    else:
        items = [] if final is None else output_items(meta, text or "", reasoning=reasoning)
    return {
        "id": meta.id,
        "object": "response",
        "created_at": meta.created_at,
        "status": status,
        "error": {"code": "server_error", "message": final.error or "failed"} if status == "failed" and final else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": meta.model,
        "output": items,
        "parallel_tool_calls": bool(body.get("parallel_tool_calls")),
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True) is not False,
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "metadata": body.get("metadata") or {},
        "usage": _usage(final.counts) if final is not None else None,
    }


class ResponseEvents:
    """The Responses API's stream for one answer: text streams as `response.output_text.delta`s, with
    tools offered too, once the answer is known to be text; a call's item is added once its name is
    whole, and its arguments stream as `response.function_call_arguments.delta`s as they are
    generated. Every event has its number."""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self.text = ""
        self.sequence = 0
        self.started = False
        self.message_open = False
        self.reasoning = ""
        self.reasoning_open = False
        self.first = 0  # the message's (or first call's) output index: 1 after a reasoning item
        self.text_sent = ""  # with tools: the text sent so far
        self.arguments_sent: list[str] = []  # with tools: each call's arguments sent so far

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _open_message(self, out: list[dict[str, Any]], index: int) -> None:
        item = {
            "type": "message",
            "id": self.meta.item_id("msg", 0),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        part = {"type": "output_text", "text": "", "annotations": []}
        out.append(
            self._event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
            )
        )

    def _reasoning(self, out: list[dict[str, Any]], event: StreamEvent) -> None:
        """A thinking model's reasoning: a reasoning item at index 0, its text streamed, closed when
        the answer's text begins (or the answer ends)."""
        if event.reasoning and not self.message_open:
            item_id = self.meta.item_id("rs", 0)
            if not self.reasoning_open:
                item = reasoning_item(self.meta, "", "in_progress")
                out.append(self._event("response.output_item.added", output_index=0, item=item))
                self.reasoning_open, self.first = True, 1
            self.reasoning += event.reasoning
            delta = {"item_id": item_id, "output_index": 0, "content_index": 0, "delta": event.reasoning}
            out.append(self._event("response.reasoning_text.delta", **delta))
        if self.reasoning_open and (event.text or event.is_final):
            self.reasoning_open = False
            done = {"item_id": self.meta.item_id("rs", 0), "output_index": 0, "content_index": 0}
            out.append(self._event("response.reasoning_text.done", **done, text=self.reasoning))
            status = "completed" if not event.is_final else STATUS.get(event.finish_reason or "stop", "completed")
            item = reasoning_item(self.meta, self.reasoning, status)
            out.append(self._event("response.output_item.done", output_index=0, item=item))

    def _text_delta(self, out: list[dict[str, Any]], text: str) -> None:
        if not self.message_open:
            self._open_message(out, self.first)
            self.message_open = True
        delta = {"item_id": self.meta.item_id("msg", 0), "output_index": self.first, "content_index": 0}
        out.append(self._event("response.output_text.delta", **delta, delta=text, logprobs=[]))

    def _tool_form_deltas(self, out: list[dict[str, Any]]) -> None:
        """With tools offered: the answer so far read again, what it added since sent as text deltas,
        or as calls' items (call i at output index `first + i`) and their arguments' deltas."""
        assert self.meta.tool_form is not None
        answer = parse_answer(self.text, self.meta.tool_form)
        if not answer.is_call:
            if answer.content[len(self.text_sent) :]:
                self._text_delta(out, answer.content[len(self.text_sent) :])
                self.text_sent = answer.content
            return
        for i, call in enumerate(answer.calls):
            index = self.first + i
            item_id = self.meta.item_id("fc", i)
            if i >= len(self.arguments_sent):
                item = {
                    "type": "function_call",
                    "id": item_id,
                    "call_id": self.meta.call_id(i),
                    "name": call.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                out.append(self._event("response.output_item.added", output_index=index, item=item))
                self.arguments_sent.append("")
            piece = call.arguments[len(self.arguments_sent[i]) :]
            if piece:
                args = {"item_id": item_id, "output_index": index}
                out.append(self._event("response.function_call_arguments.delta", **args, delta=piece))
                self.arguments_sent[i] = call.arguments

    def __call__(self, event: StreamEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            snapshot = response_object(self.meta, None, None)
            out.append(self._event("response.created", response=snapshot))
            out.append(self._event("response.in_progress", response=snapshot))
        self.text += event.text
        self._reasoning(out, event)
        if self.meta.tool_form is None:
            if event.text:
                self._text_delta(out, event.text)
        else:
            self._tool_form_deltas(out)
        if not event.is_final:
            return out
        final = response_object(self.meta, self.text, event, reasoning=self.reasoning)
        if final["status"] == "failed":
            return [*out, self._event("response.failed", response=final)]
        for index, item in enumerate(final["output"]):
            if item["type"] == "reasoning":
                continue  # streamed as it came
            if item["type"] == "message":
                text = item["content"][0]["text"]
                if not self.message_open:
                    self._open_message(out, index)
                    if text:
                        delta = {"item_id": item["id"], "output_index": index, "content_index": 0, "delta": text}
                        out.append(self._event("response.output_text.delta", **delta, logprobs=[]))
                done = {"item_id": item["id"], "output_index": index, "content_index": 0}
                out.append(self._event("response.output_text.done", **done, text=text, logprobs=[]))
                out.append(self._event("response.content_part.done", **done, part=item["content"][0]))
            else:
                call = index - self.first
                args = {"item_id": item["id"], "output_index": index}
                if call >= len(self.arguments_sent):  # not streamed: added now, whole
                    opening = {**item, "arguments": "", "status": "in_progress"}
                    out.append(self._event("response.output_item.added", output_index=index, item=opening))
                    self.arguments_sent.append("")
                rest = item["arguments"][len(self.arguments_sent[call]) :]
                if rest or not self.arguments_sent[call]:
                    out.append(self._event("response.function_call_arguments.delta", **args, delta=rest))
                out.append(self._event("response.function_call_arguments.done", **args, arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        # An answer cut at max_output_tokens ends with response.completed too, its status "incomplete":
        # the openai SDK's stream helper (and Codex CLI) wait for that event to end a turn.
        out.append(self._event("response.completed", response=final))
        return out


class ResponseStore:
    """Finished responses by id, for `previous_response_id` and GET: the conversation each ends (its
    messages, its output as messages) and its response object. Bounded by bytes (the JSON size of
    what it keeps), count and age; the least recently used goes first."""

    def __init__(self, max_bytes: int, count: int = STORE_COUNT, seconds: float = STORE_SECONDS) -> None:
        self.max_bytes, self.count, self.seconds = max_bytes, count, seconds
        self.nbytes = 0
        # id -> (stored at, conversation, response, bytes, tenant)
        self._items: OrderedDict[str, tuple[float, list[dict[str, Any]], dict[str, Any], int, str | None]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]], tenant: str | None = None) -> bool:
        """Keep a finished response, `tenant`'s alone; False when it alone is over the byte limit."""
        conversation = [*messages, *_as_messages(response["output"])]
        size = len(json.dumps(conversation)) + len(json.dumps(response))
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response["id"])
            self._items[response["id"]] = (time.monotonic(), conversation, response, size, tenant)
            self.nbytes += size
            self._expire()
        return True

    def _drop(self, response_id: str) -> bool:
        found = self._items.pop(response_id, None)
        if found is not None:
            self.nbytes -= found[3]
        return found is not None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items:
            oldest_id, (stored_at, *_rest) = next(iter(self._items.items()))
            over = len(self._items) > self.count or self.nbytes > self.max_bytes
            if not over and now - stored_at <= self.seconds:
                break
            self._drop(oldest_id)
        # Age is counted from when a response was stored; use moves it to the back of the line only.

    def get(self, response_id: str, tenant: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """A stored response of `tenant`'s; another tenant's is as unknown as one never stored."""
        with self._lock:
            self._expire()
            found = self._items.get(response_id)
            if found is not None and not visible_to(found[4], tenant):
                found = None
            if found is not None:
                self._items.move_to_end(response_id)
        if found is None:
            raise ApiError(
                404, f"no stored response {response_id!r} (never stored, deleted, or expired)", code="not_found"
            )
        return found[1], found[2]

    def delete(self, response_id: str, tenant: str | None = None) -> bool:
        with self._lock:
            found = self._items.get(response_id)
            return found is not None and visible_to(found[4], tenant) and self._drop(response_id)

    def __len__(self) -> int:
        return len(self._items)


def _as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in items
        if item["type"] == "function_call"
    ]
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    if calls:
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    return [{"role": "assistant", "content": text}]


def conversation_to_store(data: dict[str, Any], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation a response continues from, as stored: without its `instructions`, which
    apply to one response only (a continuation gives its own, as OpenAI's API has it)."""
    if data.get("instructions") is not None and messages and messages[0].get("role") == "system":
        return messages[1:]
    return messages


def visible_to(owner: str | None, viewer: str | None) -> bool:
    """Whether what `owner` made (a response, a stream) is `viewer`'s to see: a tenant sees its own;
    the owner of the server (None) sees everything (docs/operations.md, "Several clients")."""
    return viewer is None or owner == viewer


def stored_input(data: dict[str, Any], store: ResponseStore, tenant: str | None = None) -> list[dict[str, Any]] | None:
    """The conversation a request continues (previous_response_id), or None."""
    previous = data.get("previous_response_id")
    if previous is None:
        return None
    if not isinstance(previous, str):
        raise bad_param("previous_response_id", "'previous_response_id' must be a string")
    return store.get(previous, tenant)[0]
