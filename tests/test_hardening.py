"""What a hostile or careless client does to the HTTP API: each test fails without the mechanism it names.

The API here is the real tornado app of `magnitude serve`, in this process, in front of the real engine.
"""

from __future__ import annotations

import json
import logging
import threading

import httpx
import openai
import pytest

from magnitude_jupyter.engine import FinishReason, RequestStatus, SamplingParams

from .conftest import wait_for

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": "Tell me about lighthouses."}]


def post(inproc, path: str, body, timeout: float = 60, **headers):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(inproc.url + path, content=content, headers={**inproc.headers(), **headers}, timeout=timeout)


def only_live_request(engine):
    live = engine.stats().live
    return live[0].id if len(live) == 1 and live[0].completion_tokens > 0 else None


def test_an_abandoned_non_streamed_request_is_cancelled_at_once(inproc, engine):
    body = {"prompt": "Once", "max_tokens": 7000, "ignore_eos": True}
    failed = []

    def call() -> None:
        try:
            post(inproc, "/v1/completions", body, timeout=2.0)
        except httpx.TimeoutException as exc:
            failed.append(exc)  # the client gives up and closes its connection

    caller = threading.Thread(target=call)
    caller.start()
    request_id = wait_for(lambda: only_live_request(engine), what="the request running")
    caller.join()
    assert failed, "the request should still have been running when the client gave up"
    request = engine.get_request(request_id)
    # 7,000 tokens take minutes, and the grace period is 60 s: only the closed connection ends it this soon.
    wait_for(lambda: request.is_finished, timeout=20, what="the abandoned request to end")
    assert request.finish_reason == FinishReason.CANCELLED and "closed its connection" in request.error
    assert engine.stats().scheduler.running == 0


