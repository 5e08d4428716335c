"""`magnitude serve` as a real process, driven by the `openai` package and raw HTTP."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from magnitude_jupyter.client.http import iter_sse

from .conftest import SERVE_TOKEN as TOKEN
from .conftest import wait_for

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0, timeout=120)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def test_token_file_and_auth(server):
    info = json.loads(server.runtime_file.read_text())
    assert info["token"] == TOKEN and info["url"] == server.url
    assert oct(server.runtime_file.stat().st_mode)[-3:] == "600"
    for path in ("/health", "/v1/models", "/status", "/metrics", "/magnitude/health"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_openai_client_sync_and_streaming(client):
    models = client.models.list()
    assert models.data[0].id == "smollm2-135m", "the default first"
    extra = {"reproducible": True}
    sync = client.chat.completions.create(
        model="smollm2-135m", messages=MESSAGES, max_tokens=24, temperature=0, extra_body=extra
    )
    assert sync.choices[0].message.content and sync.usage.completion_tokens <= 24
    assert sync.model_extra["timings"]["ttft_ms"] > 0

    parts, usage = [], None
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        extra_body=extra,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == sync.choices[0].message.content
    assert usage is not None and usage.completion_tokens == sync.usage.completion_tokens

    completion = client.completions.create(model="smollm2-135m", prompt="1, 2, 3,", max_tokens=6, temperature=0)
    assert completion.choices[0].text and completion.object == "text_completion"


def test_structured_answers_follow_the_schema_or_grammar(client, server):
    schema = {
        "type": "object",
        "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative"]}, "stars": {"type": "integer"}},
        "required": ["sentiment", "stars"],
    }
    ask = "Review: 'The kettle broke after two days.' Give sentiment and stars as JSON."
    review = [{"role": "user", "content": ask}]
    answer = client.chat.completions.create(
        model="smollm2-135m",
        messages=review,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "review", "schema": schema}},
    )
    data = json.loads(answer.choices[0].message.content)
    assert data["sentiment"] in ("positive", "negative") and isinstance(data["stars"], int)
    assert answer.choices[0].finish_reason == "stop"  # the grammar ends the answer, not max_tokens

    loose = client.chat.completions.create(
        model="smollm2-135m", messages=review, max_tokens=64, temperature=0, response_format={"type": "json_object"}
    )
    assert loose.choices[0].message.content.lstrip().startswith("{")
    if loose.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(loose.choices[0].message.content), dict)

    # llama.cpp's own `grammar` field, sampled (not greedy) and streamed
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=8,
        temperature=0.9,
        seed=7,
        stream=True,
        extra_body={"grammar": 'root ::= "yes" | "no"'},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("yes", "no")


def sse_events(lines):
    return iter_sse(iter(lines))


def text_of(events) -> str:
    out = []
    for _, data in events:
        if data != "[DONE]":
            chunk = json.loads(data)
            out += [c["delta"].get("content") or "" for c in chunk["choices"]]
    return "".join(out)


def test_resume_after_disconnect_equals_uninterrupted_run(server):
    body = {
        "messages": MESSAGES,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "reproducible": True,
        "stream": True,
    }
    url = server.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=auth(), timeout=60) as r:
        whole = list(sse_events(r.iter_lines()))
    expected = text_of(whole)

    first = []
    with httpx.stream("POST", url, json=body, headers=auth(), timeout=60) as r:
        for event in sse_events(r.iter_lines()):
            first.append(event)
            if len(first) == 5:
                break  # drop the connection mid-answer
    completion_id = json.loads(first[0][1])["id"]
    last_id = first[-1][0]
    with httpx.stream(
        "GET",
        f"{server.url}/v1/streams/{completion_id}",
        headers={**auth(), "Last-Event-ID": str(last_id)},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        rest = list(sse_events(r.iter_lines()))
    assert rest[-1][1] == "[DONE]" and rest[0][0] == last_id + 1
    assert text_of(first) + text_of(rest) == expected
    # ?starting_after works the same, and from 0 replays everything
    r = httpx.get(f"{server.url}/v1/streams/{completion_id}", params={"starting_after": 0}, headers=auth())
    assert text_of(sse_events(r.text.splitlines())) == expected


def test_stream_cancel_unknown_and_gone(server):
    url = server.url
    r = httpx.get(f"{url}/v1/streams/cmpl-nope", headers=auth())
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth(), timeout=60) as r:
        first = next(sse_events(r.iter_lines()))
    cid = json.loads(first[1])["id"]
    r = httpx.delete(f"{url}/v1/streams/{cid}", headers=auth())
    assert r.status_code == 200 and r.json()["cancelled"] is True
    r = httpx.get(f"{url}/v1/streams/{cid}", headers=auth(), timeout=30)
    last = [json.loads(d) for _, d in sse_events(r.text.splitlines()) if d != "[DONE]"][-1]
    assert last["magnitude"]["finish_reason"] == "cancelled"

    def dropped() -> httpx.Response | None:
        r = httpx.get(f"{url}/v1/streams/{cid}", headers=auth())
        return r if r.status_code != 200 else None

    r = wait_for(dropped, timeout=30, what="the stream to expire")  # retention_seconds is 3 in this server's config
    assert r.status_code == 410 and r.json()["error"]["code"] == "stream_gone"


def test_sixteen_concurrent_streaming_clients(client, server):
    results: dict[int, tuple[str, object]] = {}

    def run(i: int) -> None:
        parts, usage = [], None
        for chunk in client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=8 + i,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        results[i] = ("".join(parts), usage)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 16
    for i, (text, usage) in results.items():
        assert usage.completion_tokens == 8 + i and text
    status = httpx.get(server.url + "/status", headers=auth()).json()
    assert status["running"] == 0 and status["kv_cells_reserved"] == status["prefix_cache_cells"]
    # What the draft policy measured on this machine: step times grow with the step's tokens.
    step_ms = status["drafts"]["step_ms"]
    assert step_ms and step_ms["32"] > step_ms["1"] > 0
    assert set(status["drafts"]["kept_chance"]) == {"4-5", "6-7", "8-11", "12-15", "16+"}


# The validation itself is unit-tested in test_protocol.py; these go through the whole server.
BAD_INPUTS = [
    ("malformed JSON", b"{not json", 400, None),
    ("temperature wrong type", {"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ("unknown model", {"model": "gpt-9", "messages": MESSAGES}, 404, "model"),
    ("prompt longer than the context", {"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),
    ("oversized body", {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}, 413, None),
    ("grammar that does not parse", {"messages": MESSAGES, "grammar": "root ::= ("}, 400, "grammar"),
    ("tools", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools"),
]


@pytest.mark.parametrize(("name", "body", "status", "param"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server, name, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/chat/completions", content=content, headers=auth(), timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert httpx.get(server.url + "/health", headers=auth()).status_code == 200


def test_full_queue_answers_429_with_retry_after(server):
    url = server.url + "/v1/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 150, "ignore_eos": True, "stream": True}
    opened, statuses = [], []
    with httpx.Client(timeout=60, headers=auth()) as http:
        try:
            for _ in range(30):
                response = http.send(http.build_request("POST", url, json=body), stream=True)
                statuses.append(response.status_code)
                if response.status_code == 429:
                    assert int(response.headers["Retry-After"]) >= 1
                    response.read()
                    assert response.json()["error"]["type"] == "rate_limit_error"
                    response.close()
                    break
                opened.append(response)
        finally:
            for response in opened:
                response.close()
                # queued requests have no token yet: the id comes in a header
                http.delete(f"{server.url}/v1/streams/{response.headers['X-Completion-Id']}")
    assert statuses[-1] == 429 and statuses.count(200) == 16 + 8
