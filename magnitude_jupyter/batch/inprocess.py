"""`EngineClient`: the batch code's `Client`, over an `Engine` in this process instead of HTTP.

A Dask worker scores its partitions with the engine it holds (see `dask.py`): the same request
bodies go through the same protocol parsing, the same engine errors become the same `ClientError`s
(so retries, the overflow policy and JSON schemas behave exactly as against a server), without a
socket in between.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..api.errors import ApiError, api_error_from
from ..api.openai import parse_generation
from ..api.openai_shapes import ResponseShape
from ..api.submit import submit
from ..api.usage import openai_usage
from ..client.http import ClientError, StreamResult
from ..engine import Engine
from ..engine.tools import parse_answer

STREAM_TIMEOUT_S = 600.0


def _client_error(exc: Exception) -> ClientError:
    err = exc if isinstance(exc, ApiError) else api_error_from(exc)
    retry = err.headers.get("Retry-After")
    return ClientError(err.message, status=err.status, code=err.code, retry_after=float(retry) if retry else None)


class EngineClient:
    """Enough of `Client` for `score_dataframe`: `stream_chat`, `cancel`, `models`, `close`."""

    def __init__(self, engine: Engine, source: str = "in-process") -> None:
        self.engine = engine
        self.api_base = f"inprocess://{engine.model_id}"
        self.token: str | None = None
        self.source = source
        self.model: str | None = None

    def with_timeout(self, timeout: float) -> EngineClient:
        return self

    def models(self) -> list[dict[str, Any]]:
        info = self.engine.model_info
        meta = {**info.to_json(), "sha256": self.engine.model_sha256()} if info else None
        return [{"id": self.engine.model_id, "meta": meta}]

    def status(self, model: str | None = None) -> dict[str, Any]:
        from ..api.status import status_json

        return status_json(self.engine.stats())

    def chat(self, messages: list[dict[str, Any]], **body: Any) -> StreamResult:
        result = StreamResult()
        for _ in self.stream_chat(messages, result=result, **body):
            pass
        return result

    def cancel(self, completion_id: str) -> None:
        self.engine.cancel(completion_id, "the batch was interrupted")

    def embed(self, inputs: list[str], model: str | None = None) -> list[np.ndarray]:
        if model not in (None, self.engine.model_id):
            raise ClientError(f"this engine serves {self.engine.model_id!r}, not {model!r}", status=404)
        try:
            vectors, _ = self.engine.embed(inputs)
        except Exception as exc:
            raise _client_error(exc) from None
        return vectors

    def close(self) -> None:
        pass

    def _read_calls(self, result: StreamResult, request_id: str, tool_form: str) -> None:
        shape = ResponseShape(request_id, "chat", self.engine.model_id, tool_form=tool_form)
        answer = parse_answer(result.text, tool_form)
        result.finish_reason = shape.finish_reason(result.engine_finish_reason, answer)
        if answer.is_call:
            result.text = answer.content
            result.tool_calls = [
                {"id": shape.call_id(i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(answer.calls)
            ]

    def stream_chat(
        self, messages: list[dict[str, Any]], result: StreamResult | None = None, max_resumes: int = 0, **body: Any
    ) -> Iterator[str]:
        result = result if result is not None else StreamResult()
        try:
            req = parse_generation({**body, "messages": messages}, "chat")
            if req.model not in (None, self.engine.model_id):
                raise ApiError(404, f"this worker's engine serves {self.engine.model_id!r}, not {req.model!r}")
            request = submit(self.engine, req, f"chatcmpl-{uuid.uuid4().hex[:24]}")
        except Exception as exc:
            raise _client_error(exc) from None
        return self._follow(request.request_id, result, request.tool_form)

    def _follow(self, request_id: str, result: StreamResult, tool_form: str | None = None) -> Iterator[str]:
        """The answer's text as it comes; with tools, the calls it makes are read at its end into
        `result.tool_calls` (OpenAI's shape, as the HTTP client assembles them) and `result.text`
        keeps only its content."""
        result.id, result.model = request_id, self.engine.model_id
        finished = False
        try:
            for event in self.engine.stream(request_id, timeout=STREAM_TIMEOUT_S):
                result.logprobs += [
                    {
                        "token": lp.token.decode("utf-8", "replace"),
                        "logprob": lp.logprob,
                        "top_logprobs": [{"token": t.decode("utf-8", "replace"), "logprob": v} for t, v in lp.top],
                    }
                    for lp in event.logprobs
                ]
                if event.text:
                    result.text += event.text
                    result.reasoning += event.reasoning
                    yield event.text
                if event.is_final:
                    finished = True
                    result.finish_reason = result.engine_finish_reason = event.finish_reason
                    if tool_form is not None:
                        self._read_calls(result, request_id, tool_form)
                    result.usage, result.timings = openai_usage(event.counts), event.timings
                    result.raw_final = {"magnitude": {"finish_reason": event.finish_reason, "error": event.error}}
        finally:
            if not finished:  # left early (an interrupt, an error): stop generating it
                self.engine.cancel(request_id, "the reader went away")
