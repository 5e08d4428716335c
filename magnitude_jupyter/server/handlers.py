"""The HTTP API, shared by the Jupyter extension and `magnitude serve`.

Each handler here is a mixin; a host supplies the base class that authenticates
(`make_routes(base, prefix)` builds the concrete classes). Handlers only translate: the engine
does the work, `api.openai` shapes the JSON, `api.errors` picks the status codes. Parsing a body and
submitting it (JSON, chat template, tokenizing, grammars) run on a worker thread, never on the
event loop that every other client is waiting on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from tornado.web import HTTPError, RequestHandler, stream_request_body

from ..api.errors import ApiError, api_error_from
from ..api.generation import GenerationRequest, parse_json_body, short_string
from ..api.openai import parse_generation
from ..api.openai_shapes import ResponseShape, completion_response, stream_renderer
from ..api.responses import visible_to
from ..api.status import model_json, pool_json, props_json, status_json
from ..api.submit import submit
from ..engine import Engine, Priority, Request
from ..engine.pool import ROOM_POLL_SECONDS, ROOM_WAIT_SECONDS, ModelPool, NoRoomError, NotResidentError, Resident
from ..engine.request import prompt_head
from ..engine.slo import Shed, check_shed
from ..engine.stats import LoadWaiter
from .sse import POOL_KEY, send_sse, step_hub, wait_final
from .tenants import OWNER, Tenant
from .work import ClientGone, off_loop

MAX_BODY_KEY = "magnitude_max_body_bytes"
SHAPES_KEY = "magnitude_response_shapes"
REGISTRY_KEY = "magnitude_metrics_registry"
DEFAULT_MAX_BODY_BYTES = 1 << 20
# A body declared larger than this is refused before it is read; smaller oversized bodies are read
# and dropped, so that every client, even one that does not wait for `100 Continue`, gets the 413.
DRAIN_LIMIT_BYTES = 64 << 20
EVENT_ID = re.compile(r"0|[1-9][0-9]{0,17}")


def api_key_as_bearer(handler: RequestHandler) -> None:
    """Anthropic's clients send their key as `x-api-key`: both hosts' auth read it as a bearer token."""
    key = handler.request.headers.get("x-api-key")
    if key and "Authorization" not in handler.request.headers:
        handler.request.headers["Authorization"] = f"Bearer {key}"


def redact_token(uri: str) -> str:
    """A request URI fit for a log: the value of any `token` query argument replaced."""
    parts = urlsplit(uri)
    if "token" not in parts.query:
        return uri
    query = [(k, "[secret]" if k == "token" else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return urlunsplit(parts._replace(query=urlencode(query, safe="[]")))


def client_program(user_agent: str | None) -> str | None:
    """A client's program as its User-Agent names it first ("OpenAI/Python 1.99.9"), bounded, for the
    panel to show a request that gives no origin or user; None without one."""
    if not user_agent:
        return None
    words = user_agent.split()
    first = words[0] if words and "/" in words[0] else user_agent
    product = f"{first} {words[1]}" if first.endswith("/Python") and len(words) > 1 else first
    return "".join(c for c in product if c.isprintable())[:MAX_PROGRAM_CHARS] or None


MAX_PROGRAM_CHARS = 48


def log_request(handler: RequestHandler) -> None:
    """The access log's line for a request, as tornado writes it, with the reason of an error: a 4xx
    line that says why (the reason on one line, bounded: it may quote what a client sent)."""
    from tornado.log import access_log

    status = handler.get_status()
    write = access_log.info if status < 400 else access_log.warning if status < 500 else access_log.error
    reason = getattr(handler, "error_reason", None)
    said = ": " + "".join(c if c.isprintable() else " " for c in reason)[:MAX_LOGGED_REASON] if reason else ""
    write("%d %s %.2fms%s", status, handler._request_summary(), 1000.0 * handler.request.request_time(), said)


MAX_LOGGED_REASON = 300


class ApiMixin(RequestHandler):
    connection_gone = False  # the client closed its connection while we were answering
    error_reason: str | None = None  # the message of the error this request was answered with
    _wake: asyncio.Event | None = None
    tenant: Tenant = OWNER  # who is asking: the host's auth sets it (server/tenants.py)

    @property
    def pool(self) -> ModelPool:
        return self.settings[POOL_KEY]

    def _request_summary(self) -> str:
        return f"{self.request.method} {redact_token(self.request.uri or '')} ({self.request.remote_ip})"

    def on_connection_close(self) -> None:
        self.connection_gone = True
        if self._wake is not None:
            self._wake.set()
        super().on_connection_close()

    def wake_on_close(self, wake: asyncio.Event | None) -> None:
        """Set `wake` when the client goes away, so a waiting reader notices at once."""
        self._wake = wake

    async def checkout_model(
        self, name: str | None, keep_alive: float | None, waiter: Callable[[float], LoadWaiter] | None = None
    ) -> tuple[Resident, float | None]:
        """The model for one request, loaded, and the milliseconds its load took (None when it was
        resident), without blocking the loop: waits for room while busy models leave none, and for
        the load, listed in /status meanwhile as `waiter(since)` makes it (made only for a load, not
        for every request). A tenant without the `models` right gets resident models only: a 403
        for any other. The caller hands it back with `pool.checkin`."""
        loop = asyncio.get_running_loop()
        pool = self.pool
        started = time.monotonic()
        may_load = self.tenant.models
        while True:
            try:
                resident = await loop.run_in_executor(None, pool.checkout, name, keep_alive, may_load)
                break
            except NotResidentError as exc:
                raise self.tenant.refuse(f"load models ({exc}; it may use the models that are)", "model") from None
            except NoRoomError:
                if time.monotonic() - started > ROOM_WAIT_SECONDS:
                    raise
                await asyncio.sleep(ROOM_POLL_SECONDS)
        waited = resident.engine.state == "loading"
        try:
            with pool.waiting_for_load(resident, waiter(started) if waited and waiter is not None else None):
                while resident.engine.state == "loading":
                    await asyncio.sleep(0.05)
            pool.check_loaded(resident)
        except BaseException:
            pool.checkin(resident)
            raise
        return resident, ((time.monotonic() - started) * 1000 if waited else None)

    def authorize(self, batch: bool = False, keep_alive: bool = False) -> None:
        """Refuse (403) what this request's tenant may not do: batch priority, keeping or unloading models."""
        if batch and not self.tenant.batch:
            raise self.tenant.refuse("send priority 'batch'", "priority")
        if keep_alive and not self.tenant.models:
            raise self.tenant.refuse("set keep_alive (it loads and unloads models)", "keep_alive")

    def send_json(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def json_body(self) -> dict[str, Any]:
        """The request body as JSON, within the body limit (handlers that read the whole body at once)."""
        limit = self.settings.get(MAX_BODY_KEY, DEFAULT_MAX_BODY_BYTES)
        if len(self.request.body) > limit:
            size = len(self.request.body)
            raise ApiError(413, f"the request body is {size} bytes; the limit is {limit}", code="request_too_large")
        return parse_json_body(self.request.body)

    def error_body(self, err: ApiError) -> dict[str, Any]:
        """An error in the shape of the API this route belongs to (OpenAI's unless a route says)."""
        return err.body()

    def send_error_json(self, exc: Exception, prompt_param: str = "messages") -> None:
        err = api_error_from(exc, prompt_param)
        self.error_reason = err.message
        if err.status >= 500 and err.status != 503:
            self.log_exception(type(exc), exc, exc.__traceback__)
        for name, value in err.headers.items():
            self.set_header(name, value)
        self.send_json(self.error_body(err), err.status)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Errors raised outside our handlers (auth, unknown method) in OpenAI's shape too."""
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ApiError):
            err = exc
        else:
            message = (exc.log_message if isinstance(exc, HTTPError) and exc.log_message else None) or self._reason
            kind = {401: "authentication_error", 403: "permission_error"}.get(status_code, "invalid_request_error")
            err = ApiError(status_code, message, type=kind)
        self.error_reason = err.message
        if status_code == 401:
            # send_error() clears the headers set before the error: set the challenge here.
            self.set_header("WWW-Authenticate", 'Bearer realm="magnitude"')
        for name, value in err.headers.items():
            self.set_header(name, value)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(self.error_body(err)))

    def remember_shape(self, shape: ResponseShape) -> None:
        shapes: OrderedDict[str, ResponseShape] = self.settings.setdefault(SHAPES_KEY, OrderedDict())
        shapes[shape.id] = shape
        while len(shapes) > 10_000:  # about as many as the engine keeps streams for
            shapes.popitem(last=False)

    def shape_of(self, completion_id: str, engine: Engine) -> ResponseShape:
        """The shape a generation's chunks were sent in, so a resumed stream continues it."""
        shape = self.settings.get(SHAPES_KEY, {}).get(completion_id)
        if shape is None:
            kind = "chat" if completion_id.startswith("chatcmpl-") else "completion"
            shape = ResponseShape(completion_id, kind, engine.model_id)
        return shape


