"""The extension inside a real jupyter-server (pytest-jupyter), with the real engine behind it."""

from __future__ import annotations

import asyncio
import json

import pytest
from tornado.httpclient import HTTPClientError

pytestmark = pytest.mark.model

ROUTES = [
    ("GET", "magnitude/health"),
    ("GET", "magnitude/status"),
    ("GET", "magnitude/metrics"),
    ("GET", "magnitude/v1/models"),
    ("POST", "magnitude/v1/chat/completions"),
    ("POST", "magnitude/v1/completions"),
    ("GET", "magnitude/v1/streams/cmpl-abc"),
    ("DELETE", "magnitude/v1/streams/cmpl-abc"),
    ("POST", "magnitude/v1/messages"),
    ("POST", "magnitude/v1/messages/count_tokens"),
    ("POST", "magnitude/v1/responses"),
    ("GET", "magnitude/v1/responses/resp_abc"),
    ("POST", "magnitude/v1/embeddings"),
]


@pytest.fixture
def jp_server_config():
    return {
        "ServerApp": {"jpserver_extensions": {"magnitude_jupyter": True}},
        "MagnitudeApp": {"parallel": 4, "ctx_size": 2048},
    }


async def start_and_wait_ready(serverapp, jp_fetch, timeout=60.0):
    """pytest-jupyter does not run the server's start hooks: run them as `jupyter server` does, then wait."""
    await serverapp.extension_manager.start_all_extensions()
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            response = await jp_fetch("magnitude", "health")
            return json.loads(response.body)
        except HTTPClientError as exc:
            if exc.code != 503 or asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.parametrize(("method", "path"), ROUTES)
async def test_every_route_refuses_unauthenticated(jp_fetch, method, path):
    body = b"{}" if method == "POST" else None
    with pytest.raises(HTTPClientError) as info:
        await jp_fetch(*path.split("/"), method=method, body=body, headers={"Authorization": ""})
    assert info.value.code in (401, 403)
    error = json.loads(info.value.response.body)["error"]
    assert error["type"] in ("authentication_error", "permission_error")


