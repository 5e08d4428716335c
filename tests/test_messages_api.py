"""Anthropic's Messages API with the official `anthropic` SDK, against the real app and engine."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.model

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city today.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}


@pytest.fixture
def claude(inproc):
    # The SDK sends its key as x-api-key: the server reads it as the bearer token.
    return anthropic.Anthropic(base_url=inproc.url, api_key=inproc.token, max_retries=0, timeout=300)


def test_a_message_comes_back_in_anthropics_shape(claude):
    message = claude.messages.create(
        model="smollm2-135m",
        max_tokens=24,
        extra_body={"temperature": 0},
        system="You are brief.",
        messages=[{"role": "user", "content": "Say hello."}],
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0 and message.usage.input_tokens > 0


def test_a_streamed_message_arrives_as_the_documented_event_sequence(claude):
    with claude.messages.stream(
        model="smollm2-135m",
        max_tokens=24,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Count to five."}],
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_delta") < kinds.index("content_block_stop")
    assert kinds.index("content_block_stop") < kinds.index("message_delta") < kinds.index("message_stop")
    assert final.content[0].text and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0


@pytest.mark.parametrize("streamed", [False, True])
def test_tool_use_validates_against_its_schema_and_a_tool_result_continues(claude, streamed):
    messages = [{"role": "user", "content": "What is the weather in Oslo, in celsius?"}]
    request = {
        "model": "smollm2-135m",
        "max_tokens": 64,
        "extra_body": {"temperature": 0},
        "tools": [WEATHER],
        "tool_choice": {"type": "any"},
        "messages": messages,
    }
    if streamed:
        with claude.messages.stream(**request) as stream:
            message = stream.get_final_message()
    else:
        message = claude.messages.create(**request)
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    follow = claude.messages.create(
        model="smollm2-135m",
        max_tokens=32,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        messages=[
            *messages,
            {"role": "assistant", "content": [block.model_dump() for block in message.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12 degrees, rain"}],
            },
        ],
    )
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_count_tokens_is_the_prompt_the_engine_computes(claude):
    body = {"system": "You answer in one word.", "messages": [{"role": "user", "content": "Capital of France?"}]}
    counted = claude.messages.count_tokens(model="smollm2-135m", **body)
    message = claude.messages.create(model="smollm2-135m", max_tokens=4, extra_body={"temperature": 0}, **body)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_max_tokens_past_the_context_is_a_cap_not_an_error(claude):
    """Claude Code asks for 32,000 output tokens; the context here is 8,192."""
    message = claude.messages.create(
        model="smollm2-135m",
        max_tokens=32_000,
        extra_body={"temperature": 0},
        stop_sequences=["."],
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
    )
    assert message.stop_reason in ("stop_sequence", "end_turn")
    if message.stop_reason == "stop_sequence":
        assert message.stop_sequence == "."


def test_errors_come_in_anthropics_shape(claude, inproc):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="smollm2-135m",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}],
        )
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in caught.value.body["error"]["message"]
    # max_tokens is required, as Anthropic requires it
    r = httpx.post(
        inproc.url + "/v1/messages",
        json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": inproc.token, "anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=inproc.url, api_key="wrong", max_retries=0).messages.create(
            model="smollm2-135m", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert denied.value.body["error"]["type"] == "authentication_error"


def test_a_messages_turn_after_a_chat_completions_turn_shares_the_prefix_cache(claude, inproc):
    """Clients on both APIs share the engine: the same history is the same prompt, cached once."""
    import uuid

    system = f"[{uuid.uuid4().hex}] You are a patient assistant who explains things about lighthouses. " * 3
    question = "Why are lighthouses tall?"
    chat = httpx.post(
        inproc.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 4,
            "temperature": 0,
        },
        headers=inproc.headers(),
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    message = claude.messages.create(
        model="smollm2-135m",
        max_tokens=4,
        extra_body={"temperature": 0},
        system=system,
        messages=[{"role": "user", "content": question}],
    )
    assert message.usage.cache_read_input_tokens > 20


@pytest.mark.parametrize(
    ("method", "path", "shape"),
    [
        ("POST", "/v1/nothing", "openai"),
        ("GET", "/v1/embeddingz", "openai"),
        ("POST", "/v1/messages/batches", "anthropic"),
        ("GET", "/magnitude/v1/nothing", "openai"),
    ],
)
def test_unknown_routes_answer_json_404s_in_their_apis_shape(inproc, method, path, shape):
    r = httpx.request(method, inproc.url + path, headers=inproc.headers(), json={}, timeout=30)
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    else:
        assert body["error"]["code"] == "not_found" and path in body["error"]["message"]


def test_a_wrong_method_is_a_json_405_in_the_routes_shape(inproc):
    r = httpx.get(inproc.url + "/v1/messages", headers=inproc.headers(), timeout=30)
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = httpx.get(inproc.url + "/v1/chat/completions", headers=inproc.headers(), timeout=30)
    assert r.status_code == 405 and "error" in r.json() and "type" in r.json()["error"]


def test_a_prompt_that_alone_does_not_fit_is_an_error_with_its_numbers(claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="smollm2-135m",
            max_tokens=32_000,
            messages=[{"role": "user", "content": "lighthouse " * 9000}],
        )
    message = caught.value.body["error"]["message"]
    assert "the prompt is" in message and "tokens" in message and "8192" in message


def events_of(form: str, pieces: list[str]) -> list[dict]:
    """The Messages events for an answer held to a tool form, generated in these pieces."""
    from magnitude_jupyter.api.anthropic import MessageEvents, MessageShape
    from magnitude_jupyter.engine.streams import StreamEvent
    from magnitude_jupyter.token_counts import TokenCounts

    render = MessageEvents(MessageShape("msg_x", "m", 3, tool_form=form))
    out = []
    for i, piece in enumerate(pieces, start=1):
        out += render(StreamEvent(i, "token", text=piece))
    out += render(StreamEvent(len(pieces) + 1, "done", finish_reason="stop", counts=TokenCounts(3, 0, 5)))
    return out


@pytest.mark.parametrize("form", ["generic", "hermes"])
def test_with_tools_offered_text_streams_as_it_is_generated(form):
    events = events_of(form, ["The weather", " is fine", " today."])
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == ["The weather", " is fine", " today."]  # one delta an event, not one at the end
    assert [e["type"] for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def test_with_tools_a_calls_input_streams_as_input_json_deltas_that_assemble_into_it():
    pieces = ['{"tool_calls": [{"name": "get_', 'weather", "arguments": {"ci', 'ty": "Oslo", ', '"unit": "celsius"}}]}']
    events = events_of("generic", pieces)
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["tool_use"]
    assert starts[0]["content_block"]["name"] == "get_weather" and starts[0]["content_block"]["input"] == {}
    partial = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert len(partial) == 3 and json.loads("".join(partial)) == {"city": "Oslo", "unit": "celsius"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_with_tools_two_calls_are_two_blocks_in_order():
    call = '{"name": "get_weather", "arguments": {"city": "%s", "unit": "celsius"}}'
    pieces = ['{"tool_calls": [' + call % "Oslo", ", " + call % "Rome", "]}"]
    events = events_of("generic", pieces)
    starts = [(e["index"], e["content_block"]["id"]) for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == [(0, "toolu_x_0"), (1, "toolu_x_1")] and stops == [0, 1]


def test_a_forced_calls_input_streams_in_pieces_against_the_real_server(claude):
    request = {
        "model": "smollm2-135m",
        "max_tokens": 64,
        "extra_body": {"temperature": 0},
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "What is the weather in Oslo, in celsius?"}],
    }
    pieces = 0
    with claude.messages.stream(**request) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                pieces += 1
        message = stream.get_final_message()
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert pieces > 1  # generated token by token, not sent whole at the end
    jsonschema.validate(call.input, WEATHER["input_schema"])


def test_claude_codes_attribution_block_costs_a_new_session_none_of_the_shared_prompt(claude):
    """Claude Code's first system block differs per session (its version and entry point, hashed with
    the first prompt); the instructions after it are the same: a new session reuses them."""
    instructions = "You are a coding agent. Follow the repository's conventions. " * 30

    def system(session: str) -> list[dict]:
        header = f"x-anthropic-billing-header: cc_version=2.1.337.{session}; cc_entrypoint=cli;"
        return [{"type": "text", "text": header}, {"type": "text", "text": instructions}]

    first = claude.messages.create(
        model="smollm2-135m", max_tokens=2, system=system("a1"), messages=[{"role": "user", "content": "Hi"}]
    )
    second = claude.messages.create(
        model="smollm2-135m", max_tokens=2, system=system("b2"), messages=[{"role": "user", "content": "Hello"}]
    )
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= 0.8 * prompt, (first.usage, second.usage)
    plain = claude.messages.count_tokens(
        model="smollm2-135m", system=instructions, messages=[{"role": "user", "content": "Hi"}]
    )
    with_header = claude.messages.count_tokens(
        model="smollm2-135m", system=system("c3"), messages=[{"role": "user", "content": "Hi"}]
    )
    assert with_header.input_tokens == plain.input_tokens