@stream_request_body
class GenerationHandler(ApiMixin):
    kind = "completion"
    id_prefix = "cmpl"
    prompt_param = "prompt"

    _body: bytearray
    _body_size = 0

    @property
    def body_limit(self) -> int:
        return self.settings.get(MAX_BODY_KEY, DEFAULT_MAX_BODY_BYTES)

    async def prepare(self) -> None:
        authenticated = super().prepare()  # the host's auth: sync or async
        if inspect.isawaitable(authenticated):
            await authenticated
        if self._finished:
            return
        self._body = bytearray()
        declared = int(self.request.headers.get("Content-Length") or 0)
        if declared > DRAIN_LIMIT_BYTES:
            self.send_error_json(self.too_large(declared))
            return
        self.request.connection.set_max_body_size(DRAIN_LIMIT_BYTES)  # type: ignore[union-attr]

    def data_received(self, chunk: bytes) -> None:
        self._body_size += len(chunk)
        if self._body_size <= self.body_limit:
            self._body += chunk

    def too_large(self, size: int) -> ApiError:
        return ApiError(
            413, f"the request body is {size} bytes; the limit is {self.body_limit}", code="request_too_large"
        )

    def _parse(self, body: bytes) -> GenerationRequest:
        return parse_generation(parse_json_body(body), self.kind)

    def _submit(self, engine: Engine, req: GenerationRequest, arrival: float, load_ms: float | None) -> Request:
        # With `slo.shed`, an interactive request that would wait past the TTFT objective is told now.
        if not self.tenant.never_shed:
            check_shed(
                self.pool.settings.model_slo(engine.model_id),
                lambda: engine.predicted_wait_s(req.priority),
                engine.model_id,
                engine.release_unread,
            )
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"
        return submit(engine, req, request_id, arrival=arrival, load_ms=load_ms, tenant=self.tenant.scope)

    async def post(self) -> None:
        # On worker threads: parsing (JSON, schema grammars), then submitting (chat template,
        # tokenizing); between them, on the loop, waiting for the model if it is not resident.
        try:
            if self._body_size > self.body_limit:
                raise self.too_large(self._body_size)
            arrival = time.monotonic()
            body = bytes(self._body)
            req = await off_loop(self, len(body), lambda: self._parse(body))
            if req.origin is None and req.user is None:  # the panel names it after its client program
                req.origin = client_program(self.request.headers.get("User-Agent"))
            self.authorize(req.priority is Priority.BATCH, req.keep_alive is not None)
            try:
                engine, request = await self._submit_on(req.model, req, arrival)
            except Shed as shed:
                fallback = self.pool.settings.model_slo(shed.model).fallback_model
                if fallback is None or fallback == shed.model:
                    raise
                # The objective's fallback model takes it, if its own queue keeps the objective.
                engine, request = await self._submit_on(fallback, req, arrival)
        except ClientGone:
            return
        except Exception as exc:
            self.send_error_json(exc, self.prompt_param)
            return
        await self.answer(engine, request, req)

    async def _submit_on(self, model: str | None, req: GenerationRequest, arrival: float) -> tuple[Engine, Request]:
        """Submit to `model`'s engine (loaded first if need be): the engine and the request."""

        def waiter(since: float) -> LoadWaiter:
            head = prompt_head(req.prompt, req.messages)
            return LoadWaiter.since_then(since, req.priority.name.lower(), req.origin or req.user, head)

        resident, load_ms = await self.checkout_model(model, req.keep_alive, waiter)
        try:
            engine = resident.engine
            request = await off_loop(
                self, self._body_size, lambda: self._submit(engine, req, arrival, load_ms), engine.model_id
            )
            return engine, request
        finally:
            self.pool.checkin(resident)

    async def answer(self, engine: Engine, request: Request, req: GenerationRequest) -> None:
        """Stream or send the answer in this route's API (OpenAI's here)."""
        shape = ResponseShape(
            request.request_id,
            self.kind,
            engine.model_id,
            include_usage=req.include_usage,
            logprobs=req.logprobs,
            tool_form=request.tool_form,
        )
        self.remember_shape(shape)
        assert request.stream is not None
        if req.stream:
            # The id comes first, in a header: a client can re-attach or cancel before the first token.
            self.set_header("X-Completion-Id", request.request_id)
            await send_sse(self, step_hub(self, engine), request.stream, 0, stream_renderer(shape, ""))
            return
        final = await wait_final(self, step_hub(self, engine), request.stream)
        if final is None:
            # Nobody can read a non-streamed answer once its client has gone: stop generating it now.
            engine.cancel(request.request_id, "the client closed its connection before the answer was ready")
            return
        self.send_json(completion_response(shape, request.output_text, request.stream.events_after(0)))


