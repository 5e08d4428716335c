"""OpenAI's Responses API over HTTP (create, streamed or not; retrieve, delete, cancel), and embeddings.

The same generation path as chat completions; the body's translation, the answer's shape and the
store of finished responses (for `previous_response_id`) are api/responses.py's.
"""

from __future__ import annotations

import asyncio

from ..api.embeddings import embeddings_response, parse_embeddings
from ..api.errors import ApiError
from ..api.openai import GenerationRequest, parse_json_body
from ..api.responses import ResponseEvents, ResponseMeta, ResponseStore, parse_responses, response_object, stored_input
from ..engine import Engine, Request
from .handlers import ApiMixin, GenerationHandler
from .sse import send_sse, step_hub, wait_final

STORE_KEY = "magnitude_response_store"
RUNNING_KEY = "magnitude_running_responses"


def response_store(handler: ApiMixin) -> ResponseStore:
    store: ResponseStore | None = handler.settings.get(STORE_KEY)
    if store is None:
        store = handler.settings[STORE_KEY] = ResponseStore()
    return store


class ResponsesHandler(GenerationHandler):
    kind = "chat"
    id_prefix = "resp"
    prompt_param = "input"

    def _parse(self, body: bytes) -> GenerationRequest:
        data = parse_json_body(body)
        self._data = data
        return parse_responses(data, stored_input(data, response_store(self)))

    async def answer(self, engine: Engine, request: Request, req: GenerationRequest) -> None:
        meta = ResponseMeta(
            request.request_id.replace("resp-", "resp_", 1), engine.model_id, self._data, request.tool_form
        )
        running: dict[str, tuple[Engine, str]] = self.settings.setdefault(RUNNING_KEY, {})
        running[meta.id] = (engine, request.request_id)
        assert request.stream is not None
        try:
            if req.stream:
                self.set_header("X-Completion-Id", request.request_id)
                await send_sse(self, step_hub(self, engine), request.stream, 0, ResponseEvents(meta), named=True)
                final = request.stream.events_after(request.stream.last_id - 1)[-1] if request.stream.closed else None
            else:
                final = await wait_final(self, step_hub(self, engine), request.stream)
                if final is None:
                    engine.cancel(request.request_id, "the client closed its connection before the answer was ready")
                    return
            if final is None:
                return
            response = response_object(meta, request.output_text, final)
            if self._data.get("store") is not False:
                response_store(self).put(response, req.messages or [])
            if not req.stream:
                self.send_json(response)
        finally:
            running.pop(meta.id, None)


class ResponseHandler(ApiMixin):
    """GET a stored response; DELETE it; POST .../cancel a running one."""

    def get(self, response_id: str) -> None:
        try:
            _, response = response_store(self).get(response_id)
        except ApiError as exc:
            self.send_error_json(exc)
            return
        self.send_json(response)

    def delete(self, response_id: str) -> None:
        if not response_store(self).delete(response_id):
            self.send_error_json(ApiError(404, f"no stored response {response_id!r}", code="not_found"))
            return
        self.send_json({"id": response_id, "object": "response", "deleted": True})


class ResponseCancelHandler(ApiMixin):
    async def post(self, response_id: str) -> None:
        running: dict[str, tuple[Engine, str]] = self.settings.get(RUNNING_KEY, {})
        found = running.get(response_id)
        if found is None:
            self.send_error_json(ApiError(404, f"no running response {response_id!r}", code="not_found"))
            return
        engine, request_id = found
        await asyncio.get_running_loop().run_in_executor(None, engine.cancel, request_id, "cancelled by the client")
        self.send_json({"id": response_id, "object": "response", "status": "cancelled"})


class EmbeddingsHandler(ApiMixin):
    """POST /v1/embeddings: vectors computed on a worker thread, beside generation."""

    async def post(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            req = parse_embeddings(self.json_body())
            resident, _ = await self.checkout_model(req.model, None)
            try:
                engine = resident.engine
                vectors, tokens = await loop.run_in_executor(None, engine.embed, req.inputs)
            finally:
                self.pool.checkin(resident)
        except Exception as exc:
            self.send_error_json(exc, "input")
            return
        self.send_json(embeddings_response(engine.model_id, vectors, tokens, req.encoding_format))
