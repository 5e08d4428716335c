"""HTTP + SSE client for any OpenAI-compatible server, ours first.

Finding a server: `MAGNITUDE_URL` (+ `MAGNITUDE_TOKEN`); else a running Jupyter server with our
extension (from jupyter-server's runtime files); else a running `magnitude serve` (from ours);
else start `magnitude serve` in the background once, and let later kernels reuse it.

A stream that breaks mid-answer is resumed from the last event id seen, so no text is lost or
repeated; an interrupt (KeyboardInterrupt) cancels the generation on the server.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard
from urllib.parse import quote

import httpx
import numpy as np

from .runtime import STALL_SECONDS, LocalServer, ServerStartError, jupyter_servers, runtime_dir, serve_runtime_files

RESUMABLE_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout, httpx.ConnectError)


class ClientError(RuntimeError):
    """A request failed; the message is meant to be shown to a person as it is."""

    def __init__(
        self, message: str, status: int | None = None, code: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status == 429 or self.status >= 500


@dataclass
class StreamResult:
    id: str | None = None
    text: str = ""
    finish_reason: str | None = None
    engine_finish_reason: str | None = None  # ours adds stop/length/cancelled/error under "magnitude"
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    model: str | None = None
    resumed: int = 0  # how many times the stream was re-attached after a broken connection
    raw_final: dict[str, Any] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # per token, when the request asked
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape, assembled from the deltas
    reasoning: str = ""  # a thinking model's reasoning (`reasoning_content`), apart from `text`

    def add_tool_call_deltas(self, pieces: list[dict[str, Any]]) -> None:
        """Put streamed tool-call pieces together by index: id and name once, arguments in parts."""
        for piece in pieces:
            index = piece.get("index", len(self.tool_calls))
            while len(self.tool_calls) <= index:
                self.tool_calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            call = self.tool_calls[index]
            call["id"] = piece.get("id") or call["id"]
            function = piece.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""


def _error_from(response: httpx.Response) -> ClientError:
    try:
        error = response.json().get("error") or {}
        message = error.get("message") or response.text
        code = error.get("code")
    except (ValueError, AttributeError):
        message, code = response.text[:300] or response.reason_phrase, None
    retry = response.headers.get("Retry-After")
    return ClientError(
        f"{response.status_code}: {message}",
        response.status_code,
        code,
        float(retry) if retry and retry.replace(".", "", 1).isdigit() else None,
    )


def iter_sse(lines: Iterator[str]) -> Iterator[tuple[int | None, str]]:
    """(event id, data) pairs of a text/event-stream."""
    event_id: int | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            with contextlib.suppress(ValueError):
                event_id = int(line[3:].strip())
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        yield event_id, "\n".join(data)


def is_magnitude_status(status: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """Whether a /status body is a magnitude server's."""
    return status is not None and "kv_cells_total" in status


CALL_TIMEOUT_S = 30.0  # a plain call (status, models, health): a server that does not answer is named


