"""OpenAI's embeddings API over HTTP: vectors computed on one worker thread, beside generation;
the body's parsing and the answer's shape are api/embeddings.py's."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from ..api.embeddings import embeddings_response, parse_embeddings
from ..engine.runner_api import EmbeddingCancelled
from .handlers import ApiMixin
from .work import ClientGone, off_loop

EMBED_THREAD_KEY = "magnitude_embedding_thread"


def embedding_thread(handler: ApiMixin) -> ThreadPoolExecutor:
    """The one thread embeddings run on: llama.cpp's OpenMP keeps a team of threads per calling
    thread, and teams left spinning on other threads slow every call (docs/decisions.md)."""
    executor: ThreadPoolExecutor | None = handler.settings.get(EMBED_THREAD_KEY)
    if executor is None:
        executor = handler.settings[EMBED_THREAD_KEY] = ThreadPoolExecutor(1, thread_name_prefix="magnitude-embed")
    return executor


class EmbeddingsHandler(ApiMixin):
    """POST /v1/embeddings: vectors computed on a worker thread, beside generation."""

    _stop: threading.Event | None = None

    def on_connection_close(self) -> None:
        if self._stop is not None:
            self._stop.set()  # the vectors not computed yet are not computed
        super().on_connection_close()

    async def post(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = threading.Event()
        try:
            req = await off_loop(self, len(self.request.body), lambda: parse_embeddings(self.json_body()))
            resident, _ = await self.checkout_model(req.model, None)
            try:
                engine, stop = resident.engine, self._stop
                vectors, tokens = await loop.run_in_executor(
                    embedding_thread(self), lambda: engine.embed(req.inputs, stop)
                )
            finally:
                self.pool.checkin(resident)
        except (ClientGone, EmbeddingCancelled):
            return
        except Exception as exc:
            self.send_error_json(exc, "input")
            return
        self.send_json(embeddings_response(engine.model_id, vectors, tokens, req.encoding_format))
