"""Generated JSON schemas, tool lists and message histories against the real server (Hypothesis).

A fixed number of examples, derandomized so every run of one version sends the same ones. For each:
the server stays up, every answer is a 200 or a JSON 4xx in OpenAI's shape, and another client's
small request sent meanwhile is answered, before the generated one ends where that one generates.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.model

SMALL = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-0123456789", min_size=1, max_size=12)
sizes = st.one_of(st.integers(0, 8), st.integers(4000, 5000), st.sampled_from([10**7, -1, 2**63]))
patterns = st.sampled_from(
    ["^[a-z]+$", "^(a+)+$", "^a{1000000}$", "[", "^\\d{3}$", "(x|y)*z", "^(ab){2,5}$", "a" * 2000]
)
refs = st.sampled_from(["#/$defs/a", "#/nope", "http://127.0.0.1:9/x", "file:///etc/hostname", "#", "a.json"])
junk = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8))


def leaf_schema() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("string")}, optional={"maxLength": sizes, "minLength": sizes}),
        st.fixed_dictionaries({"type": st.just("string"), "pattern": patterns}),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["integer", "number"])},
            optional={"minimum": st.integers(-(10**20), 10**20), "maximum": st.integers(-(10**20), 10**20)},
        ),
        st.fixed_dictionaries(
            {"enum": st.lists(st.one_of(st.text(max_size=6), st.integers()), min_size=1, max_size=6)}
        ),
        st.fixed_dictionaries({"$ref": refs}),
        st.just({"type": "boolean"}),
        st.dictionaries(st.sampled_from(["type", "maxItems", "anyOf", "not", "$id", "items"]), junk, max_size=3),
    )


schemas = st.recursive(
    leaf_schema(),
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(names, inner, max_size=4)},
            optional={"required": st.lists(names, max_size=3), "$defs": st.fixed_dictionaries({"a": inner})},
        ),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={"maxItems": sizes}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
    ),
    max_leaves=8,
)

object_schemas = st.fixed_dictionaries(
    {"type": st.just("object"), "properties": st.dictionaries(names, schemas, max_size=4)},
    optional={"required": st.lists(names, max_size=2)},
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": names, "parameters": st.one_of(object_schemas, schemas)}),
        }
    ),
    min_size=1,
    max_size=3,
)

contents = st.one_of(
    st.text(max_size=40), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})), junk
)
odd_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "nobody"]), "content": contents}
    ),
    min_size=1,
    max_size=4,
)
plain_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": st.text(min_size=1, max_size=60)}),
    min_size=1,
    max_size=3,
).map(lambda history: [*history, {"role": "user", "content": "Answer in JSON."}])
messages = st.one_of(plain_messages, plain_messages, plain_messages, odd_messages)

bodies = st.one_of(
    st.fixed_dictionaries(
        {
            "messages": messages,
            "response_format": st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries({"name": names, "schema": st.one_of(object_schemas, schemas)}),
                }
            ),
        }
    ),
    st.fixed_dictionaries({"messages": messages, "tools": tools}),
    st.fixed_dictionaries({"messages": messages}, optional={"cache_salt": st.text(max_size=4), "stop": junk}),
)


def post(inproc, body, results: dict[str, Any], key: str) -> None:
    try:
        content = json.dumps(body).encode()  # NaN and Infinity as Python writes them: not JSON, a 400
        headers = {**inproc.headers(), "Content-Type": "application/json"}
        results[key] = httpx.post(inproc.url + "/v1/chat/completions", content=content, headers=headers, timeout=300)
    except Exception as exc:  # recorded, and asserted below
        results[key] = exc
    results[key + "_at"] = time.monotonic()


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(body=bodies)
def test_generated_requests_never_take_the_server_down_or_hold_others_up(inproc, body):
    body = {**body, "max_tokens": 48, "temperature": 0}
    results: dict[str, Any] = {}
    generated = threading.Thread(target=post, args=(inproc, body, results, "generated"))
    generated.start()
    post(inproc, SMALL, results, "small")
    generated.join(300)
    small, answer = results["small"], results["generated"]
    assert isinstance(small, httpx.Response) and small.status_code == 200, small
    assert isinstance(answer, httpx.Response), answer
    assert answer.status_code == 200 or 400 <= answer.status_code < 500, answer.text
    error = answer.json().get("error")
    if answer.status_code != 200:
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"], answer.text
    elif answer.json()["usage"]["completion_tokens"] >= 16:
        # it generated for a while: the small request, sent as it started, did not wait for its end
        assert results["small_at"] <= results["generated_at"]
