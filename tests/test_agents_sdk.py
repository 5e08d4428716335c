"""The OpenAI Agents SDK's default model (the Responses API) against the real app and engine."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.model

agents = pytest.importorskip("agents")


@pytest.fixture
def model(inproc):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=inproc.url + "/v1", api_key=inproc.token, max_retries=0)
    return agents.OpenAIResponsesModel(model="smollm2-135m", openai_client=client)


def test_an_agent_calls_its_function_tool_through_the_responses_api(model):
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city today."""
        return f"12 degrees and rain in {city}"

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",  # the tool's answer is the run's: the call is what is tested
        model=model,
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=96),
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Oslo?", max_turns=3))
    assert result.final_output.startswith("12 degrees and rain in")
    assert [type(item).__name__ for item in result.new_items] == ["ToolCallItem", "ToolCallOutputItem"]


def test_an_agent_answers_in_text_through_the_responses_api(model):
    # Room to end by itself: the SDK treats an answer cut at max_tokens (status "incomplete") as an error.
    settings = agents.ModelSettings(max_tokens=400, temperature=0)
    agent = agents.Agent(name="greeter", instructions="You are brief.", model=model, model_settings=settings)
    result = asyncio.run(agents.Runner.run(agent, "Say hello.", max_turns=2))
    assert isinstance(result.final_output, str) and result.final_output
