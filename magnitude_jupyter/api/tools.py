"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` as the engine's ToolRequest: the other
APIs shape their own fields into these first."""

from __future__ import annotations

from typing import Any

from ..engine.tools import CHOICES, ToolError, ToolRequest, parse_tools


def tool_request(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolRequest:
    """Raises ToolError naming the field."""
    parsed = parse_tools(tools)
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
