"""A small agent loop over the OpenAI tools API: Python functions become tools, the model calls them,
their results go back, until the model answers in text or the step limit is reached.

    from magnitude_jupyter import discover, run_agent

    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    run = run_agent(discover(), "What is 2+3?", [add])
    run.answer, run.steps

A function's signature and docstring become its JSON Schema (through pydantic); the server's grammar
holds the model's arguments to that schema, and pydantic checks them again before the call.
"""

from __future__ import annotations

import inspect
import json
import re
import time
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .http import Client, StreamResult

DEFAULT_MAX_STEPS = 5
ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


class AgentError(ValueError):
    """A function that cannot be a tool, or an agent run that cannot start."""


def _docstring_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The docstring's first paragraph, and the parameter descriptions of its Args: section."""
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    described: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if line.strip().lower() in ("args:", "arguments:", "parameters:"):
            in_args = True
            continue
        if in_args:
            match = ARG_LINE.match(line)
            if match:
                described[match.group(1)] = match.group(2).strip()
            elif line.strip() and not line.startswith((" ", "\t")):
                in_args = False
    return summary, described


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


@dataclass
class FunctionTool:
    """A Python function as an OpenAI tool: its schema, and the call that checks arguments first."""

    fn: Callable[..., Any]
    name: str
    description: str
    arguments_model: Any  # a pydantic model of the parameters
    parameters: dict[str, Any]  # its JSON Schema, made once (pydantic builds it anew on every call)

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> FunctionTool:
        import pydantic

        if not callable(fn):
            raise AgentError(f"{fn!r} is not a function")
        name = getattr(fn, "__name__", "")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise AgentError(f"{fn!r} has no name a tool can have (1-64 letters, digits, '_' or '-')")
        summary, described = _docstring_parts(fn)
        try:
            hints = typing.get_type_hints(fn, include_extras=True)  # Annotated constraints too
        except Exception:  # a hint that does not resolve: the parameter takes any JSON value
            hints = {}
        fields: dict[str, Any] = {}
        for param in inspect.signature(fn).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if param.kind is param.POSITIONAL_ONLY:
                raise AgentError(f"{name}: positional-only parameters cannot be named in a tool call")
            default = ... if param.default is param.empty else param.default
            info = pydantic.Field(default, description=described.get(param.name))
            fields[param.name] = (hints.get(param.name, Any), info)
        model = pydantic.create_model(f"{name}_arguments", **fields)
        parameters = _strip_titles(model.model_json_schema())
        return cls(fn, name, summary or f"The Python function {name}.", model, parameters)

    def openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def call(self, arguments_json: str) -> Any:
        """Check the arguments against the signature, then call; raises ValueError for bad arguments."""
        import pydantic

        try:
            arguments = self.arguments_model.model_validate_json(arguments_json or "{}")
        except pydantic.ValidationError as exc:
            raise ValueError(f"arguments for {self.name} do not fit its signature: {exc}") from None
        return self.fn(**{name: getattr(arguments, name) for name in type(arguments).model_fields})


@dataclass
class AgentStep:
    """One tool call: what the model asked, what the function gave back, and what it cost."""

    round: int  # the model request (1-based) that made the call
    call_id: str
    name: str
    arguments: str
    result: str | None = None
    error: str | None = None
    tool_ms: float = 0.0  # running the function
    model_ms: float | None = None  # the model request that made the call, end to end
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None


@dataclass
class AgentRun:
    answer: str | None  # the plain reply that ended the run; None when the step limit stopped it
    steps: list[AgentStep] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the whole conversation, to continue it
    rounds: list[dict[str, Any]] = field(default_factory=list)  # per model request: ms, usage, timings
    stopped: str = "answer"  # answer | step_limit | length (a call cut off by max_tokens) | error

    def provenance(self) -> dict[str, Any]:
        """JSON for a notebook's output metadata."""
        return {
            "stopped": self.stopped,
            "steps": [asdict(step) for step in self.steps],
            "rounds": self.rounds,
        }


def _result_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def answer_call(tools: dict[str, FunctionTool], call: dict[str, Any]) -> tuple[str | None, str | None]:
    """Run one OpenAI tool call with its function: (the result as text, None), or (None, what went
    wrong: a name no tool has, arguments that do not fit, or what the function raised)."""
    function = call["function"]
    tool = tools.get(function["name"])
    if tool is None:
        return None, f"no tool is named {function['name']!r}"
    try:
        return _result_text(tool.call(function["arguments"])), None
    except Exception as exc:  # the model sees what went wrong and may try again
        return None, f"{type(exc).__name__}: {exc}"


