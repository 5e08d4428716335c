"""One way a parsed request reaches the engine, whatever hosts it: the HTTP server's handlers, the
in-process client Dask workers use, and anything else. Every field the wire formats understood
(tools, cache salt, user, origin, thinking, tenant) goes through, so two hosts cannot disagree."""

from __future__ import annotations

from ..engine import Engine, Request
from .generation import GenerationRequest


def submit(
    engine: Engine,
    req: GenerationRequest,
    request_id: str,
    *,
    arrival: float | None = None,
    load_ms: float | None = None,
    tenant: str | None = None,
) -> Request:
    """Queue `req` on `engine` (see Engine.submit for what it raises)."""
    return engine.submit(
        req.prompt,
        messages=req.messages,
        params=req.params,
        priority=req.priority,
        request_id=request_id,
        arrival_time=arrival,
        load_ms=load_ms,
        tools=req.tools,
        cache_salt=req.cache_salt,
        user=req.user,
        thinking=req.thinking,
        origin=req.origin,
        tenant=tenant,
    )
