"""Several API keys, each a tenant: its stored responses, streams, prefix-cache entries and metrics
are its own, and what it may do beyond asking (batch priority, models, shedding) is its key's.
Against a real `magnitude serve` with three keys; and the config's parsing without a model."""

from __future__ import annotations

import json

import httpx
import pytest

from magnitude_jupyter.config import ConfigError, parse_api_keys

ALICE, BOB, CAROL = "alice-key-0123456789", "bob-key-0123456789ab", "carol-key-0123456789"
OWNER_KEY = "owner-key-0123456789"
CONFIG = f"""
engine:
  ctx_size: 4096
max_loaded_models: 2
api_keys:
  - name: alice
    key: {ALICE}
  - name: bob
    key: {BOB}
  - name: carol
    key: {CAROL}
    batch: true
    models: true
    never_shed: true
"""
LONG = "You are a careful assistant. " * 40


@pytest.fixture(scope="module")
def tenants_server(models_dir):
    from magnitude_jupyter.client.runtime import LocalServer

    with LocalServer(token=OWNER_KEY, config=CONFIG + f"models_dir: {models_dir}\n") as server:
        yield server


def call(server, key: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=120)


@pytest.mark.model
def test_a_tenant_cannot_read_continue_or_delete_another_tenants_response(tenants_server):
    made = call(
        tenants_server, ALICE, "POST", "/v1/responses", {"input": "My secret is 42. Say ok.", "max_output_tokens": 4}
    )
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    for method, path, body in (
        ("GET", f"/v1/responses/{response_id}", None),
        ("GET", f"/v1/responses/{response_id}?stream=true", None),
        ("POST", "/v1/responses", {"input": "What is my secret?", "previous_response_id": response_id}),
        ("DELETE", f"/v1/responses/{response_id}", None),
        ("POST", f"/v1/responses/{response_id}/cancel", None),
    ):
        r = call(tenants_server, BOB, method, path, body)
        assert r.status_code == 404, (method, path, r.text)
    assert call(tenants_server, ALICE, "GET", f"/v1/responses/{response_id}").status_code == 200
    # The owner's --token sees and may do everything (docs/operations.md, "Several clients").
    assert call(tenants_server, OWNER_KEY, "GET", f"/v1/responses/{response_id}").status_code == 200
    assert call(tenants_server, OWNER_KEY, "DELETE", f"/v1/responses/{response_id}").status_code == 200
    assert call(tenants_server, ALICE, "GET", f"/v1/responses/{response_id}").status_code == 404


@pytest.mark.model
def test_a_tenant_cannot_follow_or_cancel_another_tenants_stream(tenants_server):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST",
        tenants_server.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {ALICE}"},
        timeout=120,
    ) as stream:
        stream_id = stream.headers["X-Completion-Id"]
        for _ in stream.iter_lines():
            pass
    assert call(tenants_server, BOB, "GET", f"/v1/streams/{stream_id}").status_code == 404
    assert call(tenants_server, BOB, "DELETE", f"/v1/streams/{stream_id}").status_code == 404
    assert call(tenants_server, ALICE, "GET", f"/v1/streams/{stream_id}").status_code == 200
    assert call(tenants_server, OWNER_KEY, "GET", f"/v1/streams/{stream_id}").status_code == 200


@pytest.mark.model
def test_what_a_key_may_do_is_its_own(tenants_server):
    ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for extra, param in (({"priority": "batch"}, "priority"), ({"keep_alive": 0}, "keep_alive")):
        r = call(tenants_server, BOB, "POST", "/v1/chat/completions", {**ask, **extra})
        assert r.status_code == 403, r.text
        assert r.json()["error"]["type"] == "permission_error" and r.json()["error"]["param"] == param
    assert call(tenants_server, BOB, "POST", "/models/smollm2-135m/unload").status_code == 403
    assert call(tenants_server, CAROL, "POST", "/v1/chat/completions", {**ask, "priority": "batch"}).status_code == 200
    assert (
        call(tenants_server, OWNER_KEY, "POST", "/v1/chat/completions", {**ask, "priority": "batch"}).status_code == 200
    )
    assert call(tenants_server, "not-a-key-at-all-xx", "POST", "/v1/chat/completions", ask).status_code == 401