class ChatCompletionsHandler(GenerationHandler):
    kind = "chat"
    id_prefix = "chatcmpl"
    prompt_param = "messages"


class CompletionsHandler(GenerationHandler):
    kind = "completion"
    id_prefix = "cmpl"
    prompt_param = "prompt"


def parse_event_id(raw: str) -> int:
    """An SSE event id as a client sends it back: a plain decimal number, 0 for 'from the start'."""
    if not EVENT_ID.fullmatch(raw):
        if raw.startswith("-") and raw[1:].isdigit():
            raise ApiError(400, f"event ids start at 0 (the whole stream); got {raw}", param="Last-Event-ID")
        raise ApiError(400, f"an event id is a plain decimal number, got {raw!r}", param="Last-Event-ID")
    return int(raw)


class StreamHandler(ApiMixin):
    """Re-attach to a generation (`Last-Event-ID` or `?starting_after=N`), or cancel it."""

    def _find(self, stream_id: str) -> tuple[Engine, Any]:
        """The stream, if it is this tenant's (the owner sees all): another tenant's answers as if it
        did not exist."""
        engine, stream = self.pool.find_stream(stream_id)
        try:
            owner = engine.tenant_of(stream_id)
        except KeyError:
            owner = None
        if not visible_to(owner, self.tenant.scope):
            raise ApiError(404, f"no stream {stream_id!r}", code="stream_not_found")
        return engine, stream

    async def get(self, stream_id: str) -> None:
        try:
            engine, stream = self._find(stream_id)
            header = self.request.headers.get("Last-Event-ID")
            raw = header if header is not None else self.get_query_argument("starting_after", "0", strip=False)
            after = parse_event_id(raw)
            if after > stream.last_id:
                raise ApiError(
                    400,
                    f"event id {after} is beyond this stream's last event ({stream.last_id})",
                    param="Last-Event-ID",
                )
            stream.events_after(after)  # raises StreamGoneError (410) before any byte is sent
            shape = self.shape_of(stream_id, engine)
            # Tool-call deltas continue from the answer so far, so those events must still be held.
            text_before = "".join(e.text for e in stream.events_after(0)[:after]) if shape.tool_form else ""
        except Exception as exc:
            self.send_error_json(exc)
            return
        await send_sse(self, step_hub(self, engine), stream, after, stream_renderer(shape, text_before))

    def delete(self, stream_id: str) -> None:
        try:
            engine, _ = self._find(stream_id)
        except Exception as exc:
            self.send_error_json(exc)
            return
        self.send_json({"id": stream_id, "object": "stream.cancelled", "cancelled": engine.cancel(stream_id)})


