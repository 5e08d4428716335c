"""The Jupyter server extension: the API under `{base_url}magnitude/`, behind Jupyter's own auth."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from jupyter_server.base.handlers import JupyterHandler
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web
from traitlets import Bool, Integer, Unicode

from ..api.errors import ApiError
from ..config import EngineSettings, load_settings
from ..engine.pool import ModelPool
from ..settings_surface import engine_traits, slo_settings, with_slo
from ..workshop import COPY_FOLDER, workshop_notebook
from .handlers import DEFAULT_MAX_BODY_BYTES, MAX_BODY_KEY, ApiMixin, api_key_as_bearer
from .routes import fallback_route, make_routes
from .sse import POOL_KEY

AUTH_RESOURCE = "magnitude"


class JupyterAuthHandler(ExtensionHandlerMixin, JupyterHandler):
    """Jupyter decides who may call: its token (`Authorization: token|Bearer ...`) or login cookie."""

    auth_resource = AUTH_RESOURCE

    async def prepare(self) -> None:  # type: ignore[override]
        api_key_as_bearer(self)
        await super().prepare()
        if self.current_user is None:
            raise web.HTTPError(403, "authentication required: use the Jupyter server's token or login")
        action = "read" if self.request.method in ("GET", "HEAD", "OPTIONS") else "write"
        if not self.authorizer.is_authorized(self, self.current_user, action, AUTH_RESOURCE):
            raise web.HTTPError(403, f"not authorized to {action} {AUTH_RESOURCE}")


class WorkshopHandler(ApiMixin, JupyterAuthHandler):
    """POST: copy a workshop notebook from the package into `magnitude-workshop/` (once) and say where."""

    async def post(self, name: str) -> None:
        import nbformat
        from jupyter_core.utils import ensure_async

        try:
            source = workshop_notebook(name)
        except KeyError:
            self.send_error_json(ApiError(404, f"no workshop notebook called {name!r}", code="not_found"))
            return
        contents = self.contents_manager
        path = f"{COPY_FOLDER}/{name}"
        if not await ensure_async(contents.dir_exists(COPY_FOLDER)):
            await ensure_async(contents.save({"type": "directory"}, COPY_FOLDER))
        if not await ensure_async(contents.file_exists(path)):  # never overwrite a learner's edits
            notebook = nbformat.read(source, as_version=4)
            await ensure_async(contents.save({"type": "notebook", "format": "json", "content": notebook}, path))
        self.send_json({"path": path})


class MagnitudeAppBase(ExtensionApp):
    name = "magnitude_jupyter"
    description = "A local-LLM inference service inside Jupyter."
    load_other_extensions = True

    model = Unicode(None, allow_none=True, config=True, help="Model alias or .gguf path (default: the config file's).")
    max_body_bytes = Integer(DEFAULT_MAX_BODY_BYTES, config=True, help="Largest request body accepted (413 above).")
    load_model_at_start = Bool(
        False,
        config=True,
        help="Load the default model when the Jupyter server starts (a shared workshop server); "
        "otherwise it loads on the first request that needs it.",
    )

    def initialize_settings(self) -> None:
        settings = load_settings()
        names = {f.name for f in fields(EngineSettings)}
        overrides: dict[str, Any] = {
            name: getattr(self, name) for name in names if self.has_trait(name) and getattr(self, name) is not None
        }
        slo = {s.name: getattr(self, s.name) for s in slo_settings()}
        self.pool = ModelPool(with_slo(settings, slo), self.model, overrides=overrides)
        self.settings.update({POOL_KEY: self.pool, MAX_BODY_KEY: self.max_body_bytes})

    def initialize_handlers(self) -> None:
        self.handlers.extend(make_routes(JupyterAuthHandler, "/magnitude/"))
        self.handlers.append((r"/magnitude/workshop/([A-Za-z0-9_.\-]+)", WorkshopHandler))
        self.handlers.append(fallback_route(JupyterAuthHandler, "/magnitude/"))

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        # JupyterLab starts light: the default model loads on the first request that needs it (or now,
        # on its engine thread, with load_model_at_start; /health answers 503 until it is ready).
        self.pool.start(load_default=self.load_model_at_start)

    async def stop_extension(self) -> None:
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self.pool.shutdown)


# Every engine setting is a traitlet too, from its one definition (settings_surface.py).
MagnitudeApp = type("MagnitudeApp", (MagnitudeAppBase,), {"__module__": __name__, **engine_traits()})
