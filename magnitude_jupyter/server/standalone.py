"""`magnitude serve`: the API on its own tornado server, bound to 127.0.0.1, behind a bearer token."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import secrets
import signal
from pathlib import Path
from typing import Any

import tornado.httpserver
import tornado.netutil
import tornado.web

from ..engine import Engine
from .handlers import DEFAULT_MAX_BODY_BYTES, ENGINE_KEY, MAX_BODY_KEY, ApiMixin, make_routes

log = logging.getLogger("magnitude.serve")
TOKEN_KEY = "magnitude_token"


class TokenAuthHandler(tornado.web.RequestHandler):
    """Every request carries `Authorization: Bearer <token>` (or `?token=`), unless auth is off."""

    def prepare(self) -> None:
        expected = self.settings.get(TOKEN_KEY)
        if expected is None:
            return
        header = self.request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() not in ("bearer", "token"):
            given = self.get_query_argument("token", "")
        if not given or not hmac.compare_digest(given.strip().encode(), expected.encode()):
            self.set_header("WWW-Authenticate", 'Bearer realm="magnitude"')
            raise tornado.web.HTTPError(401, "a valid token is required: Authorization: Bearer <token>")


class RootHandler(ApiMixin, TokenAuthHandler):
    def get(self) -> None:
        self.send_json(
            {"service": "magnitude", "model": self.engine.model_id, "api": "/v1", "state": self.engine.state}
        )


def make_app(
    engine: Engine, token: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> tornado.web.Application:
    routes = [(r"/", RootHandler), *make_routes(TokenAuthHandler, "/"), *make_routes(TokenAuthHandler, "/magnitude/")]
    return tornado.web.Application(
        routes,  # type: ignore[arg-type]
        **{ENGINE_KEY: engine, TOKEN_KEY: token, MAX_BODY_KEY: max_body_bytes},
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def runtime_dir() -> Path:
    return Path(os.environ.get("MAGNITUDE_RUNTIME_DIR") or Path.home() / ".magnitude" / "runtime")


def write_runtime_file(host: str, port: int, token: str | None, model: str) -> Path:
    """Where clients on this machine find the server and its token; readable by this user only."""
    folder = runtime_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    path = folder / f"serve-{port}.json"
    url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    info = {"url": f"http://{url_host}:{port}", "token": token, "pid": os.getpid(), "model": model}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(info, fh)
    return path


def resolve_token(token: str | None, no_auth: bool) -> tuple[str | None, bool]:
    """(token, generated?): --token, else MAGNITUDE_TOKEN, else a fresh one; None when auth is off."""
    if no_auth:
        return None, False
    token = token or os.environ.get("MAGNITUDE_TOKEN")
    if token:
        return token, False
    return secrets.token_urlsafe(24), True


async def serve(
    engine: Engine,
    host: str,
    port: int,
    token: str | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    announce: Any = print,
) -> None:
    """Listen at once, load the model in the background, serve until SIGINT/SIGTERM, then shut down."""
    app = make_app(engine, token, max_body_bytes)
    server = tornado.httpserver.HTTPServer(
        app, max_body_size=max(max_body_bytes * 4, 1 << 20), idle_connection_timeout=60
    )
    sockets = tornado.netutil.bind_sockets(port, address=host)
    server.add_sockets(sockets)
    port = sockets[0].getsockname()[1]  # the real one when asked for port 0
    runtime_file = write_runtime_file(host, port, token, engine.model_id)
    engine.start(wait=False)
    announce(f"magnitude serving {engine.model_id} at http://{host}:{port}/v1 (model loading in the background)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        announce("magnitude: shutting down")
        server.stop()
        await loop.run_in_executor(None, engine.shutdown)
        runtime_file.unlink(missing_ok=True)