class ModelsHandler(ApiMixin):
    """Every model this server can serve, resident or not, with its memory and settings."""

    async def get(self, model_id: str | None = None) -> None:
        loop = asyncio.get_running_loop()
        try:
            if model_id is not None:
                entry = self.pool.resolve(model_id)
                self.send_json(await loop.run_in_executor(None, model_json, self.pool, entry))
                return
            self.send_json({"object": "list", "data": await loop.run_in_executor(None, pool_json, self.pool)})
        except Exception as exc:
            self.send_error_json(exc, "model")


class PropsHandler(ApiMixin):
    """llama-server's `/props` (and `/v1/props`): the default model's context window and slots, as
    agent frameworks probe for them (`?model=` for another)."""

    async def get(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            entry = self.pool.resolve(self.get_query_argument("model", None))
            self.send_json(await loop.run_in_executor(None, props_json, self.pool, entry))
        except Exception as exc:
            self.send_error_json(exc, "model")


class ModelActionHandler(ApiMixin):
    """POST models/{id}/load (waits until it is ready) and models/{id}/unload (now, or once idle)."""

    async def post(self, model_id: str, action: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            if not self.tenant.models:
                raise self.tenant.refuse(f"{action} models", "model")
            if action == "load":
                origin = self._origin()
                waiter = functools.partial(LoadWaiter.since_then, priority="interactive", origin=origin)
                resident, load_ms = await self.checkout_model(model_id, None, waiter)
                self.pool.checkin(resident)
                load = round(load_ms, 1) if load_ms else None
                body = {"id": resident.entry.alias, "loaded": True, "load_ms": load, "success": True}
            else:
                entry = self.pool.resolve(model_id)
                unloaded = await loop.run_in_executor(None, self.pool.unload, model_id)
                body = {"id": entry.alias, "loaded": not unloaded, "unload_when_idle": not unloaded, "success": True}
        except Exception as exc:
            self.send_error_json(exc, "model")
            return
        self.send_json(body)

    def _origin(self) -> str | None:
        """Who waits for this load (a notebook cell), as an optional body {"origin": ...} says."""
        if not self.request.body:
            return None
        return short_string(self.json_body(), "origin")


class RouterModelActionHandler(ModelActionHandler):
    """llama-server's router routes, POST models/load and models/unload with {"model": ...}: the same
    actions (Pi's llama.cpp provider loads a model so before it asks)."""

    async def post(self, action: str) -> None:  # type: ignore[override]
        try:
            model = short_string(self.json_body(), "model")
            if model is None:
                raise ApiError(400, "'model' names the model to load or unload", param="model")
        except Exception as exc:
            self.send_error_json(exc, "model")
            return
        await super().post(model, action)


class HealthHandler(ApiMixin):
    """200 when the default model is ready (or deliberately unloaded: it loads on demand)."""

    def get(self) -> None:
        pool = self.pool
        resident = pool.resident(None)
        if resident is None or resident.engine.ready:
            self.send_json({"status": "ok", "model": pool.default_model})
            return
        engine = resident.engine
        self.set_header("Retry-After", "2")
        body: dict[str, Any] = {"status": engine.state, "model": engine.model_id, "error": engine.load_error}
        # What the load is doing, and how often that changed: a waiter keeps waiting while it moves.
        body |= {"phase": engine.load_phase, "progress": engine.load_phase_changes}
        self.send_json(body, 503)


class StatusHandler(ApiMixin):
    """The default model's engine (or `?model=`'s), plus every resident model in `models`."""

    def get(self) -> None:
        pool = self.pool
        try:
            name = self.get_query_argument("model", None)
            engine = pool.status_engine(name)
            stats = engine.stats() if engine is not None else pool.unloaded_stats(name)
        except Exception as exc:
            self.send_error_json(exc, "model")
            return
        body = status_json(stats, pool, engine)
        if self.tenant.scope is not None:  # one of several tenants: the server's figures, not others' requests
            body["requests"], body["recent"] = [], []
        self.send_json(body)


class MetricsHandler(ApiMixin):
    def get(self) -> None:
        # prometheus_client is imported at the first scrape: a server nobody scrapes does without it.
        from .metrics import make_registry, render_metrics

        registries = self.settings.setdefault(REGISTRY_KEY, {})  # one per viewer: the owner's, each tenant's
        registry = registries.get(self.tenant.scope)
        if registry is None:
            registry = registries[self.tenant.scope] = make_registry(self.pool, self.tenant.scope)
        body, content_type = render_metrics(registry)
        self.set_header("Content-Type", content_type)
        self.finish(body)
