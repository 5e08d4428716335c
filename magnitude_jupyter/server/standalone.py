"""`magnitude serve`: the API on its own tornado server, bound to 127.0.0.1, behind a bearer token."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import secrets
import signal
import threading
from typing import Any
from urllib.parse import urlsplit

import tornado.httpserver
import tornado.netutil
import tornado.web

from ..client.runtime import write_runtime_file
from ..engine.pool import ModelPool
from .handlers import DEFAULT_MAX_BODY_BYTES, MAX_BODY_KEY, ApiMixin, api_key_as_bearer, log_request
from .routes import fallback_route, make_routes
from .sse import POOL_KEY
from .tenants import API_KEYS_KEY, OWNER, Tenant, check_owner_key_apart, tenant_for

log = logging.getLogger("magnitude.serve")
SHUTDOWN_SECONDS = 3.0  # after SIGTERM or SIGINT, the most a graceful shutdown may take
TOKEN_KEY = "magnitude_token"
REMOTE_KEY = "magnitude_allow_remote"


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _hostname(netloc: str) -> str:
    return (urlsplit(f"//{netloc}").hostname or "").lower()


class TokenAuthHandler(tornado.web.RequestHandler):
    """Every request carries `Authorization: Bearer <token>` (or `?token=`), unless auth is off.

    Without a token, only this machine may call, and not through a web page: a request must name a
    loopback host (a DNS-rebinding page names its own) and carry no foreign `Origin` (any page's
    `fetch`, even a "simple" text/plain POST that skips the CORS preflight, sends one).
    """

    tenant: Tenant = OWNER

    def prepare(self) -> None:
        api_key_as_bearer(self)
        expected = self.settings.get(TOKEN_KEY)
        keys = self.settings.get(API_KEYS_KEY, ())
        if expected is None and not keys:
            self._check_local_request()
            return
        header = self.request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() not in ("bearer", "token"):
            given = self.get_query_argument("token", "")
        given = given.strip()
        if given and expected is not None and hmac.compare_digest(given.encode(), expected.encode()):
            return  # the owner's key: every right
        tenant = tenant_for(given, keys) if given else None
        if tenant is None:
            raise tornado.web.HTTPError(401, "a valid token is required: Authorization: Bearer <token>")
        self.tenant = tenant

    def _check_local_request(self) -> None:
        host = _hostname(self.request.host or "")
        if not self.settings.get(REMOTE_KEY) and not is_loopback(host):
            raise tornado.web.HTTPError(
                403, f"host {host!r} is not this machine; without a token only local names work"
            )
        origin = self.request.headers.get("Origin")
        if origin is not None and _hostname(urlsplit(origin).netloc) != host:
            raise tornado.web.HTTPError(403, f"cross-origin requests ({origin}) are refused when auth is off")
        if self.request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
            raise tornado.web.HTTPError(403, "cross-site requests are refused when auth is off")


class RootHandler(ApiMixin, TokenAuthHandler):
    def get(self) -> None:
        pool = self.pool
        resident = pool.resident(None)
        state = resident.engine.state if resident else "unloaded"
        models = [r.entry.alias for r in pool.residents()]
        self.send_json(
            {"service": "magnitude", "model": pool.default_model, "api": "/v1", "state": state, "loaded": models}
        )


def make_app(
    pool: ModelPool, token: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allow_remote: bool = False
) -> tornado.web.Application:
    routes = [(r"/", RootHandler), *make_routes(TokenAuthHandler, "/"), *make_routes(TokenAuthHandler, "/magnitude/")]
    routes.append(fallback_route(TokenAuthHandler, "/"))
    settings: dict[str, Any] = {POOL_KEY: pool, TOKEN_KEY: token, MAX_BODY_KEY: max_body_bytes}
    check_owner_key_apart(token, pool.settings.api_keys)
    settings[API_KEYS_KEY] = pool.settings.api_keys
    settings[REMOTE_KEY] = allow_remote
    settings["log_function"] = log_request
    return tornado.web.Application(routes, **settings)


def resolve_token(token: str | None, no_auth: bool) -> tuple[str | None, bool]:
    """(token, generated?): --token, else MAGNITUDE_TOKEN, else a fresh one; None when auth is off."""
    if no_auth:
        return None, False
    token = token or os.environ.get("MAGNITUDE_TOKEN")
    if token:
        return token, False
    return secrets.token_urlsafe(24), True


async def serve(
    pool: ModelPool,
    host: str,
    port: int,
    token: str | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    announce: Any = print,
) -> None:
    """Listen at once, load the default model in the background, serve until SIGINT/SIGTERM, then shut down."""
    app = make_app(pool, token, max_body_bytes, allow_remote=not is_loopback(host))
    server = tornado.httpserver.HTTPServer(
        app, max_body_size=max(max_body_bytes * 4, 1 << 20), idle_connection_timeout=60
    )
    sockets = tornado.netutil.bind_sockets(port, address=host)
    server.add_sockets(sockets)
    port = sockets[0].getsockname()[1]  # the real one when asked for port 0
    runtime_file = write_runtime_file(host, port, token, pool.default_model)
    pool.start()
    announce(f"magnitude serving {pool.default_model} at http://{host}:{port}/v1 (model loading in the background)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        announce("magnitude: shutting down")
        # Whatever a worker thread is doing (a native call cannot be interrupted), the process ends.
        deadline = threading.Timer(SHUTDOWN_SECONDS, os._exit, (0,))
        deadline.daemon = True
        deadline.start()
        server.stop()
        await loop.run_in_executor(None, pool.shutdown)
        runtime_file.unlink(missing_ok=True)
