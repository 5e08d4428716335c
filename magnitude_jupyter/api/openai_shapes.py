"""The OpenAI wire format's answers (chat completions and completions): response objects and stream
chunks from the engine's events, tool calls read out of the answer and streamed as deltas."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.streams import StreamEvent, TokenLogprob
from ..engine.tools import ParsedAnswer, parse_answer
from .usage import openai_usage


@dataclass(frozen=True)
class ResponseShape:
    """What every chunk of one generation shares; kept by the server so a resumed stream matches."""

    id: str
    kind: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    include_usage: bool = False
    logprobs: bool = False
    tool_form: str | None = None  # the call form the answer is held to, when the request gave tools

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def call_id(self, index: int) -> str:
        """A tool call's id: the same every time this answer is read, a resumed stream included."""
        return f"call_{self.id.rsplit('-', 1)[-1]}_{index}"

    def finish_reason(self, engine_reason: str | None, answer: ParsedAnswer | None) -> str | None:
        """OpenAI's reason: `tool_calls` when a whole answer called tools, else the engine's own."""
        if answer is not None and answer.is_call and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def logprobs_json(kind: str, entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's logprobs object: chat's `content` list, or the completions API's parallel lists."""
    if kind == "chat":
        return {
            "content": [
                {
                    "token": _token_text(e.token),
                    "logprob": e.logprob,
                    "bytes": list(e.token),
                    "top_logprobs": [{"token": _token_text(t), "logprob": lp, "bytes": list(t)} for t, lp in e.top],
                }
                for e in entries
            ],
            "refusal": None,
        }
    return {
        "tokens": [_token_text(e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(t): lp for t, lp in e.top} for e in entries],
    }


def _choice(
    shape: ResponseShape,
    text: str,
    finish_reason: str | None,
    first: bool,
    delta: bool,
    logprobs: Any,
    reasoning: str = "",
) -> dict[str, Any]:
    if shape.kind == "chat":
        # A thinking model's reasoning: `reasoning_content`, as llama.cpp's server and vLLM name it.
        extra = {"reasoning_content": reasoning} if reasoning else {}
        if delta:
            body: dict[str, Any] = {"content": text, **extra}
            if first:
                body["role"] = "assistant"
            return {"index": 0, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason}
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text, **extra},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _tool_message(shape: ResponseShape, answer: ParsedAnswer) -> dict[str, Any]:
    calls = [
        {"id": shape.call_id(i), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for i, call in enumerate(answer.calls)
    ]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def completion_response(shape: ResponseShape, text: str, events: list[StreamEvent]) -> dict[str, Any]:
    """The whole answer as one object, from every event of its stream (the last one is final)."""
    final = events[-1]
    logprobs = logprobs_json(shape.kind, [e for event in events for e in event.logprobs]) if shape.logprobs else None
    answer = parse_answer(text, shape.tool_form) if shape.tool_form else None
    # The engine's own reason: stop, length, and also cancelled or error, which a client must
    # never mistake for a complete answer (or `tool_calls` for a whole call).
    reasoning = "".join(event.reasoning for event in events)
    finish = shape.finish_reason(final.finish_reason, answer)
    choice = _choice(shape, text, finish, True, False, logprobs, reasoning)
    if answer is not None and answer.is_call:
        choice["message"] = _tool_message(shape, answer)
        if reasoning:
            choice["message"]["reasoning_content"] = reasoning
    return {
        "id": shape.id,
        "object": shape.object,
        "created": shape.created,
        "model": shape.model,
        "choices": [choice],
        "usage": openai_usage(final.counts),
        "timings": final.timings,
        "magnitude": {"finish_reason": final.finish_reason, "error": final.error},
    }


def stream_chunks(shape: ResponseShape, event: StreamEvent) -> list[dict[str, Any]]:
    """The SSE payloads for one engine event (none for a held-back, empty token event)."""
    if not event.is_final and not event.text and not event.reasoning and not event.logprobs and event.id != 1:
        return []
    base = {
        "id": shape.id,
        "object": shape.object + ".chunk" if shape.kind == "chat" else shape.object,
        "created": shape.created,
        "model": shape.model,
    }
    logprobs = logprobs_json(shape.kind, list(event.logprobs)) if shape.logprobs else None
    finish = event.finish_reason if event.is_final else None
    chunk = {
        **base,
        "choices": [
            _choice(shape, event.text, finish, event.id == 1, delta=True, logprobs=logprobs, reasoning=event.reasoning)
        ],
    }
    return _with_final(shape, chunk, event)


def _with_final(shape: ResponseShape, chunk: dict[str, Any], event: StreamEvent) -> list[dict[str, Any]]:
    """The chunk, and on the final event its timings and usage (and the usage-only chunk, if asked)."""
    if not event.is_final:
        return [chunk]
    chunk["timings"] = event.timings
    chunk["usage"] = usage = openai_usage(event.counts)
    chunk["magnitude"] = {"finish_reason": event.finish_reason, "error": event.error}
    chunks = [chunk]
    if shape.include_usage:
        base = {k: chunk[k] for k in ("id", "object", "created", "model")}
        chunks.append({**base, "choices": [], "usage": usage})
    return chunks


class ToolCallDeltas:
    """Stream chunks for an answer held to a tool-call form: text as `content`, calls as
    `tool_calls` deltas (the id and name once, then the arguments in pieces) that assemble into
    the non-streamed answer's calls. Stateful: it reads the answer from the start of the stream."""

    def __init__(self, shape: ResponseShape, text_before: str = "") -> None:
        assert shape.tool_form is not None
        self.shape = shape
        self.text = text_before
        self.sent = parse_answer(text_before, shape.tool_form)

    def __call__(self, event: StreamEvent) -> list[dict[str, Any]]:
        assert self.shape.tool_form is not None
        self.text += event.text
        answer = parse_answer(self.text, self.shape.tool_form)
        delta: dict[str, Any] = {}
        if event.id == 1:
            delta["role"] = "assistant"
        if answer.content[len(self.sent.content) :]:
            delta["content"] = answer.content[len(self.sent.content) :]
        if event.reasoning:
            delta["reasoning_content"] = event.reasoning
        pieces = []
        for i, call in enumerate(answer.calls):
            if i >= len(self.sent.calls):
                function = {"name": call.name, "arguments": call.arguments}
                pieces.append({"index": i, "id": self.shape.call_id(i), "type": "function", "function": function})
            elif call.arguments != self.sent.calls[i].arguments:
                more = call.arguments[len(self.sent.calls[i].arguments) :]
                pieces.append({"index": i, "function": {"arguments": more}})
        if pieces:
            delta["tool_calls"] = pieces
        self.sent = answer
        if not delta and not event.is_final:
            return []
        chunk = {
            "id": self.shape.id,
            "object": "chat.completion.chunk",
            "created": self.shape.created,
            "model": self.shape.model,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": logprobs_json("chat", list(event.logprobs)) if self.shape.logprobs else None,
                    "finish_reason": self.shape.finish_reason(event.finish_reason, answer) if event.is_final else None,
                }
            ],
        }
        return _with_final(self.shape, chunk, event)


def stream_renderer(shape: ResponseShape, text_before: str) -> Callable[[StreamEvent], list[dict[str, Any]]]:
    """How a stream's events become chunks, for a reader starting after `text_before`."""
    if shape.tool_form is not None:
        return ToolCallDeltas(shape, text_before)
    return lambda event: stream_chunks(shape, event)
