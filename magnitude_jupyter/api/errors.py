"""API errors: the error every wire format answers with, and engine errors to HTTP statuses, in one place."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from ..engine import EngineError, OverloadedError, PromptTooLongError, StreamGoneError, UnknownStreamError
from ..engine.chat import ChatFormatError
from ..engine.pool import ModelLoadError, NoRoomError
from ..engine.slo import Shed
from ..models.registry import ModelNotFoundError


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


def refuse_unknown_fields(
    data: dict[str, Any], accepted: Collection[str], refused: Mapping[str, str], code: str | None = None
) -> None:
    """A field outside `accepted` is refused by name (with `refused`'s reason where it has one), never
    ignored: a client must not believe a setting took effect."""
    for name, value in data.items():
        if value is None or name in accepted:
            continue
        reason = refused.get(name, f"'{name}' is not a field this server understands")
        raise ApiError(400, reason, param=name, code=code)


def api_error_from(exc: Exception, prompt_param: str = "messages") -> ApiError:
    """`prompt_param` names the field that holds the prompt: `messages` for chat, `prompt` for completions."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return ApiError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, OverloadedError):
        retry = max(1, round(exc.retry_after))
        return ApiError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})
    if isinstance(exc, ChatFormatError):
        return ApiError(400, str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, ModelNotFoundError):
        return ApiError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, UnknownStreamError):
        return ApiError(404, str(exc), code="stream_not_found")
    if isinstance(exc, StreamGoneError):
        return ApiError(410, str(exc), code="stream_gone")
    if isinstance(exc, Shed):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        return ApiError(503, str(exc), type="server_error", code="slo_shed", headers=headers)
    if isinstance(exc, NoRoomError):
        headers = {"Retry-After": str(round(exc.retry_after))}
        return ApiError(503, str(exc), type="server_error", code="model_busy", headers=headers)
    if isinstance(exc, ModelLoadError):
        return ApiError(500, str(exc), type="server_error", param="model", code="model_load_failed")
    if isinstance(exc, EngineError):
        return ApiError(503, str(exc), type="server_error", code="model_not_ready", headers={"Retry-After": "2"})
    if isinstance(exc, ValueError):  # SamplingParams.validate and friends name the field
        return ApiError(400, str(exc), param=getattr(exc, "param", None), code="invalid_value")
    return ApiError(500, f"internal error: {exc}", type="server_error")
