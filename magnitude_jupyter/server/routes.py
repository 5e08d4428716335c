"""Every route of the HTTP API, for both hosts (the Jupyter extension and `magnitude serve`)."""

from __future__ import annotations

from typing import Any

from ..api.anthropic import error_body
from ..api.errors import ApiError
from .embeddings import EmbeddingsHandler
from .handlers import (
    ApiMixin,
    ChatCompletionsHandler,
    CompletionsHandler,
    HealthHandler,
    MetricsHandler,
    ModelActionHandler,
    ModelsHandler,
    PropsHandler,
    RouterModelActionHandler,
    StatusHandler,
    StreamHandler,
)
from .messages import CountTokensHandler, MessagesHandler
from .responses import ResponseCancelHandler, ResponseHandler, ResponsesHandler


class UnknownRouteHandler(ApiMixin):
    """Any other path under the API: a 404 in JSON, in the shape of the API the path belongs to."""

    def error_body(self, err: ApiError) -> dict[str, Any]:
        return error_body(err) if "/v1/messages" in self.request.path else err.body()

    def _not_found(self, *args: Any) -> None:
        message = f"no route {self.request.method} {self.request.path} (see docs/http-api.md)"
        self.send_error_json(ApiError(404, message, code="not_found"))

    get = post = put = delete = patch = _not_found


ROUTES: list[tuple[str, type[ApiMixin]]] = [
    (r"v1/chat/completions", ChatCompletionsHandler),
    (r"v1/completions", CompletionsHandler),
    (r"v1/messages", MessagesHandler),
    (r"v1/messages/count_tokens", CountTokensHandler),
    (r"v1/responses", ResponsesHandler),
    (r"v1/embeddings", EmbeddingsHandler),
    (r"v1/responses/([A-Za-z0-9_\-]+)", ResponseHandler),
    (r"v1/responses/([A-Za-z0-9_\-]+)/cancel", ResponseCancelHandler),
    (r"v1/models", ModelsHandler),
    (r"v1/models/([A-Za-z0-9_.\-]+)", ModelsHandler),
    (r"models/([A-Za-z0-9_.\-]+)/(load|unload)", ModelActionHandler),
    (r"models", ModelsHandler),  # llama-server's router: the models and their status
    (r"models/(load|unload)", RouterModelActionHandler),  # ... {"model": ...} in the body
    (r"v1/streams/([A-Za-z0-9_\-]+)", StreamHandler),
    (r"health", HealthHandler),
    (r"props", PropsHandler),  # llama-server's, where agents learn the context window
    (r"v1/props", PropsHandler),
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


def fallback_route(base: type, prefix: str) -> tuple[str, type]:
    """The last route of a host: every other path under `prefix` answers a JSON 404."""
    return (prefix + ".*", type(UnknownRouteHandler.__name__, (UnknownRouteHandler, base), {}))
