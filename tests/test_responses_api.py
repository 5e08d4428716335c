"""OpenAI's Responses API with the official `openai` SDK, against the real app and engine."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.model

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city today.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}


# A request whose answer must be a call of get_weather.
REQUIRED_CALL = {
    "model": "smollm2-135m",
    "input": "What is the weather in Oslo, in celsius?",
    "tools": [WEATHER],
    "tool_choice": "required",
    "max_output_tokens": 64,
    "temperature": 0,
}


@pytest.fixture
def client(inproc):
    return openai.OpenAI(base_url=inproc.url + "/v1", api_key=inproc.token, max_retries=0, timeout=300)


def test_a_response_comes_back_with_its_output_text_and_usage(client):
    response = client.responses.create(
        model="smollm2-135m", instructions="You are brief.", input="Say hello.", max_output_tokens=24, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.output[0].type == "message"
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0


def test_a_streamed_response_sends_the_documented_events_in_order(client):
    kinds, numbers, deltas = [], [], []
    with client.responses.stream(
        model="smollm2-135m", input="Count to five.", max_output_tokens=24, temperature=0
    ) as s:
        for event in s:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for earlier, later in [
        ("response.output_item.added", "response.content_part.added"),
        ("response.content_part.added", "response.output_text.delta"),
        ("response.output_text.delta", "response.output_text.done"),
        ("response.output_text.done", "response.output_item.done"),
    ]:
        assert kinds.index(earlier) < kinds.index(later)
    assert numbers == list(range(len(numbers)))
    assert "".join(deltas) == final.output_text


def test_a_cut_stream_resumes_after_its_last_sequence_number_with_the_same_text(client):
    stream = client.responses.create(
        model="smollm2-135m", input="Name three rivers.", max_output_tokens=32, temperature=0, stream=True
    )
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    stream.close()  # the client goes away mid-answer; the answer is still made and kept
    response_id = seen[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    assert client.responses.retrieve(response_id).output_text == text
    again = list(client.responses.retrieve(response_id, stream=True))  # from the first event
    assert [e.type for e in again] == [e.type for e in events]


def test_a_response_cannot_be_cancelled_once_finished_nor_streamed_if_unknown(client):
    done = client.responses.create(model="smollm2-135m", input="Hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)
    with pytest.raises(openai.NotFoundError):
        list(client.responses.retrieve("resp_unknown", stream=True))
    with pytest.raises(openai.BadRequestError):
        list(client.responses.retrieve(done.id, stream=True, starting_after=-2))
    client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):  # deleted means gone: not replayed either
        list(client.responses.retrieve(done.id, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_function_call_validates_and_its_output_continues_the_conversation(client, streamed):
    request = REQUIRED_CALL
    if streamed:
        with client.responses.stream(**request) as stream:
            response = stream.get_final_response()
    else:
        response = client.responses.create(**request)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = client.responses.create(
        model="smollm2-135m",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees, rain"}],
        tools=[WEATHER],
        max_output_tokens=32,
        temperature=0,
    )
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the stored conversation is in the cache


def test_text_format_json_schema_holds_every_answer(client):
    # the grammar bounds the answer to 20 characters: the whole object fits 48 tokens, so it completes
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 20}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model="smollm2-135m",
        input="Capital of France, as JSON.",
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema}},
        max_output_tokens=48,
        temperature=0,
    )
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), schema)


def test_stored_responses_are_retrieved_continued_and_deleted(client):
    first = client.responses.create(model="smollm2-135m", input="My name is Ada.", max_output_tokens=8, temperature=0)
    assert client.responses.retrieve(first.id).id == first.id
    second = client.responses.create(
        model="smollm2-135m",
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model="smollm2-135m", previous_response_id=first.id, input="Again?", max_output_tokens=4
        )
    unstored = client.responses.create(model="smollm2-135m", input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_fields_that_would_change_the_answer_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="smollm2-135m", input="Hi", background=True)
    assert "background" in str(caught.value)


def test_hosted_tools_are_not_offered_and_the_function_tools_still_are(client):
    """Codex CLI sends web_search and a namespace of tools on every turn: this server runs neither."""
    response = client.responses.create(
        model="smollm2-135m",
        input="What is the weather in Oslo, in celsius?",
        tools=[{"type": "web_search"}, WEATHER],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
    )
    assert [item.name for item in response.output if item.type == "function_call"] == ["get_weather"]


def test_a_continuation_is_the_same_prompt_as_the_whole_history_and_reuses_its_cache(client):
    """Instructions belong to one response: a continuation that gives them again does not send them twice."""
    ask = {"model": "smollm2-135m", "instructions": "You are brief.", "max_output_tokens": 8, "temperature": 0}
    first = client.responses.create(input="My name is Ada.", **ask)
    second = client.responses.create(previous_response_id=first.id, input="What is my name?", **ask)
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    whole = client.responses.create(input=history, store=False, **ask)
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def response_events(form: str, pieces: list[str]) -> list[dict]:
    """The Responses events for an answer held to a tool form, generated in these pieces."""
    from magnitude_jupyter.api.responses import ResponseEvents, ResponseMeta
    from magnitude_jupyter.engine.streams import StreamEvent
    from magnitude_jupyter.token_counts import TokenCounts

    render = ResponseEvents(ResponseMeta("resp_x", "m", {}, tool_form=form))
    out = []
    for i, piece in enumerate(pieces, start=1):
        out += render(StreamEvent(i, "token", text=piece))
    return out + render(StreamEvent(len(pieces) + 1, "done", finish_reason="stop", counts=TokenCounts(3, 0, 5)))


def test_with_tools_offered_the_text_streams_as_it_is_generated():
    events = response_events("hermes", ["The weather", " is fine", " today."])
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == ["The weather", " is fine", " today."]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["text"] == "The weather is fine today."
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_with_tools_a_calls_arguments_stream_and_assemble_into_the_final_item():
    pieces = ['{"tool_calls": [{"name": "get_', 'weather", "arguments": {"ci', 'ty": "Oslo", ', '"unit": "celsius"}}]}']
    events = response_events("generic", pieces)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(item["type"], item["name"], item["arguments"]) for item in added] == [("function_call", "get_weather", "")]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) == 3 and json.loads("".join(deltas)) == {"city": "Oslo", "unit": "celsius"}
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == "".join(deltas)
    (completed,) = [e for e in events if e["type"] == "response.completed"]
    assert completed["response"]["output"][0]["call_id"] == added[0]["call_id"]


def test_a_required_calls_arguments_stream_in_pieces_against_the_real_server(client):
    request = REQUIRED_CALL
    pieces = 0
    with client.responses.stream(**request) as stream:
        for event in stream:
            pieces += event.type == "response.function_call_arguments.delta"
        response = stream.get_final_response()
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert pieces > 1
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
