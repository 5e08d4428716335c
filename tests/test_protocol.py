"""The OpenAI wire format, tested directly: no server, no model."""

from __future__ import annotations

import json

import pytest

from magnitude_jupyter.api.errors import ApiError, api_error_from
from magnitude_jupyter.api.generation import parse_json_body
from magnitude_jupyter.api.openai import parse_generation
from magnitude_jupyter.api.openai_shapes import ResponseShape, completion_response, stream_chunks
from magnitude_jupyter.engine.chat import ChatFormatError, normalize_messages
from magnitude_jupyter.engine.request import NUMBER_LIMITS, SamplingParams
from magnitude_jupyter.engine.streams import StreamEvent, TokenLogprob
from magnitude_jupyter.token_counts import TokenCounts

MESSAGES = [{"role": "user", "content": "Hi"}]

BAD_BODIES = [
    ("messages wrong type", {"messages": "hi"}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("temperature wrong type", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("temperature above 2", {"messages": MESSAGES, "temperature": 2.5}, "temperature"),
    ("top_p above 1", {"messages": MESSAGES, "top_p": 1.5}, "top_p"),
    ("frequency_penalty out of range", {"messages": MESSAGES, "frequency_penalty": 3}, "frequency_penalty"),
    ("max_tokens as string", {"messages": MESSAGES, "max_tokens": "10"}, "max_tokens"),
    ("negative max_tokens", {"messages": MESSAGES, "max_tokens": -5}, "max_tokens"),
    ("n > 1", {"messages": MESSAGES, "n": 3}, "n"),
    ("stop wrong type", {"messages": MESSAGES, "stop": 5}, "stop"),
    ("too many stops", {"messages": MESSAGES, "stop": [str(i) for i in range(17)]}, "stop"),
    ("seed as float", {"messages": MESSAGES, "seed": 1.5}, "seed"),
    ("reproducible as string", {"messages": MESSAGES, "reproducible": "yes"}, "reproducible"),
    ("priority unknown", {"messages": MESSAGES, "priority": "urgent"}, "priority"),
    ("unknown response_format", {"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format"),
    (
        "json_schema without a schema",
        {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
    ),
    (
        "grammar and response_format",
        {"messages": MESSAGES, "grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
        "grammar",
    ),
    ("top_logprobs without logprobs", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs above 20", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("tools", {"messages": MESSAGES, "tools": {"f": 1}}, "tools"),
    ("tool_choice", {"messages": MESSAGES, "tool_choice": "none"}, "tool_choice"),
    ("functions", {"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions"),
    ("an unknown field", {"messages": MESSAGES, "temprature": 0.5}, "temprature"),
    ("prompt on the chat endpoint", {"messages": MESSAGES, "prompt": "x"}, "prompt"),
]


@pytest.mark.parametrize(("name", "body", "param"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_chat_bodies_are_400s_naming_the_field(name, body, param):
    with pytest.raises((ApiError, ValueError)) as info:
        parse_generation(body, "chat")
    err = api_error_from(info.value)
    assert err.status == 400 and err.param == param, err.message
    assert err.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "messages": MESSAGES}, "messages"),
    ],
)
def test_bad_completion_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises((ApiError, ValueError)) as info:
        parse_generation(body, "completion")
    assert api_error_from(info.value).param == param


def test_the_api_and_the_engine_share_one_set_of_limits():
    _, hi = NUMBER_LIMITS["temperature"]
    assert parse_generation({"messages": MESSAGES, "temperature": hi}, "chat").params.temperature == hi
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=hi + 0.1).validate()
    with pytest.raises(ApiError, match="temperature") as refused:
        parse_generation({"messages": MESSAGES, "temperature": hi + 0.1}, "chat")
    assert refused.value.param == "temperature"


def test_a_good_body_becomes_sampling_params():
    req = parse_generation(
        {
            "messages": MESSAGES,
            "max_completion_tokens": 9,
            "temperature": 0,
            "stop": "END",
            "seed": 3,
            "frequency_penalty": 0.5,
            "logprobs": True,
            "top_logprobs": 2,
            "user": "someone",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "chat",
    )
    p = req.params
    assert (p.max_tokens, p.temperature, p.stop, p.seed, p.frequency_penalty) == (9, 0, ["END"], 3, 0.5)
    assert (p.logprobs, p.top_logprobs, req.stream, req.include_usage) == (True, 2, True, True)
    completion = parse_generation({"prompt": ["one string"], "logprobs": 0}, "completion")
    assert completion.prompt == "one string" and completion.params.logprobs and completion.params.top_logprobs == 0


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deep_json_is_refused_whatever_the_depth(depth):
    with pytest.raises(ApiError, match="nested") as info:
        parse_json_body(b'{"messages": ' + b"[" * depth + b"]" * depth + b"}")
    assert info.value.status == 400
    assert parse_json_body(json.dumps({"a": [[[1]]]}).encode()) == {"a": [[[1]]]}


def test_messages_are_checked_and_tool_call_turns_accepted():
    for bad in ([{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 5}], ["hi"]):
        with pytest.raises(ChatFormatError):
            normalize_messages(bad)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = normalize_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert turns == [{"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(ChatFormatError):
        normalize_messages([{"role": "assistant", "content": None}])


def test_a_cancelled_answer_never_says_stop():
    shape = ResponseShape("chatcmpl-x", "chat", "m")
    for reason in ("cancelled", "error"):
        final = StreamEvent(id=3, type="done", finish_reason=reason, counts=TokenCounts(4, 0, 1), timings={})
        assert completion_response(shape, "partial", [final])["choices"][0]["finish_reason"] == reason
        assert stream_chunks(shape, final)[0]["choices"][0]["finish_reason"] == reason


def test_the_engines_counts_become_openais_usage():
    shape = ResponseShape("chatcmpl-x", "chat", "m", include_usage=True)
    final = StreamEvent(id=3, type="done", finish_reason="stop", counts=TokenCounts(40, 30, 5, 2), timings={})
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 5,
        "total_tokens": 45,
        "prompt_tokens_details": {"cached_tokens": 30},
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    assert completion_response(shape, "hi", [final])["usage"] == usage
    chunk, usage_only = stream_chunks(shape, final)
    assert chunk["usage"] == usage_only["usage"] == usage and usage_only["choices"] == []


def test_logprobs_in_both_openai_shapes():
    entry = TokenLogprob(b" hi", -0.5, ((b" hi", -0.5), (b" yo", -1.5)))
    events = [
        StreamEvent(id=1, type="token", text=" hi", logprobs=(entry,)),
        StreamEvent(id=2, type="done", finish_reason="stop"),
    ]
    chat = completion_response(ResponseShape("c", "chat", "m", logprobs=True), " hi", events)["choices"][0]["logprobs"]
    assert chat["content"][0]["token"] == " hi" and chat["content"][0]["bytes"] == list(b" hi")
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [-0.5, -1.5]
    text = completion_response(ResponseShape("c", "completion", "m", logprobs=True), " hi", events)["choices"][0]
    assert text["logprobs"] == {
        "tokens": [" hi"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{" hi": -0.5, " yo": -1.5}],
    }
    # a held-back token (no text yet) still carries its logprob in the stream
    held = StreamEvent(id=2, type="token", text="", logprobs=(entry,))
    assert stream_chunks(ResponseShape("c", "chat", "m", logprobs=True), held)


@pytest.mark.parametrize("value", [0, -3, 1.5, "8", True])
def test_a_bad_max_output_tokens_is_named_as_the_responses_api_names_it(value):
    from magnitude_jupyter.api.errors import ApiError
    from magnitude_jupyter.api.responses import parse_responses

    with pytest.raises(ApiError) as refused:
        parse_responses({"model": "m", "input": "Say hi", "max_output_tokens": value})
    assert refused.value.param == "max_output_tokens" and "'max_output_tokens' must be" in str(refused.value)


def test_the_messages_and_responses_apis_build_the_engines_request_and_name_their_own_fields():
    """Each API builds the engine's request from its own fields (api/generation.py): a problem is
    reported by the name the client sent, never by the chat completions name it once went through."""
    from magnitude_jupyter.api.anthropic import parse_messages
    from magnitude_jupyter.api.responses import parse_responses
    from magnitude_jupyter.engine.request import MAX_STOP_STRINGS

    bad_schema = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    cases = [
        (parse_responses, {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        (
            parse_responses,
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": bad_schema}]},
            "tools[0].parameters",
        ),
        (
            parse_responses,
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice",
        ),
        (
            parse_messages,
            {"max_tokens": 5, "messages": MESSAGES, "tools": [{"name": "f", "input_schema": bad_schema}]},
            "tools[0].input_schema",
        ),
        (
            parse_messages,
            {"max_tokens": 5, "messages": MESSAGES, "stop_sequences": ["s"] * (MAX_STOP_STRINGS + 1)},
            "stop_sequences",
        ),
        (parse_messages, {"max_tokens": 5, "messages": MESSAGES, "temperature": 9}, "temperature"),
    ]
    for parse, body, field in cases:
        with pytest.raises(ApiError) as refused:
            parse(body)
        assert field in refused.value.message and (refused.value.param or "").startswith(field.split("[")[0]), body
        assert "function.parameters" not in refused.value.message and "'stop'" not in refused.value.message

    ok = parse_messages(
        {
            "max_tokens": 7,
            "messages": MESSAGES,
            "stop_sequences": ["END"],
            "tools": [{"name": "add", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}],
            "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True},
            "thinking": {"type": "disabled"},
        }
    )
    assert (ok.params.max_tokens, ok.params.stop, ok.params.temperature) == (7, ["END"], 1.0)
    assert ok.tools is not None and (ok.tools.choice, ok.tools.function, ok.tools.parallel) == (
        "function",
        "add",
        False,
    )
    assert ok.thinking.enabled is False
    answer = parse_responses({"input": "x", "max_output_tokens": 3, "text": {"format": {"type": "json_object"}}})
    assert answer.params.max_tokens == 3 and answer.params.grammar and answer.tools is None


def test_tools_the_model_may_not_call_are_shaped_but_their_schemas_not_compiled():
    """`tool_choice: none` asks for no call: the tools change nothing, so a schema the grammar
    converter would refuse is not a 400 (their shape still is)."""
    from magnitude_jupyter.api.anthropic import parse_messages
    from magnitude_jupyter.api.responses import parse_responses

    refused = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    messages = parse_messages(
        {
            "max_tokens": 5,
            "messages": MESSAGES,
            "tools": [{"name": "f", "input_schema": refused}],
            "tool_choice": {"type": "none"},
        }
    )
    responses = parse_responses(
        {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": refused}], "tool_choice": "none"}
    )
    assert messages.tools is None and responses.tools is None
    with pytest.raises(ApiError, match=r"tools\[0\]"):
        parse_messages({"max_tokens": 5, "messages": MESSAGES, "tools": ["x"], "tool_choice": {"type": "none"}})
    with pytest.raises(ApiError, match=r"tools\[0\]"):
        parse_responses({"input": "x", "tools": ["x"], "tool_choice": "none"})
