"""What a grammar cannot hold is checked after generation, never refused (engine/answer_check.py).

The fast tier: which keywords the grammar leaves out, and the check itself (RE2 patterns, one-pass
`uniqueItems`, refusals of what cannot be checked safely). With the real engine behind the real
app, on every API through the official SDKs: schemas whose grammar decides the answer, so the
check passes or fails by construction (an object whose only property is required, and a `not`
that refuses it), whatever the model writes.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from magnitude_jupyter.api.tools import tool_request
from magnitude_jupyter.engine.answer_check import AnswerCheck, SchemaCheck
from magnitude_jupyter.engine.gbnf_check import check_grammar_language
from magnitude_jupyter.engine.schema_grammar import UNHELD_KEYWORDS, grammar_for_schema
from magnitude_jupyter.engine.schema_limits import GrammarError

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
ANSWER["additionalProperties"] = False
# The grammar writes {"answer": ...}; `propertyNames` agrees with it, `not` never does.
PASSES = {**ANSWER, "propertyNames": {"pattern": "^answer$"}}
FAILS = {**ANSWER, "not": {"required": ["answer"]}}


@pytest.mark.parametrize("keyword", UNHELD_KEYWORDS)
def test_every_keyword_no_grammar_holds_is_left_to_the_check_by_name(keyword):
    values = {"if": {"type": "object"}, "then": {"type": "object"}, "else": {"type": "object"}}
    value = values.get(keyword, {"type": "string"} if "Schemas" in keyword or keyword in ("not", "contains") else 1)
    if keyword in ("uniqueItems",):
        value = True
    if keyword in ("patternProperties", "dependentSchemas", "dependentRequired"):
        value = {"x": {"type": "string"}} if keyword != "dependentRequired" else {"x": ["y"]}
    if keyword in ("propertyNames", "unevaluatedProperties", "unevaluatedItems"):
        value = {"type": "string"} if keyword == "propertyNames" else False
    held = grammar_for_schema({"type": "object", "properties": {"x": {"type": "string"}}, keyword: value})
    assert any(f"'{keyword}'" in words for words in held.unheld), held.unheld
    check_grammar_language(held.grammar)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "format": "email"}, "format 'email'"),
        ({"type": "number", "exclusiveMinimum": -1.5}, "'exclusiveMinimum' on a number"),
        ({"type": "number", "minimum": 0.5}, "'minimum' 0.5"),
        ({"type": "number", "minimum": -3, "maximum": 3}, "without a 'minimum' of 0 or more"),
    ],
)
def test_formats_and_number_bounds_the_grammar_cannot_write_are_left_to_the_check(schema, words):
    held = grammar_for_schema(schema)
    assert any(words in w for w in held.unheld), held.unheld
    assert SchemaCheck(schema).problem("nope" if schema["type"] == "string" else -10) is not None


def test_what_the_grammar_holds_needs_no_check():
    assert grammar_for_schema(ANSWER).unheld == ()
    assert grammar_for_schema({"type": "string", "format": "date-time"}).unheld == ()
    assert AnswerCheck.of(None, (), None) is None


def test_patterns_are_checked_by_re2_in_linear_time():
    check = SchemaCheck({"type": "object", "patternProperties": {"^(a|a)*b$": {"type": "integer"}}})
    assert check.problem({"a" * 100_000 + "c": "x"}) is None  # Python's re backtracks for ever here
    assert check.problem({"aab": "x"}) is not None
    names = SchemaCheck({"type": "object", "propertyNames": {"pattern": "^(x+x+)+y$"}})
    assert "does not match" in str(names.problem({"x" * 50_000: 1}))
    closed = SchemaCheck({"type": "object", "patternProperties": {"^p_": {}}, "additionalProperties": False})
    assert closed.problem({"p_a": 1}) is None and "not allowed" in str(closed.problem({"q": 1}))


def test_unique_items_compares_values_as_json_does_in_one_pass():
    check = SchemaCheck({"type": "array", "uniqueItems": True})
    assert check.problem([{"a": 1}, {"a": 1.0}]) is not None  # 1 and 1.0 are the same JSON number
    assert check.problem([1, True, "1", None, [1], {"a": [1]}]) is None  # true is not 1
    assert check.problem([{"k": i} for i in range(20_000)]) is None  # pairwise would take minutes


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "object", "propertyNames": {"pattern": "^(a)\\1$"}}, "back-references"),
        ({"type": "object", "patternProperties": {"(?=a)": {}}}, "back-references and lookarounds"),
        ({"type": "object", "patternProperties": {"^a": {}}, "unevaluatedProperties": False}, "unevaluated"),
        ({"type": "object", "minProperties": "two"}, "not valid"),
    ],
)
def test_what_cannot_be_checked_safely_is_refused_by_name(schema, words):
    with pytest.raises(GrammarError, match=words):
        AnswerCheck.of(schema, ("x",), None)


def test_tool_arguments_are_checked_per_tool_and_the_message_names_the_keyword():
    tools = tool_request(
        [
            {"type": "function", "function": {"name": "held", "parameters": ANSWER}},
            {"type": "function", "function": {"name": "checked", "parameters": FAILS}},
        ]
    )
    assert tools.tools[0].unheld == () and tools.tools[1].unheld == ("'not' in the parameters",)
    check = AnswerCheck.of(None, (), tools)
    assert check is not None and set(check.tools) == {"checked"}
    call = '{{"tool_calls": [{{"name": "{}", "arguments": {{"answer": "yes"}}}}]}}'
    assert check.problem(call.format("held"), "generic") is None
    problem = check.problem(call.format("checked"), "generic")
    assert problem is not None and "'checked'" in problem and "'not' in the parameters" in problem
    assert check.problem("Plain words, no call.", "generic") is None


# -- through the real app, on every API ---------------------------------------------------------


@pytest.fixture
def oa(inproc):
    return openai.OpenAI(base_url=inproc.url + "/v1", api_key=inproc.token, max_retries=0, timeout=300)


@pytest.fixture
def claude(inproc):
    return anthropic.Anthropic(base_url=inproc.url, api_key=inproc.token, max_retries=0, timeout=300)


def _format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


ASK = [{"role": "user", "content": "Is the sky blue? Answer as JSON."}]


def test_chat_completions_check_the_answer_against_what_the_grammar_left_out(oa):
    ok = oa.chat.completions.create(
        model="smollm2-135m", messages=ASK, max_tokens=48, temperature=0, response_format=_format(PASSES)
    )
    assert ok.choices[0].finish_reason == "stop" and json.loads(ok.choices[0].message.content)["answer"]
    bad = oa.chat.completions.create(
        model="smollm2-135m", messages=ASK, max_tokens=48, temperature=0, response_format=_format(FAILS)
    )
    assert bad.choices[0].finish_reason == "error"
    assert json.loads(bad.choices[0].message.content)["answer"]  # the answer is kept
    error = bad.model_extra["magnitude"]["error"]
    assert "'not' in the schema" in error and "checked after generation" in error
    chunks = list(
        oa.chat.completions.create(
            model="smollm2-135m",
            messages=ASK,
            max_tokens=48,
            temperature=0,
            response_format=_format(FAILS),
            stream=True,
        )
    )
    assert chunks[-1].choices[0].finish_reason == "error"
    assert "'not'" in chunks[-1].model_extra["magnitude"]["error"]


def test_completions_check_the_answer_too(oa):
    done = oa.completions.create(
        model="smollm2-135m",
        prompt="Is the sky blue? JSON:",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": _format(FAILS)},
    )
    assert done.choices[0].finish_reason == "error"


def test_tool_calls_are_checked_against_their_whole_schema(oa):
    def call(parameters):
        tool = {"type": "function", "function": {"name": "answer", "parameters": parameters}}
        return oa.chat.completions.create(
            model="smollm2-135m", messages=ASK, max_tokens=64, temperature=0, tools=[tool], tool_choice="required"
        )

    ok = call(PASSES)
    assert ok.choices[0].finish_reason == "tool_calls"
    assert json.loads(ok.choices[0].message.tool_calls[0].function.arguments)["answer"]
    bad = call(FAILS)
    assert bad.choices[0].finish_reason == "error" and bad.choices[0].message.tool_calls  # kept, marked
    assert "'answer'" in bad.model_extra["magnitude"]["error"]


def test_the_responses_api_reports_a_failed_check_as_a_failed_response(oa):
    def respond(schema):
        return oa.responses.create(
            model="smollm2-135m",
            input="Is the sky blue? Answer as JSON.",
            max_output_tokens=48,
            temperature=0,
            text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        )

    assert respond(PASSES).status == "completed"
    failed = respond(FAILS)
    assert failed.status == "failed" and "'not'" in failed.error.message


def test_the_messages_api_reports_a_failed_check_in_its_error_shape(claude):
    def ask(schema, **extra):
        return claude.messages.create(
            model="smollm2-135m",
            max_tokens=48,
            messages=ASK,
            extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": schema}}},
            **extra,
        )

    assert json.loads(ask(PASSES).content[0].text)["answer"]
    with pytest.raises(anthropic.InternalServerError, match="checked after generation"):
        ask(FAILS)
    tool = {"name": "answer", "description": "Answer.", "input_schema": PASSES}
    used = claude.messages.create(
        model="smollm2-135m",
        max_tokens=64,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "tool", "name": "answer"},
        extra_body={"temperature": 0},
    )
    assert used.stop_reason == "tool_use" and used.content[-1].input["answer"] in ("yes", "no")
    with (
        claude.messages.stream(
            model="smollm2-135m",
            max_tokens=48,
            messages=ASK,
            extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": FAILS}}},
        ) as stream,
        pytest.raises(anthropic.APIStatusError, match="checked after generation"),
    ):
        list(stream)
