"""OpenAI's Responses API over HTTP (create, streamed or not; retrieve, delete, cancel).

The same generation path as chat completions; the body's translation, the answer's shape and the
store of finished responses (for `previous_response_id`) are api/responses.py's.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..api.errors import ApiError
from ..api.generation import GenerationRequest, parse_json_body
from ..api.responses import (
    ResponseEvents,
    ResponseMeta,
    ResponseStore,
    conversation_to_store,
    parse_responses,
    response_object,
    stored_input,
    visible_to,
)
from ..engine import Engine, Request
from ..engine.streams import StreamEvent
from .handlers import EVENT_ID, ApiMixin, GenerationHandler
from .sse import Render, send_sse, step_hub, wait_closed, wait_final

STORE_KEY = "magnitude_response_store"
LIVE_KEY = "magnitude_live_responses"
LIVE_COUNT = 10_000  # about as many as the engine keeps streams for


@dataclass
class LiveResponse:
    """A response the engine is making, or made recently: enough to stream it again, cancel it, or
    keep it once finished (even when its client has gone). `nbytes` estimates what it holds."""

    engine: Engine
    request: Request
    meta: ResponseMeta
    messages: list[dict[str, Any]]
    nbytes: int
    tenant: str | None = None  # whose it is: another tenant's is as unknown as one never made
    finished: dict[str, Any] | None = None  # the response object, once the answer is done
    deleted: bool = False  # DELETE came while it was being made: never stored

    @property
    def store(self) -> bool:
        return self.meta.body.get("store") is not False and not self.deleted


class LiveResponses:
    """Responses being made or made recently, by id, bounded by count and by bytes (the same limit as
    the store, `response_store_mib`): the oldest go first. A `store: false` response leaves once its
    answer is done: not stored means gone when its stream ends."""

    def __init__(self, max_bytes: int, count: int = LIVE_COUNT) -> None:
        self.max_bytes, self.count = max_bytes, count
        self.nbytes = 0
        self._items: OrderedDict[str, LiveResponse] = OrderedDict()

    def add(self, live: LiveResponse) -> None:
        self._items[live.meta.id] = live
        self.nbytes += live.nbytes
        while self._items and (len(self._items) > self.count or self.nbytes > self.max_bytes):
            oldest = next(iter(self._items.values()))
            self.remove(oldest.meta.id, oldest.tenant)

    def get(self, response_id: str, tenant: str | None = None) -> LiveResponse | None:
        live = self._items.get(response_id)
        return live if live is not None and visible_to(live.tenant, tenant) else None

    def remove(self, response_id: str, tenant: str | None = None) -> LiveResponse | None:
        if self.get(response_id, tenant) is None:
            return None
        live = self._items.pop(response_id, None)
        if live is not None:
            self.nbytes -= live.nbytes
        return live

    def __len__(self) -> int:
        return len(self._items)


def response_store(handler: ApiMixin) -> ResponseStore:
    store: ResponseStore | None = handler.settings.get(STORE_KEY)
    if store is None:
        store = handler.settings[STORE_KEY] = ResponseStore(handler.pool.settings.response_store_bytes())
    return store


def live_responses(handler: ApiMixin) -> LiveResponses:
    live: LiveResponses | None = handler.settings.get(LIVE_KEY)
    if live is None:
        live = handler.settings[LIVE_KEY] = LiveResponses(handler.pool.settings.response_store_bytes())
    return live


def keep(handler: ApiMixin, live: LiveResponse, final: StreamEvent) -> dict[str, Any]:
    """The finished response object, made and stored (for previous_response_id and GET, unless
    `store: false` or deleted) once: a stream sent again neither stores it again nor brings back a
    deleted one. A response not stored leaves the live registry here."""
    if live.finished is None:
        live.finished = response_object(
            live.meta, live.request.output_text, final, reasoning=live.request.output_reasoning
        )
        if live.store:
            response_store(handler).put(live.finished, live.messages, live.tenant)
        else:
            live_responses(handler).remove(live.meta.id, live.tenant)
    return live.finished


def rendering(handler: ApiMixin, live: LiveResponse, starting_after: int = -1) -> Render:
    """The response's events from its first, those numbered above `starting_after` sent; the
    finished response is stored before its last event is written."""
    events = ResponseEvents(live.meta)

    def render(event: StreamEvent) -> list[dict[str, Any]]:
        payloads = events(event)
        if event.is_final:
            keep(handler, live, event)
        return [p for p in payloads if p["sequence_number"] > starting_after]

    return render


class ResponsesHandler(GenerationHandler):
    kind = "chat"
    id_prefix = "resp"
    prompt_param = "input"

    def _parse(self, body: bytes) -> GenerationRequest:
        data = parse_json_body(body)
        self._data = data
        self._body_bytes = len(body)
        return parse_responses(data, stored_input(data, response_store(self), self.tenant.scope))

    async def answer(self, engine: Engine, request: Request, req: GenerationRequest) -> None:
        # The response echoes its request's settings, not its input (the conversation is kept apart).
        echoed = {key: value for key, value in self._data.items() if key != "input"}
        meta = ResponseMeta(request.request_id.replace("resp-", "resp_", 1), engine.model_id, echoed, request.tool_form)
        messages = conversation_to_store(self._data, req.messages or [])
        # What it holds: the body's JSON twice over (the echo and the conversation), and its tokens.
        nbytes = 2 * self._body_bytes + 8 * len(request.prompt_tokens or ())
        live = LiveResponse(engine, request, meta, messages, nbytes, self.tenant.scope)
        live_responses(self).add(live)
        assert request.stream is not None
        hub = step_hub(self, engine)
        if req.stream:
            self.set_header("X-Completion-Id", request.request_id)
            await send_sse(self, hub, request.stream, 0, rendering(self, live), named=True)
            # Kept at its last event; or, when the client left mid-stream, once the answer is done.
            keep(self, live, await wait_closed(hub, request.stream))
            return
        final = await wait_final(self, hub, request.stream)
        if final is None:
            engine.cancel(request.request_id, "the client closed its connection before the answer was ready")
            return
        self.send_json(keep(self, live, final))


def parse_sequence_number(raw: str) -> int:
    """A sequence number as the API writes them: plain decimal, no sign, no leading zeros."""
    if not EVENT_ID.fullmatch(raw):
        raise ApiError(
            400,
            f"starting_after is a sequence number (0, 1, 2, ... without leading zeros), got {raw!r}",
            param="starting_after",
        )
    return int(raw)


class ResponseHandler(ApiMixin):
    """GET a response (stored, or still being made; `?stream=true` streams its events again,
    `&starting_after=N` from the one after N); DELETE a stored one."""

    async def get(self, response_id: str) -> None:
        live = live_responses(self).get(response_id, self.tenant.scope)
        try:
            streamed = self.get_query_argument("stream", "false").lower() in ("true", "1")
            if streamed:
                raw = self.get_query_argument("starting_after", None, strip=False)
                after = -1 if raw is None else parse_sequence_number(raw)
                if live is None:
                    raise ApiError(
                        404,
                        f"response {response_id!r} cannot be streamed again: unknown, or made too long ago",
                        code="not_found",
                    )
                stream = live.request.stream
                assert stream is not None
                stream.events_after(0)  # raises StreamGoneError (410) before any byte is sent
            elif live is not None and not live.request.is_finished:
                self.send_json(response_object(live.meta, None, None))
                return
            else:
                _, response = response_store(self).get(response_id, self.tenant.scope)
        except Exception as exc:
            self.send_error_json(exc)
            return
        if not streamed:
            self.send_json(response)
            return
        assert live is not None and live.request.stream is not None
        hub = step_hub(self, live.engine)
        await send_sse(self, hub, live.request.stream, 0, rendering(self, live, after), named=True)

    async def delete(self, response_id: str) -> None:
        """Delete a stored response, or one being made: it is cancelled, and never stored."""
        live = live_responses(self).remove(response_id, self.tenant.scope)
        running = live is not None and not live.request.is_finished
        if live is not None and running:
            live.deleted = True
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, live.engine.cancel, live.request.request_id, "deleted by the client")
        stored = response_store(self).delete(response_id, self.tenant.scope)
        if not (stored or running):
            self.send_error_json(ApiError(404, f"no stored response {response_id!r}", code="not_found"))
            return
        self.send_json({"id": response_id, "object": "response", "deleted": True})


class ResponseCancelHandler(ApiMixin):
    async def post(self, response_id: str) -> None:
        live = live_responses(self).get(response_id, self.tenant.scope)
        if live is None:
            self.send_error_json(ApiError(404, f"no response {response_id!r} is being made", code="not_found"))
            return
        if live.request.is_finished:
            self.send_error_json(ApiError(400, f"response {response_id!r} has already finished", code="not_running"))
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, live.engine.cancel, live.request.request_id, "cancelled by the client")
        snapshot = response_object(live.meta, None, None)
        self.send_json({**snapshot, "status": "cancelled"})