def test_a_streaming_client_that_leaves_a_queued_request_stops_being_its_reader(inproc, engine):
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    blockers = [engine.submit("Count", params=long) for _ in range(engine.engine_settings.parallel)]
    request_id = None
    try:
        body = {"prompt": "Hi", "max_tokens": 5, "stream": True}
        with httpx.stream("POST", inproc.url + "/v1/completions", json=body, headers=inproc.headers()) as response:
            request_id = response.headers["X-Completion-Id"]
            stream = engine.streams.get(request_id)
            assert stream.readers == 1
        # The request waits behind the blockers and produces no event to fail a write on: only the
        # closed connection tells the handler to let go, so the grace period starts now.
        wait_for(lambda: stream.readers == 0, timeout=10, what="the reader to detach")
        assert engine.get_request(request_id).status == RequestStatus.WAITING
    finally:
        for request in blockers:
            engine.cancel(request.request_id)
        if request_id:
            engine.cancel(request_id)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,
        ('{"messages": [{"role": "user", "content": ' + "[" * 1000 + "]" * 1000 + "}]}").encode(),
    ],
    ids=["deep-array", "deep-content"],
)
def test_deeply_nested_json_is_a_400_naming_the_body(inproc, body):
    r = post(inproc, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json" and "nested" in r.json()["error"]["message"]
    assert post(inproc, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("megabytes", [2, 10])
def test_every_oversized_body_is_a_413_in_openai_shape(inproc, megabytes):
    body = {"messages": [{"role": "user", "content": "x" * (megabytes << 20)}]}
    r = post(inproc, "/v1/chat/completions", body)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"


def test_cancelled_answers_never_claim_stop(inproc, engine):
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", inproc.url + "/v1/completions", json=body, headers=inproc.headers()) as response:
        request_id = response.headers["X-Completion-Id"]
        next(response.iter_lines())
        assert httpx.delete(f"{inproc.url}/v1/streams/{request_id}", headers=inproc.headers()).json()["cancelled"]
    r = httpx.get(f"{inproc.url}/v1/streams/{request_id}", headers=inproc.headers(), timeout=30)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "cancelled"

    # a non-streamed answer cut short says so too
    result = {}
    caller = threading.Thread(
        target=lambda: result.update(r=post(inproc, "/v1/completions", {**body, "stream": False}))
    )
    caller.start()
    request_id = wait_for(lambda: only_live_request(engine), what="the request running")
    engine.cancel(request_id)
    caller.join(30)
    assert result["r"].json()["choices"][0]["finish_reason"] == "cancelled"


def test_the_token_never_reaches_the_log(inproc, caplog):
    with caplog.at_level(logging.INFO, logger="tornado.access"):
        r = httpx.get(f"{inproc.url}/v1/streams/cmpl-nonexistent", params={"token": inproc.token})
        assert r.status_code == 404
        wait_for(lambda: any("cmpl-nonexistent" in rec.getMessage() for rec in caplog.records), timeout=5)
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert inproc.token not in logged and "token=" in logged


def test_401_carries_the_bearer_challenge(inproc):
    r = httpx.get(inproc.url + "/health")
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    assert r.json()["error"]["type"] == "authentication_error"


def test_without_auth_only_local_same_origin_requests_are_served(inproc):
    url = inproc.open_url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health", headers={"Origin": url}).status_code == 200
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2})
    # a web page's "simple" cross-site POST (text/plain skips the CORS preflight)
    r = httpx.post(
        url + "/v1/chat/completions",
        content=body,
        headers={"Origin": "http://evil.example", "Content-Type": "text/plain"},
    )
    assert r.status_code == 403 and "cross-origin" in r.json()["error"]["message"]
    # DNS rebinding: the page's own name resolves to 127.0.0.1
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"Host": "attacker.example"})
    assert r.status_code == 403 and "attacker.example" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("best_of", 2),
        ("echo", True),
        ("n", 2),
        ("logit_bias", {"1": 5}),
        ("frobnicate", 1),
    ],
)
def test_fields_we_do_not_support_are_refused_by_name(inproc, field, value):
    r = post(inproc, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_logprobs_chat_streamed_and_not_and_completions(inproc):
    client = openai.OpenAI(base_url=inproc.url + "/v1", api_key=inproc.token, max_retries=0)
    # Reproducible, so that both answers are computed alike: otherwise llama.cpp's attention adds up a
    # one-token step differently once the cache reaches 512 cells, which other tests' entries decide.
    same = {"reproducible": True}
    answer = client.chat.completions.create(
        model="smollm2-135m",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=same,
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(
            entry.logprob
        )
    assert "".join(e.token for e in content) == answer.choices[0].message.content

    streamed = []
    for chunk in client.chat.completions.create(
        model="smollm2-135m",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body=same,
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content or []
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])

    completion = client.completions.create(
        model="smollm2-135m", prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_openai_penalties_are_applied_not_ignored(inproc):
    plain = post(inproc, "/v1/completions", {"prompt": "the the the the", "max_tokens": 12, "temperature": 0})
    penalized = post(
        inproc,
        "/v1/completions",
        {
            "prompt": "the the the the",
            "max_tokens": 12,
            "temperature": 0,
            "frequency_penalty": 2,
            "presence_penalty": 2,
        },
    )
    assert plain.status_code == penalized.status_code == 200, penalized.text
    assert plain.json()["choices"][0]["text"] != penalized.json()["choices"][0]["text"]


def test_an_assistant_turn_with_only_tool_calls_is_valid_input(inproc):
    messages = [
        {"role": "user", "content": "What is 6 times 7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "mul", "arguments": '{"a":6,"b":7}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "user", "content": "So?"},
    ]
    r = post(inproc, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_a_completion_too_long_names_prompt(inproc):
    r = post(inproc, "/v1/completions", {"prompt": "word " * 9000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_event_ids_are_plain_decimal_numbers(inproc):
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", inproc.url + "/v1/completions", json=body, headers=inproc.headers()) as response:
        request_id = response.headers["X-Completion-Id"]
        response.read()
    url = f"{inproc.url}/v1/streams/{request_id}"
    r = httpx.get(url, headers={**inproc.headers(), "Last-Event-ID": "-1"})
    assert r.status_code == 400 and "start at 0" in r.json()["error"]["message"]
    for raw in ("+5", "0005", "1_0", "1e2", "0x1"):
        r = httpx.get(url, headers={**inproc.headers(), "Last-Event-ID": raw})
        assert r.status_code == 400 and "plain decimal" in r.json()["error"]["message"], raw
    assert httpx.get(url, headers={**inproc.headers(), "Last-Event-ID": "1"}).status_code == 200


def test_submission_runs_off_the_event_loop(inproc, engine, monkeypatch):
    threads = []
    submit = engine.submit

    def recording_submit(*args, **kwargs):
        threads.append(threading.current_thread())
        return submit(*args, **kwargs)

    monkeypatch.setattr(engine, "submit", recording_submit)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {
        "messages": MESSAGES,
        "max_tokens": 12,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    assert post(inproc, "/v1/chat/completions", body).status_code == 200
    assert threads and inproc.loop_thread not in threads
