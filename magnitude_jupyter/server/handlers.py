"""The HTTP API, shared by the Jupyter extension and `magnitude serve`.

Each handler here is a mixin; a host supplies the base class that authenticates
(`make_routes(base, prefix)` builds the concrete classes). Handlers only translate: the engine
does the work, `protocol` shapes the JSON, `errors` picks the status codes.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from tornado.web import HTTPError, RequestHandler

from ..engine import Engine
from .errors import api_error_from
from .metrics_text import render_metrics
from .protocol import (
    ApiError,
    ResponseShape,
    completion_response,
    parse_generation,
    parse_json_body,
    stream_chunks,
)
from .sse import ENGINE_KEY, send_sse, step_hub, wait_final

MAX_BODY_KEY = "magnitude_max_body_bytes"
DEFAULT_MAX_BODY_BYTES = 1 << 20


class ApiMixin(RequestHandler):
    @property
    def engine(self) -> Engine:
        return self.settings[ENGINE_KEY]

    def send_json(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def send_error_json(self, exc: Exception) -> None:
        err = api_error_from(exc)
        if err.status >= 500 and err.status != 503:
            self.log_exception(type(exc), exc, exc.__traceback__)  # type: ignore[attr-defined]
        for name, value in err.headers.items():
            self.set_header(name, value)
        self.send_json(err.body(), err.status)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Errors raised outside our handlers (auth, unknown method) in OpenAI's shape too."""
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = (exc.log_message if isinstance(exc, HTTPError) and exc.log_message else None) or self._reason
        kind = {401: "authentication_error", 403: "permission_error"}.get(status_code, "invalid_request_error")
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(ApiError(status_code, message, type=kind).body()))

    def check_body_size(self) -> None:
        limit = self.settings.get(MAX_BODY_KEY, DEFAULT_MAX_BODY_BYTES)
        if len(self.request.body) > limit:
            raise ApiError(
                413,
                f"the request body is {len(self.request.body)} bytes; the limit is {limit}",
                code="request_too_large",
            )

    def check_model(self, model: str | None) -> None:
        engine = self.engine
        accepted = {engine.model_id}
        if engine.model_entry is not None:
            accepted |= {engine.model_entry.path.name, str(engine.model_entry.path)}
        if model is not None and model not in accepted:
            raise ApiError(
                404,
                f"model {model!r} is not served here; this server serves {engine.model_id!r}",
                param="model",
                code="model_not_found",
            )


class GenerationHandler(ApiMixin):
    kind = "completion"
    id_prefix = "cmpl"

    async def post(self) -> None:
        try:
            self.check_body_size()
            req = parse_generation(parse_json_body(self.request.body), self.kind)
            self.check_model(req.model)
            request = self.engine.submit(
                req.prompt,
                messages=req.messages,
                params=req.params,
                priority=req.priority,
                request_id=f"{self.id_prefix}-{uuid.uuid4().hex[:24]}",
            )
        except Exception as exc:
            self.send_error_json(exc)
            return
        # The id comes first, in a header: a client can re-attach or cancel before the first token.
        self.set_header("X-Completion-Id", request.request_id)
        shape = ResponseShape(request.request_id, self.kind, self.engine.model_id, include_usage=req.include_usage)
        request.meta["shape"] = shape
        assert request.stream is not None
        if req.stream:
            await send_sse(self, step_hub(self), request.stream, 0, lambda event: stream_chunks(shape, event))
        else:
            final = await wait_final(step_hub(self), request.stream)
            self.send_json(completion_response(shape, request.output_text, final))


class ChatCompletionsHandler(GenerationHandler):
    kind = "chat"
    id_prefix = "chatcmpl"


class CompletionsHandler(GenerationHandler):
    kind = "completion"
    id_prefix = "cmpl"


class StreamHandler(ApiMixin):
    """Re-attach to a generation (`Last-Event-ID` or `?starting_after=N`), or cancel it."""

    async def get(self, stream_id: str) -> None:
        try:
            stream = self.engine.streams.get(stream_id)
            request = self.engine.get_request(stream_id)
            raw = self.request.headers.get("Last-Event-ID") or self.get_query_argument("starting_after", "0")
            try:
                after = int(raw)
            except ValueError:
                raise ApiError(400, f"event id must be an integer, got {raw!r}", param="Last-Event-ID") from None
            if not 0 <= after <= stream.last_id:
                raise ApiError(
                    400,
                    f"event id {after} is beyond this stream's last event ({stream.last_id})",
                    param="Last-Event-ID",
                )
            stream.events_after(after)  # raises StreamGoneError (410) before any byte is sent
        except Exception as exc:
            self.send_error_json(exc)
            return
        shape = request.meta.get("shape") if request is not None else None
        if shape is None:
            shape = ResponseShape(stream_id, "completion", self.engine.model_id)
        await send_sse(self, step_hub(self), stream, after, lambda event: stream_chunks(shape, event))

    def delete(self, stream_id: str) -> None:
        try:
            self.engine.streams.get(stream_id)
        except Exception as exc:
            self.send_error_json(exc)
            return
        self.send_json({"id": stream_id, "object": "stream.cancelled", "cancelled": self.engine.cancel(stream_id)})


class ModelsHandler(ApiMixin):
    async def get(self) -> None:
        engine = self.engine
        info = engine.model_info
        sha256 = await asyncio.get_running_loop().run_in_executor(None, engine.model_sha256)
        self.send_json(
            {
                "object": "list",
                "data": [
                    {
                        "id": engine.model_id,
                        "object": "model",
                        "created": int(engine.started_at_wall),
                        "owned_by": "magnitude",
                        "meta": {**info.to_json(), "sha256": sha256} if info else None,
                    }
                ],
            }
        )


class HealthHandler(ApiMixin):
    def get(self) -> None:
        engine = self.engine
        if engine.ready:
            self.send_json({"status": "ok", "model": engine.model_id})
        else:
            self.set_header("Retry-After", "2")
            self.send_json({"status": engine.state, "model": engine.model_id, "error": engine.load_error}, 503)


class StatusHandler(ApiMixin):
    def get(self) -> None:
        self.send_json(self.engine.status())


class MetricsHandler(ApiMixin):
    def get(self) -> None:
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish(render_metrics(self.engine.metrics, self.engine.status()))


ROUTES: list[tuple[str, type[ApiMixin]]] = [
    (r"v1/chat/completions", ChatCompletionsHandler),
    (r"v1/completions", CompletionsHandler),
    (r"v1/models", ModelsHandler),
    (r"v1/streams/([A-Za-z0-9_\-]+)", StreamHandler),
    (r"health", HealthHandler),
    (r"status", StatusHandler),
    (r"metrics", MetricsHandler),
]


def make_routes(base: type, prefix: str) -> list[tuple[str, type]]:
    """Concrete handler classes on a host's authenticating base, under `prefix` (ending in '/')."""
    routes = []
    for pattern, mixin in ROUTES:
        handler = type(mixin.__name__, (mixin, base), {})
        routes.append((prefix + pattern, handler))
    return routes