def tool_message(call_id: str, result: str | None, error: str | None) -> dict[str, Any]:
    """The `tool` message that answers a call: its result, or the error as JSON."""
    content = result if error is None else json.dumps({"error": error})
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments


def as_tools(functions: list[Callable[..., Any]] | list[FunctionTool]) -> list[FunctionTool]:
    tools = [f if isinstance(f, FunctionTool) else FunctionTool.of(f) for f in functions]
    names = [t.name for t in tools]
    if not tools:
        raise AgentError("give at least one function")
    if len(set(names)) != len(names):
        raise AgentError(f"two functions share a name: {names}")
    return tools


def run_agent(
    client: Client,
    prompt: str | list[dict[str, Any]],
    functions: list[Callable[..., Any]] | list[FunctionTool],
    *,
    max_steps: int = DEFAULT_MAX_STEPS,
    tool_choice: str = "auto",
    reset_tool_choice: bool = True,
    on_step: Callable[[AgentStep], None] | None = None,
    on_text: Callable[[str], None] | None = None,
    **body: Any,
) -> AgentRun:
    """Ask the model with these functions as tools; run each call it makes and send the result back,
    until it answers in text or `max_steps` rounds of calls were made (then `answer` is None and
    `messages` holds everything, to continue from). `tool_choice` holds for the first round; after
    a round of calls it goes back to "auto" unless `reset_tool_choice` is False (as in the OpenAI
    Agents SDK: a model made to call every round never gets to answer). A round that only repeats
    calls already made (same function, same arguments) is not run again: the next round asks for
    an answer in text (tool_choice "none"), from the results already in the history. `body` is any other request
    field (model, temperature, max_tokens...). A function that raises is reported to the model as
    an error result, so it can try again; the run itself goes on."""
    if max_steps < 1:
        raise AgentError("max_steps must be at least 1")
    tools = as_tools(functions)
    by_name = {tool.name: tool for tool in tools}
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    run = AgentRun(answer=None, messages=messages)
    schemas = [tool.openai() for tool in tools]
    made: set[tuple[str, str]] = set()
    repeated = False
    for round_number in range(1, max_steps + 1):
        started = time.perf_counter()
        result = StreamResult()
        choice = "auto" if reset_tool_choice and round_number > 1 else tool_choice
        if repeated:
            choice = "none"
        for piece in client.stream_chat(messages, result=result, tools=schemas, tool_choice=choice, **body):
            if on_text is not None:
                on_text(piece)
        model_ms = (time.perf_counter() - started) * 1000
        run.rounds.append({"round": round_number, "ms": model_ms, "usage": result.usage, "timings": result.timings})
        if not result.tool_calls:
            messages.append({"role": "assistant", "content": result.text})
            run.answer = result.text
            return run
        # Neither a call cut off by max_tokens nor a repeated round joins the history: a call there
        # must be whole and followed by its result, or the history cannot be sent again.
        if result.finish_reason != "tool_calls":
            run.stopped = result.finish_reason or "error"
            return run
        calls = {(c["function"]["name"], _canonical(c["function"]["arguments"])) for c in result.tool_calls}
        if calls <= made:
            # Every call was made before, with the same arguments, and its result is in the history:
            # a small model tends to repeat itself. Ask again, for an answer in text.
            run.rounds[-1]["repeated_calls"] = result.tool_calls
            repeated = True
            continue
        made |= calls
        repeated = False
        messages.append({"role": "assistant", "content": None, "tool_calls": result.tool_calls})
        for call in result.tool_calls:
            step = AgentStep(round_number, call["id"], call["function"]["name"], call["function"]["arguments"])
            step.model_ms, step.usage, step.timings = model_ms, result.usage, result.timings
            began = time.perf_counter()
            step.result, step.error = answer_call(by_name, call)
            step.tool_ms = (time.perf_counter() - began) * 1000
            run.steps.append(step)
            messages.append(tool_message(step.call_id, step.result, step.error))
            if on_step is not None:
                on_step(step)
    run.stopped = "step_limit"
    return run
