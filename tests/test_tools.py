"""Tool calling through the OpenAI API: the bundled model, a real server, the `openai` SDK and
LangChain's `ChatOpenAI.bind_tools`."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from magnitude_jupyter.api.tools import openai_tools as parse_tools
from magnitude_jupyter.api.tools import tool_request
from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine, SamplingParams
from magnitude_jupyter.engine.chat import render_chat
from magnitude_jupyter.engine.tools import GENERIC, HERMES, ToolError, parse_answer

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
TOOLS = [ADD, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What is 2+3? Use the tool.",
    "Is it raining in Lisbon today?",
    "Add 1234 and 4321.",
    "Weather in Oslo for the next three days, in fahrenheit please.",
]


def auth(inproc) -> dict[str, str]:
    return {"Authorization": f"Bearer {inproc.token}"}


def sdk(inproc) -> openai.OpenAI:
    return openai.OpenAI(base_url=inproc.url + "/v1", api_key=inproc.token, max_retries=0)


def assemble(stream) -> tuple[dict[int, dict], str | None, str]:
    """Streamed tool-call deltas put together by index, as a client library does."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish, content


# -- the call form, without a model -------------------------------------------------------------


@pytest.mark.parametrize("form", [GENERIC, HERMES], ids=["generic", "hermes"])
def test_every_prefix_of_an_answer_reads_as_a_growing_part_of_the_whole(form):
    text = form.render([("add", '{"a": 2, "b": {"c": "}"}}'), ("get_weather", '{"city": "Oslo"}')])
    whole = parse_answer(text, form.name)
    assert [(c.name, c.arguments, c.complete) for c in whole.calls] == [
        ("add", '{"a": 2, "b": {"c": "}"}}', True),
        ("get_weather", '{"city": "Oslo"}', True),
    ]
    before = parse_answer("", form.name)
    for end in range(1, len(text) + 1):
        now = parse_answer(text[:end], form.name)
        assert now.is_call and now.content == ""
        for old, new in zip(before.calls, now.calls, strict=False):
            assert new.name == old.name and new.arguments.startswith(old.arguments)
        before = now
    assert parse_answer("Five.", form.name).content == "Five."


@pytest.mark.parametrize(
    ("tools", "fragment"),
    [
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}], "'f'"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "bad name!"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "type 'object'"),
        ([ADD, ADD], "two tools are named 'add'"),
    ],
)
def test_bad_tool_definitions_are_refused_naming_the_tool(tools, fragment):
    with pytest.raises(ToolError, match=fragment.replace("(", r"\(").replace("!", "!")):
        parse_tools(tools)


def test_tool_turns_render_for_a_template_without_tools():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "add", '{"a": 2, "b": 3}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    text = render_chat(messages, None, tools=tool_request([ADD]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions")
    assert '<|im_start|>assistant\n{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}<|im_end|>' in text
    assert '<|im_start|>user\n{"tool_results": [{"name": "add", "content": "5"}]}<|im_end|>' in text


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- the real server ------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_required_always_gives_calls_whose_arguments_validate(inproc, prompt):
    response = sdk(inproc).chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: a sampled tiny model can go on calling until max_tokens
        temperature=0.9,  # sampled, not greedy: the grammar, not luck, keeps the arguments valid
        max_tokens=200,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    for tool_call in choice.message.tool_calls:
        assert tool_call.type == "function" and tool_call.id.startswith("call_")
        jsonschema.validate(json.loads(tool_call.function.arguments), SCHEMAS[tool_call.function.name])


