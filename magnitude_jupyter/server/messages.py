"""Anthropic's Messages API over HTTP: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

The same generation path as chat completions (parsing on a worker thread, the model checked out,
the engine's one request type); only the body's translation, the answer's shape and the error shape
are Anthropic's (api/anthropic.py).
"""

from __future__ import annotations

from typing import Any

from ..api.anthropic import MessageEvents, MessageShape, count_tokens_body, error_body, message_object, parse_messages
from ..api.errors import ApiError
from ..api.generation import GenerationRequest, parse_json_body
from ..engine import Engine, Request
from .handlers import ApiMixin, GenerationHandler
from .sse import send_sse, step_hub, wait_final
from .work import ClientGone, off_loop


class AnthropicErrors(ApiMixin):
    def error_body(self, err: ApiError) -> dict[str, Any]:
        return error_body(err)


class MessagesHandler(AnthropicErrors, GenerationHandler):
    kind = "chat"
    id_prefix = "msg"
    prompt_param = "messages"

    def _parse(self, body: bytes) -> GenerationRequest:
        return parse_messages(parse_json_body(body))

    async def answer(self, engine: Engine, request: Request, req: GenerationRequest) -> None:
        shape = MessageShape(
            request.request_id.replace("msg-", "msg_", 1),
            engine.model_id,
            len(request.prompt_tokens),
            tool_form=request.tool_form,
        )
        assert request.stream is not None
        if req.stream:
            self.set_header("X-Completion-Id", request.request_id)
            await send_sse(self, step_hub(self, engine), request.stream, 0, MessageEvents(shape), named=True)
            return
        final = await wait_final(self, step_hub(self, engine), request.stream)
        if final is None:
            engine.cancel(request.request_id, "the client closed its connection before the answer was ready")
            return
        if final.finish_reason == "error":  # the Messages API has no stop reason for it: its error shape
            err = ApiError(500, final.error or "the generation failed", type="api_error")
            self.send_json(self.error_body(err), err.status)
            return
        self.send_json(message_object(shape, request.output_text, final, request.output_reasoning))


class CountTokensHandler(AnthropicErrors):
    """The prompt's tokens as the engine computes them: the template rendered, tools described."""

    async def post(self) -> None:
        size = len(self.request.body)
        try:
            req = await off_loop(self, size, lambda: count_tokens_body(self.json_body()))
            self.authorize(keep_alive=req.keep_alive is not None)
            resident, _ = await self.checkout_model(req.model, req.keep_alive)
            try:
                engine = resident.engine
                tokens = await off_loop(
                    self, size, lambda: engine.prompt_tokens_for(None, req.messages, req.tools), engine.model_id
                )
            finally:
                self.pool.checkin(resident)
        except ClientGone:
            return
        except Exception as exc:
            self.send_error_json(exc)
            return
        self.send_json({"input_tokens": len(tokens)})
