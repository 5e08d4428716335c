"""The agent loop: Python functions as tools, from plain Python and from `%%magnitude --tools` in a
real kernel, against the real server and the bundled model."""

from __future__ import annotations

import json

import jsonschema
import pytest

from magnitude_jupyter.client.agent import AgentError, FunctionTool, run_agent
from magnitude_jupyter.client.http import Client

from .notebook_helpers import run_notebook, text_outputs


def forecast(city: str, days: int = 1, unit: str = "celsius") -> dict:
    """Today's weather in a city.

    Args:
        city: the city's name
        days (int): how many days ahead
    """
    return {"city": city, "days": days, "unit": unit}


def test_a_function_becomes_a_tool_from_its_signature_and_docstring():
    tool = FunctionTool.of(forecast).openai()["function"]
    assert tool["name"] == "forecast" and tool["description"] == "Today's weather in a city."
    parameters = tool["parameters"]
    assert parameters["required"] == ["city"]
    assert parameters["properties"]["days"] == {"type": "integer", "default": 1, "description": "how many days ahead"}
    assert parameters["properties"]["city"]["description"] == "the city's name"
    jsonschema.validators.validator_for(parameters).check_schema(parameters)
    assert FunctionTool.of(forecast).call('{"city": "Oslo", "days": 2}') == {
        "city": "Oslo",
        "days": 2,
        "unit": "celsius",
    }
    with pytest.raises(ValueError, match="do not fit its signature"):
        FunctionTool.of(forecast).call('{"days": 2}')

    def positional(a: int, /) -> int:
        return a

    with pytest.raises(AgentError, match="positional-only"):
        FunctionTool.of(positional)


def add_recorder():
    made = []

    def add(a: int, b: int) -> int:
        """Add two integers."""
        made.append((a, b))
        return a + b

    return add, made


def test_the_loop_runs_the_function_feeds_the_result_back_and_ends(inproc):
    add, made = add_recorder()
    client = Client(inproc.url, inproc.token)
    run = run_agent(
        client, "What is 2+3?", [add], tool_choice="required", temperature=0, max_tokens=80, reproducible=True
    )
    assert made and made[0] == (2, 3)
    assert run.steps[0].name == "add" and run.steps[0].result == "5" and run.steps[0].tool_ms >= 0
    # the result went back to the model, as the tool message of the call it answers
    results = [m for m in run.messages if m["role"] == "tool"]
    assert results[0] == {"role": "tool", "tool_call_id": run.steps[0].call_id, "content": "5"}
    assert run.stopped == "answer" and run.answer is not None  # a small model may answer badly, but it answers
    # The model repeated its call (a round not run again): every call in the history is followed by
    # its result, so the conversation can be sent again (OpenAI's servers refuse one that is not).
    assert any("repeated_calls" in r for r in run.rounds)
    for i, message in enumerate(run.messages):
        for call in message.get("tool_calls") or []:
            answered = [m.get("tool_call_id") for m in run.messages[i + 1 :] if m["role"] == "tool"]
            assert call["id"] in answered, run.messages
    provenance = json.loads(json.dumps(run.provenance()))
    assert provenance["steps"][0]["arguments"] == '{"a": 2, "b": 3}' and provenance["rounds"][0]["usage"]


def test_the_loop_stops_at_the_step_limit(inproc):
    add, made = add_recorder()
    client = Client(inproc.url, inproc.token)
    run = run_agent(client, "What is 2+3?", [add], max_steps=1, tool_choice="required", temperature=0, max_tokens=80)
    assert run.stopped == "step_limit" and run.answer is None
    assert len(made) == len(run.steps) == 1 and len(run.rounds) == 1
    assert run.messages[-1]["role"] == "tool"  # everything kept, to continue from


@pytest.mark.model
def test_the_magic_calls_notebook_functions_and_keeps_every_step(connected, tmp_path):
    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            "calls = []\n"
            "def add(a: int, b: int) -> int:\n"
            '    """Add two integers."""\n'
            "    calls.append((a, b))\n"
            "    return a + b",
            "%%magnitude --tools add --tool-choice required --max-steps 1 --max-tokens 80\nWhat is 2+3?",
            "%%magnitude --chat maths --tools add --tool-choice required --max-tokens 80\nWhat is 2+3?",
            "print(calls[0], len(calls) >= 2)",
            "%magnitude history maths",
            "%%magnitude --tools nope\nhi",
        ],
        tmp_path,
        allow_errors=True,
    )
    limited = text_outputs(nb.cells[2])
    assert "→ add(" in limited and "← 5" in limited and "stopped at the step limit" in limited
    (display,) = [o for o in nb.cells[3].outputs if o.output_type == "display_data"]
    agent = display.metadata["magnitude"]["agent"]
    assert agent["steps"][0]["name"] == "add" and agent["steps"][0]["result"] == "5"
    assert agent["steps"][0]["model_ms"] > 0 and agent["rounds"][0]["timings"]["ttft_ms"] > 0
    assert text_outputs(nb.cells[4]).strip() == "(2, 3) True"  # the first cell's call is reproducible
    history = nb.cells[5].outputs[0].data["text/plain"]
    assert "tool" in history  # the calls and results are part of the conversation now
    assert "'nope', which is not defined in the notebook" in text_outputs(nb.cells[6])
