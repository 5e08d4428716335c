"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` as the engine's tools and ToolRequest
(the Messages and Responses APIs read their own shapes into the same types)."""

from __future__ import annotations

from typing import Any

from ..engine.tools import CHOICES, Tool, ToolError, ToolRequest, ToolSpec, check_tools


def openai_tools(raw: Any) -> list[Tool]:
    """Chat Completions' `tools` list, checked; ToolError names the field at fault."""
    if not isinstance(raw, list) or not raw:
        raise ToolError("'tools' must be a non-empty list of {type: 'function', function: {...}} objects")
    specs = []
    for i, entry in enumerate(raw):
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(function, dict):
            raise ToolError(f"tools[{i}] must be {{type: 'function', function: {{name, description, parameters}}}}")
        specs.append(
            ToolSpec(
                function.get("name"),
                function.get("description"),
                function.get("parameters"),
                at=f"tools[{i}].function",
                strict=function.get("strict"),
            )
        )
    return check_tools(specs)


def tool_request(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolRequest:
    """Raises ToolError naming the field."""
    parsed = openai_tools(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    parallel = bool(parallel_tool_calls)
    if tool_choice is None or tool_choice in CHOICES:
        return ToolRequest.of(parsed, tool_choice or "auto", None, parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError(
            "'tool_choice' must be 'auto', 'none', 'required' or {type: 'function', function: {name}}",
            "tool_choice",
        )
    return ToolRequest.of(parsed, "function", name, parallel)