@pytest.mark.model
def test_a_key_without_the_models_right_uses_resident_models_only(tenants_server):
    """Alice (`models: false`) asking for a model that is not loaded gets a 403, on every route that
    would load it; nothing is loaded or unloaded for her. A key with the right loads it."""
    from .conftest import SECOND_MODEL

    ask = {"model": SECOND_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for path, body in (
        ("/v1/chat/completions", ask),
        ("/v1/completions", {"model": SECOND_MODEL, "prompt": "Hi", "max_tokens": 2}),
        ("/v1/embeddings", {"model": SECOND_MODEL, "input": "Hi"}),
        ("/v1/messages", {**ask, "max_tokens": 2}),
        ("/v1/responses", {"model": SECOND_MODEL, "input": "Hi", "max_output_tokens": 2}),
    ):
        r = call(tenants_server, ALICE, "POST", path, body)
        assert r.status_code == 403, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "permission_error" and "load models" in error["message"], (path, error)
    loaded = call(tenants_server, OWNER_KEY, "GET", "/").json()["loaded"]
    assert SECOND_MODEL not in loaded and "smollm2-135m" in loaded
    assert (
        call(tenants_server, ALICE, "POST", "/v1/chat/completions", {**ask, "model": "smollm2-135m"}).status_code == 200
    )
    assert call(tenants_server, CAROL, "POST", "/v1/chat/completions", ask).status_code == 200
    assert call(tenants_server, ALICE, "POST", "/v1/chat/completions", ask).status_code == 200  # resident now


@pytest.mark.model
def test_a_tenant_key_equal_to_the_owners_token_is_refused_before_serving(tmp_path):
    import os
    import subprocess
    import sys

    config = tmp_path / "config.yaml"
    config.write_text(f"api_keys:\n  - name: alice\n    key: {OWNER_KEY}\n")
    env = {**os.environ, "MAGNITUDE_CONFIG": str(config), "MAGNITUDE_RUNTIME_DIR": str(tmp_path / "runtime")}
    done = subprocess.run(
        [sys.executable, "-m", "magnitude_jupyter.cli", "serve", "--token", OWNER_KEY, "--port", "0"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "is the server's own --token" in done.stderr, done.stderr


@pytest.mark.model
def test_a_tenants_prompt_is_never_served_from_another_tenants_cache(tenants_server):
    ask = {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "Hi"}], "max_tokens": 2}
    first = call(tenants_server, ALICE, "POST", "/v1/chat/completions", ask).json()
    again = call(tenants_server, ALICE, "POST", "/v1/chat/completions", ask).json()
    other = call(tenants_server, BOB, "POST", "/v1/chat/completions", ask).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["usage"]["prompt_tokens"] == other["usage"]["prompt_tokens"]


@pytest.mark.model
def test_metrics_count_each_tenant_and_status_shows_a_tenant_no_other_requests(tenants_server):
    call(
        tenants_server,
        ALICE,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )
    text = call(tenants_server, OWNER_KEY, "GET", "/metrics").text
    assert 'magnitude_tenant_requests_total{model="smollm2-135m",outcome="length",tenant="alice"}' in text
    assert 'tenant="alice",kind="prompt"' in text or 'kind="prompt",model="smollm2-135m",tenant="alice"' in text
    # Bob's scrape: his own series and the server's state now, nothing that sums alice's requests.
    bobs = call(tenants_server, BOB, "GET", "/metrics").text
    assert 'tenant="alice"' not in bobs and "magnitude_prompt_tokens_total" not in bobs
    assert "magnitude_time_to_first_token_seconds" not in bobs and "magnitude_kv_usage_ratio" in bobs
    call(
        tenants_server,
        BOB,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )
    assert 'tenant="bob"' in call(tenants_server, BOB, "GET", "/metrics").text
    assert "magnitude_prompt_tokens_total" in text
    status = json.loads(call(tenants_server, BOB, "GET", "/status").text)
    assert status["recent"] == [] and status["requests"] == []
    assert call(tenants_server, OWNER_KEY, "GET", "/status").json()["recent"]


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ([{"name": "a", "key": "short"}], "16 characters"),
        ([{"name": "a", "key": "k" * 16}, {"name": "a", "key": "j" * 16}], "share the name"),
        ([{"name": "a", "key": "k" * 16, "admin": True}], "unknown key 'admin'"),
        ([{"name": "a", "key_env": "NO_SUCH_VARIABLE_HERE"}], "is not set"),
        ({"name": "a"}, "must be a list"),
        ([{"name": "a", "key": "k" * 16, "batch": "yes"}], "true or false"),
    ],
)
def test_api_keys_in_the_config_are_checked_by_name(raw, words):
    with pytest.raises(ConfigError, match=words):
        parse_api_keys(raw, "config.yaml", {})


def test_an_api_key_from_the_environment_and_its_secret_never_in_its_repr():
    (key,) = parse_api_keys([{"name": "ci", "key_env": "CI_KEY", "batch": True}], "config.yaml", {"CI_KEY": "s" * 20})
    assert key.key == "s" * 20 and key.batch and not key.models
    assert "s" * 20 not in repr(key)