async def test_chat_completion_streams_and_status_shows_it(jp_fetch, jp_serverapp):
    assert (await start_and_wait_ready(jp_serverapp, jp_fetch))["status"] == "ok"
    chunks: list[bytes] = []
    statuses: list[dict] = []

    async def poll_status():
        while not chunks or b"[DONE]" not in b"".join(chunks):
            statuses.append(json.loads((await jp_fetch("magnitude", "status")).body))
            await asyncio.sleep(0.05)

    body = {
        "messages": [{"role": "user", "content": "Write a long story about a cat."}],
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    poller = asyncio.ensure_future(poll_status())
    response = await jp_fetch(
        "magnitude",
        "v1",
        "chat",
        "completions",
        method="POST",
        body=json.dumps(body),
        streaming_callback=chunks.append,
        request_timeout=120,
    )
    await poller
    assert response.headers["Content-Type"].startswith("text/event-stream")
    text = b"".join(chunks).decode()
    events = [block for block in text.split("\n\n") if block.strip()]
    assert events[-1] == "data: [DONE]"
    ids = [int(line[4:]) for block in events for line in block.splitlines() if line.startswith("id: ")]
    assert ids == sorted(ids) and ids[0] == 1
    payloads = [json.loads(b.split("data: ", 1)[1]) for b in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["usage"]["completion_tokens"] == 48
    assert any(s["running"] >= 1 for s in statuses), statuses
    assert statuses[0]["model"] == "smollm2-135m" and statuses[0]["kv_cells_total"] == 2048


async def test_non_streaming_and_errors_in_openai_shape(jp_fetch, jp_serverapp):
    await start_and_wait_ready(jp_serverapp, jp_fetch)
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    response = await jp_fetch("magnitude", "v1", "completions", method="POST", body=json.dumps(body))
    data = json.loads(response.body)
    assert data["object"] == "text_completion" and data["usage"]["completion_tokens"] >= 1
    assert "ttft_ms" in data["timings"]
    with pytest.raises(HTTPClientError) as info:
        await jp_fetch("magnitude", "v1", "completions", method="POST", body=json.dumps({**body, "max_tokens": -2}))
    assert info.value.code == 400
    assert json.loads(info.value.response.body)["error"]["param"] == "max_tokens"
    metrics = (await jp_fetch("magnitude", "metrics")).body.decode()
    assert "magnitude_generation_tokens_total" in metrics
    # where the engine thread's time goes: rows and seconds inside llama_decode, and whole steps
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(("magnitude_decode_", "magnitude_step_seconds"))
    }
    assert values["magnitude_decode_rows_total"] >= values["magnitude_decode_calls_total"] >= 1
    assert 0 < values["magnitude_decode_seconds_total"] <= values["magnitude_step_seconds_total"]
    status = json.loads((await jp_fetch("magnitude", "status")).body)
    assert status["steps"]["decode_rows"] == values["magnitude_decode_rows_total"]


async def test_the_calibration_notebook_is_copied_from_the_package_once(jp_fetch, jp_serverapp, jp_root_dir):
    """The Lab panel's button: the notebook ships in the package and lands in the Jupyter root."""
    response = await jp_fetch("magnitude", "workshop", "03_calibration.ipynb", method="POST", body=b"")
    path = json.loads(response.body)["path"]
    assert path == "magnitude-workshop/03_calibration.ipynb"
    copied = jp_root_dir / path
    notebook = json.loads(copied.read_text())
    assert notebook["cells"]
    notebook["cells"].append({"cell_type": "markdown", "id": "mine", "metadata": {}, "source": "my notes"})
    copied.write_text(json.dumps(notebook))  # a learner's edit
    await jp_fetch("magnitude", "workshop", "03_calibration.ipynb", method="POST", body=b"")
    assert "my notes" in copied.read_text()  # never overwritten
    with pytest.raises(HTTPClientError) as info:
        await jp_fetch("magnitude", "workshop", "nope.ipynb", method="POST", body=b"")
    assert info.value.code == 404 and json.loads(info.value.response.body)["error"]["message"]


def magnitude_app(serverapp):
    from magnitude_jupyter.server.extension import MagnitudeAppBase

    for point in serverapp.extension_manager.extension_points.values():
        if isinstance(point.app, MagnitudeAppBase):
            return point.app
    raise AssertionError("the magnitude extension is not loaded")


async def test_jupyter_starts_with_no_model_in_memory_and_the_first_request_loads_it(jp_fetch, jp_serverapp):
    await jp_serverapp.extension_manager.start_all_extensions()
    pool = magnitude_app(jp_serverapp).pool
    assert pool.residents() == []  # JupyterLab started: nothing loaded, no memory held for a model
    status = json.loads((await jp_fetch("magnitude", "status")).body)
    assert status["state"] == "unloaded"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = await jp_fetch("magnitude", "v1", "chat", "completions", method="POST", body=json.dumps(body))
    assert json.loads(response.body)["choices"][0]["finish_reason"] in ("stop", "length")
    assert [r.entry.alias for r in pool.residents()] == [pool.default_model]


async def test_the_agent_apis_answer_under_the_extensions_prefix(jp_fetch, jp_serverapp):
    """Messages, Responses and embeddings are served by JupyterLab too, behind Jupyter's auth."""
    assert (await start_and_wait_ready(jp_serverapp, jp_fetch))["status"] == "ok"

    async def post(*path: str, body: dict) -> dict:
        return json.loads((await jp_fetch("magnitude", *path, method="POST", body=json.dumps(body))).body)

    message = await post("v1", "messages", body={"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert message["type"] == "message" and message["stop_reason"] in ("end_turn", "max_tokens")
    response = await post("v1", "responses", body={"input": "Hi", "max_output_tokens": 4})
    assert response["object"] == "response" and response["status"] in ("completed", "incomplete")
    stored = json.loads((await jp_fetch("magnitude", "v1", "responses", response["id"])).body)
    assert stored["id"] == response["id"]
    vectors = await post("v1", "embeddings", body={"input": ["a", "b"]})
    assert [item["index"] for item in vectors["data"]] == [0, 1]