class Client:
    """One server: `api_base` is the URL that `/v1/...` hangs from."""

    def __init__(
        self,
        api_base: str,
        token: str | None = None,
        timeout: float = 600.0,
        source: str = "",
        model: str | None = None,
    ) -> None:
        self.api_base = api_base.rstrip("/")
        self.token = token
        self.source = source
        self.model = model  # asked for by every generation that names none, and by status()
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=5.0))

    def __repr__(self) -> str:
        return f"Client({self.api_base!r}, source={self.source!r})"

    def close(self) -> None:
        self.http.close()

    # -- plain calls ----------------------------------------------------------------------

    def _call(
        self, method: str, path: str, timeout: float | None = CALL_TIMEOUT_S, body: dict[str, Any] | None = None
    ) -> httpx.Response:
        """One plain call, within `timeout` seconds (None: the client's own, for waits such as a load)."""
        limit = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            response = self.http.request(
                method, self.api_base + path, json=body, timeout=httpx.Timeout(limit, connect=5.0)
            )
        except httpx.TimeoutException:
            raise ClientError(
                f"the server at {self.api_base} did not answer {method} {path} within {limit:g} s"
            ) from None
        except httpx.TransportError as exc:
            raise ClientError(f"cannot reach {self.api_base}: {exc}") from None
        if response.status_code >= 400:
            raise _error_from(response)
        return response

    def _get(self, path: str) -> httpx.Response:
        return self._call("GET", path)

    def _post(self, path: str, timeout: float | None = CALL_TIMEOUT_S) -> httpx.Response:
        return self._call("POST", path, timeout)

    def health(self) -> dict[str, Any]:
        return self._get("/health").json()

    def wait_ready(self, on_progress: Callable[[str], None] | None = None, stall_s: float = STALL_SECONDS) -> None:
        """Wait until the server's default model is loaded, for as long as its load makes progress
        (`/health` says what it is doing, and that changes); `on_progress` is told each phase. A load
        that stands still for `stall_s` seconds, or fails, is a ClientError saying where it stood."""
        moved, seen, phase = time.monotonic(), None, "loading the model"
        while True:
            try:
                response = self.http.get(self.api_base + "/health", timeout=httpx.Timeout(10.0, connect=5.0))
            except httpx.TransportError as exc:
                raise ClientError(f"cannot reach {self.api_base}: {exc}") from None
            if response.status_code == 200:
                return
            body = response.json() if response.status_code == 503 else {}
            if response.status_code != 503 or body.get("status") == "failed":
                raise ClientError(f"the server's model did not load: {body.get('error') or response.text[:300]}")
            state = (body.get("phase"), body.get("progress"))
            if state != seen:
                if body.get("phase") and body.get("phase") != phase and on_progress is not None:
                    on_progress(body["phase"])
                seen, moved, phase = state, time.monotonic(), body.get("phase") or phase
            elif time.monotonic() - moved > stall_s:
                raise ClientError(f"the server's model load made no progress for {stall_s:.0f} s while {phase}")
            time.sleep(0.25)

    def status(self, model: str | None = None) -> dict[str, Any]:
        """The engine's figures: the default model's, or `model`'s (a magnitude server with many models)."""
        model = model or self.model
        return self._get("/status" + (f"?model={quote(model)}" if model else "")).json()

    def is_magnitude(self) -> bool:
        """Whether this server is a magnitude server (its /status has the engine's figures), not another
        OpenAI-compatible one."""
        return is_magnitude_status(self.status())

    def with_timeout(self, timeout: float) -> Client:
        """A client of its own on the same server, with another timeout (close it when done)."""
        return Client(self.api_base, self.token, timeout=timeout, source=self.source, model=self.model)

    def for_model(self, model: str | None) -> Client:
        """The same server, every request on `model` (calibration of one model of many)."""
        return Client(self.api_base, self.token, source=self.source, model=model) if model else self

    def _with_model(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"model": self.model, **body} if self.model else body

    def load_model(self, model: str, origin: str | None = None) -> dict[str, Any]:
        """Make a model resident on a magnitude server (waits for the load): {id, loaded, load_ms}.
        `origin`: who waits for it (a notebook cell), listed in /status while it loads."""
        body = {"origin": origin} if origin else None
        return self._call("POST", f"/models/{quote(model, safe='')}/load", None, body).json()

    def load_showing_progress(self, model: str, on_progress: Callable[[str], None], origin: str | None = None) -> None:
        """Load `model` if it is not resident, telling `on_progress` each phase of its load (from the
        engine's /status) while the load call waits."""
        import threading

        errors: list[BaseException] = []

        def load() -> None:
            try:
                self.load_model(model, origin)
            except BaseException as exc:  # handed to the caller
                errors.append(exc)

        loader = threading.Thread(target=load, name="magnitude-load", daemon=True)
        loader.start()
        shown = None
        while loader.is_alive():
            loader.join(0.25)
            try:
                phase = self.status(model).get("load_phase")
            except ClientError:
                continue
            if phase and phase != shown and phase != "ready":
                shown = phase
                on_progress(phase)
        if errors:
            raise errors[0]

    def unload_model(self, model: str) -> dict[str, Any]:
        """Unload a model now, or once its requests end: {id, loaded, unload_when_idle}."""
        return self._post(f"/models/{quote(model, safe='')}/unload").json()

    def models(self) -> list[dict[str, Any]]:
        return self._get("/v1/models").json().get("data", [])

    def embed(self, inputs: list[str], model: str | None = None) -> list[np.ndarray]:
        """Unit vectors for texts, in order (one /v1/embeddings call; float32, sent as base64)."""
        body = self._with_model({"input": inputs, "encoding_format": "base64", **({"model": model} if model else {})})
        data = self._call("POST", "/v1/embeddings", None, body).json()["data"]
        return [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in data]

    def cancel(self, completion_id: str) -> None:
        with contextlib.suppress(httpx.TransportError):
            self.http.delete(f"{self.api_base}/v1/streams/{completion_id}", timeout=5)

    # -- generation -------------------------------------------------------------------------

    def chat(self, messages: list[dict[str, Any]], **body: Any) -> StreamResult:
        """One chat completion, streamed and collected (see `stream_chat` for the pieces)."""
        result = StreamResult()
        for _ in self.stream_chat(messages, result=result, **body):
            pass
        return result

    def open_chat_stream(self, messages: list[dict[str, Any]], **body: Any) -> httpx.Response:
        """Start a streamed chat completion and return once the server answered, its body unread: the
        status, and (from our server) the completion id in `X-Completion-Id` before any token."""
        payload = {**self._with_model(body), "messages": messages, "stream": True}
        try:
            request = self.http.build_request("POST", self.api_base + "/v1/chat/completions", json=payload)
            return self.http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise ClientError(f"cannot reach {self.api_base}: {exc}") from None

    def stream_chat(
        self, messages: list[dict[str, Any]], result: StreamResult | None = None, max_resumes: int = 5, **body: Any
    ) -> Iterator[str]:
        """Yield text pieces of a streamed chat completion; `result` is filled in as it goes.

        A broken connection is resumed from the last event id seen (`Last-Event-ID`); leaving early
        (an interrupt, an error, closing the iterator) cancels the generation on the server.
        """
        result = result if result is not None else StreamResult()
        payload = {
            **self._with_model(body),
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return self._attach(
            result, lambda: self.http.stream("POST", self.api_base + "/v1/chat/completions", json=payload), max_resumes
        )

    def follow(
        self, completion_id: str, after: int = 0, result: StreamResult | None = None, max_resumes: int = 5
    ) -> Iterator[str]:
        """Yield the text of a generation already running on the server, from after event `after`."""
        result = result if result is not None else StreamResult()
        result.id = completion_id
        return self._attach(result, None, max_resumes, after)

    def _reattach(self, completion_id: str, last_id: int) -> Any:
        return self.http.stream(
            "GET", f"{self.api_base}/v1/streams/{completion_id}", headers={"Last-Event-ID": str(last_id)}
        )

    def _attach(self, result: StreamResult, open_first: Any, max_resumes: int, last_id: int = 0) -> Iterator[str]:
        """Read a stream to its end: open it (the POST, or a re-attach), read, and after a broken
        connection re-attach from the last event seen. Whatever ends it early, the generation is
        cancelled on the server, so nothing generates on for nobody."""
        connect = open_first
        try:
            while True:
                try:
                    opened = connect() if connect is not None else self._reattach(str(result.id), last_id)
                    with opened as response:
                        if response.status_code >= 400:
                            response.read()
                            raise _error_from(response)
                        result.id = result.id or response.headers.get("X-Completion-Id")  # ours sends it first
                        for event_id, piece in self._read(response, result):
                            last_id = event_id or last_id
                            if piece:
                                yield piece
                    if result.finish_reason is not None:
                        return
                except RESUMABLE_ERRORS as exc:
                    if result.id is None:
                        raise ClientError(f"cannot reach {self.api_base}: {exc}") from None
                except httpx.TransportError as exc:
                    raise ClientError(f"connection to {self.api_base} failed: {exc}") from None
                connect = None
                if result.resumed >= max_resumes:
                    raise ClientError(f"the stream {result.id} broke {result.resumed} times; giving up")
                result.resumed += 1
                time.sleep(min(0.2 * 2**result.resumed, 5.0))
        except BaseException:
            if result.id is not None and result.finish_reason is None:
                self.cancel(result.id)
            raise

    def _read(self, response: httpx.Response, result: StreamResult) -> Iterator[tuple[int | None, str]]:
        for event_id, data in iter_sse(response.iter_lines()):
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk and "choices" not in chunk:
                raise ClientError(chunk["error"].get("message", "stream error"))
            result.id = result.id or chunk.get("id")
            result.model = result.model or chunk.get("model")
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            if chunk.get("timings"):
                result.timings = chunk["timings"]
            piece = ""
            for choice in chunk.get("choices") or []:
                piece += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                result.reasoning += (choice.get("delta") or {}).get("reasoning_content") or ""
                result.add_tool_call_deltas((choice.get("delta") or {}).get("tool_calls") or [])
                result.logprobs += (choice.get("logprobs") or {}).get("content") or []
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
                    result.engine_finish_reason = (chunk.get("magnitude") or {}).get("finish_reason")
                    result.raw_final = chunk
            result.text += piece
            yield event_id, piece


# -- finding a server -----------------------------------------------------------------------------


def _try(api_base: str, token: str | None, source: str) -> Client | None:
    client = Client(api_base, token, source=source)
    try:
        response = client.http.get(client.api_base + "/health", timeout=2)
        if response.status_code in (200, 503):
            return client
    except httpx.TransportError:
        pass
    client.close()
    return None


def start_background_server(on_progress: Callable[[str], None] | None = None) -> Client:
    """Start `magnitude serve` detached from this process, so that it outlives the kernel and is reused.
    Waits as long as its start makes progress; `on_progress` is told each phase of the load."""
    folder = runtime_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # Owner-only, as the runtime files with the token are; the child keeps its own copy of the descriptor.
    log_fd = os.open(folder / "serve.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(log_fd, 0o600)  # a log made by an older version may be readable by others
    with os.fdopen(log_fd, "ab") as log:
        try:
            server = LocalServer(detached=True, log=log, on_progress=on_progress)
        except ServerStartError as exc:
            raise ClientError(f"{exc}; see {folder / 'serve.log'}") from None
    return Client(server.url, server.token, source="magnitude serve (started)")


def discover(start: bool = True, on_progress: Callable[[str], None] | None = None) -> Client:
    """The server a notebook should talk to (see the module docstring for the order)."""
    url = os.environ.get("MAGNITUDE_URL")
    if url:
        return Client(url, os.environ.get("MAGNITUDE_TOKEN"), source="MAGNITUDE_URL")
    for info in jupyter_servers():
        client = _try(info["url"].rstrip("/") + "/magnitude", info.get("token"), "jupyter server extension")
        if client is not None:
            return client
    for info in serve_runtime_files():
        client = _try(info["url"], info.get("token"), "magnitude serve")
        if client is not None:
            return client
    if not start:
        raise ClientError("no magnitude server found; set MAGNITUDE_URL or run `magnitude serve`")
    return start_background_server(on_progress)