@pytest.mark.parametrize("parallel", [False, True])
def test_streamed_calls_assemble_to_the_non_streamed_ones(inproc, parallel):
    body = dict(
        model="smollm2-135m",
        messages=[{"role": "user", "content": PROMPTS[3]}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0,
        max_tokens=100,
        extra_body={"reproducible": True},  # the same tokens both times, whatever the cache holds
    )
    whole = sdk(inproc).chat.completions.create(**body).choices[0]
    calls, finish, content = assemble(sdk(inproc).chat.completions.create(**body, stream=True))
    assert finish == whole.finish_reason and content == "" and whole.message.content is None
    expected = [(c.id, c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len(expected) > 1 if parallel else len(expected) == 1
    # Ids are made from the completion's id: two requests, two ids; their form is the same.
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [e[1:] for e in expected]
    assert all(calls[i]["id"].endswith(f"_{i}") for i in calls)
    if not parallel:
        assert finish == "tool_calls"
        jsonschema.validate(json.loads(expected[0][2]), SCHEMAS[expected[0][1]])


def test_a_resumed_tool_stream_continues_the_same_calls(inproc):
    body = {
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": 120,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {inproc.token}"}
    with httpx.stream("POST", inproc.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        completion_id = r.headers["X-Completion-Id"]
        whole = events(r)
    cut = whole[len(whole) // 2][0]  # an event id in the middle of the arguments
    url = f"{inproc.url}/v1/streams/{completion_id}"
    with httpx.stream("GET", url, headers={**headers, "Last-Event-ID": str(cut)}, timeout=60) as r:
        rest = events(r)

    def arguments(chunks):
        return "".join(
            piece["function"].get("arguments", "")
            for _, chunk in chunks
            for choice in chunk["choices"]
            for piece in choice["delta"].get("tool_calls", [])
        )

    before = [(i, chunk) for i, chunk in whole if i <= cut]
    assert rest and rest[0][0] > cut
    assert arguments(before) + arguments(rest) == arguments(whole)
    assert json.loads(arguments(whole))["city"]


def events(response) -> list[tuple[int, dict]]:
    """(event id, chunk) of every JSON event of an SSE response."""
    out, event_id = [], None
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: {"):
            out.append((event_id, json.loads(line[6:])))
    return out


def test_none_never_calls_and_a_named_function_is_the_only_call(inproc):
    client = sdk(inproc)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        plain = client.chat.completions.create(
            model="smollm2-135m", messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=24
        ).choices[0]
        assert plain.message.tool_calls is None and plain.message.content, plain
        assert plain.finish_reason in ("stop", "length")
        named = client.chat.completions.create(
            model="smollm2-135m",
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}},
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=80,
        ).choices[0]
        assert [c.function.name for c in named.message.tool_calls] == ["add"]


def test_a_history_with_tool_messages_continues_from_the_cache(inproc):
    client = sdk(inproc)
    messages = [{"role": "user", "content": "What is 17+25? Use the tool."}]
    first = client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=[ADD], tool_choice="required", temperature=0, max_tokens=60
    )
    tool_call = first.choices[0].message.tool_calls[0]
    args = json.loads(tool_call.function.arguments)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": str(args["a"] + args["b"])},
    ]
    second = client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=[ADD], tool_choice="none", temperature=0, max_tokens=24
    )
    assert second.choices[0].message.content
    # The whole first turn is reused, the call too: it renders back to the text the model wrote, and
    # where the model's tokens spell that text otherwise than the tokenizer does, the cache's spelling
    # is kept (the grammar made it write `{` then `"` where the tokenizer writes `{"`).
    seen = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= seen - 1, (second.usage, first.usage)
    assert httpx.get(inproc.url + "/status", headers=auth(inproc)).json()["prompt_tokens_respelled"] > 0


def test_a_bad_tool_schema_is_a_400_naming_it_and_the_server_keeps_serving(inproc):
    broken = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "required": 5}}}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(inproc).chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], tools=[ADD, broken]
        )
    error = caught.value.body
    assert error["param"] == "tools" and "'lookup'" in error["message"] and "tools[1]" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(inproc).chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], tools=[ADD], tool_choice="sometimes"
        )
    assert caught.value.body["param"] == "tool_choice"
    ok = sdk(inproc).chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], tools=[ADD], max_tokens=4
    )
    assert ok.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_langchain_bind_tools_gets_tool_calls(inproc):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(
        base_url=inproc.url + "/v1",
        api_key=inproc.token,
        model="smollm2-135m",
        temperature=0,
        max_retries=0,
        extra_body={"reproducible": True},  # invoke and stream compare token for token
    )
    message = llm.bind_tools([add], tool_choice="required").invoke("What is 2+3? Use the tool.")
    assert [c["name"] for c in message.tool_calls] == ["add"]
    assert set(message.tool_calls[0]["args"]) == {"a", "b"}
    streamed = None
    for chunk in llm.bind_tools([add], tool_choice="required").stream("What is 2+3? Use the tool."):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.tool_calls[0]["args"] == message.tool_calls[0]["args"]


# -- a template that renders tools itself -----------------------------------------------------------

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions. Signatures in <tools></tools>:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\nReturn each call as "
    '<tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{% set tc = message.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "{{ tc.name }}", "parameters": {{ tc.arguments | tojson }}}<|eot_id|>'
    "{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
NATIVE = [
    (
        HERMES_TEMPLATE,
        "hermes",
        '<tool_call>\n{"name": "add", "arguments": ',
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>",
    ),
    (
        LLAMA3_TEMPLATE,
        "llama3",
        '{"name": "add", "parameters": ',
        '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n5',
    ),
]


@pytest.mark.model
@pytest.mark.parametrize(("template", "form", "start", "history_text"), NATIVE, ids=[n[1] for n in NATIVE])
def test_a_template_that_knows_tools_renders_them_and_is_answered_in_its_own_form(template, form, start, history_text):
    engine = Engine(settings=Settings(), parallel=1, ctx_size=2048, chat_template=template)
    engine.start()
    try:
        tools = tool_request([ADD], "required", parallel_tool_calls=True)
        messages = [{"role": "user", "content": "What is 2+3?"}]
        request = engine.submit(messages=messages, params=SamplingParams(temperature=0, max_tokens=60), tools=tools)
        request.stream.wait_final(60)
        assert request.tool_form == form and request.output_text.startswith(start), request.output_text
        answer = parse_answer(request.output_text, form)
        assert answer.is_call and [c.name for c in answer.calls][:1] == ["add"]
        if form == "llama3":  # one call an answer in this form, parallel or not
            assert len(answer.calls) == 1
        jsonschema.validate(json.loads(answer.calls[0].arguments), SCHEMAS["add"])
        rendered = render_chat(messages, template, tools=tools)
        assert '{"type": "function", "function": {"name": "add", "description": "Add two' in rendered
        assert "You can call these functions" not in rendered  # the template describes them, not the generic form
        history = [
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call("c1", "add", '{"a": 2, "b": 3}')]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ]
        # The template writes the call again itself (its own spacing), then the result as it wants it.
        assert history_text in render_chat(history, template, tools=tools)
    finally:
        engine.shutdown()


def test_the_in_process_client_submits_tools_as_the_server_does(engine):
    """The in-process client (what Dask workers score with) and the HTTP server share one submit
    (api/submit.py): tools reach the engine and the answer's calls come back in OpenAI's shape."""
    from magnitude_jupyter.batch.inprocess import EngineClient

    client = EngineClient(engine)
    result = client.chat(
        [{"role": "user", "content": "What is 2 plus 3? Use the tool."}],
        tools=[ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=48,
        user="in-process-user",
        cache_salt="in-process-salt",
    )
    assert result.finish_reason == "tool_calls", (result.finish_reason, result.text)
    (call,) = result.tool_calls
    assert call["function"]["name"] == "add" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD["function"]["parameters"])
