"""Chat messages to a prompt, through the Jinja chat template stored in the GGUF file."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tools import ToolError, generic_messages, native_messages, template_form

if TYPE_CHECKING:
    from .tools import ToolRequest

from ..models.chat_formats import CHATML_TEMPLATE  # where no template is given at all: engines without a model file

ROLES = {"system", "user", "assistant", "tool", "developer"}


class ChatFormatError(ValueError):
    """The messages cannot be rendered; the message says which one and why."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def _raise(message: str) -> None:
    raise ChatFormatError(f"the chat template refused the messages: {message}")


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson  # Hugging Face's: plain JSON (Jinja's own escapes <, > and & for HTML)
    return env.from_string(template)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts are understood here
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"messages[{index}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatFormatError(f"messages[{index}].content must be a string, got {type(content).__name__}")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatFormatError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, got {role!r}")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""  # OpenAI's shape for an assistant turn that only called tools
        out.append({"role": "system" if role == "developer" else role, "content": _content_text(content, i)})
        for key in TOOL_KEYS:  # for chat templates that render tool turns themselves
            if message.get(key) is not None:
                out[-1][key] = message[key]
    return out


TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


def _uses_tools(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages
    )


def _tool_ready(messages: Any, template: str | None, tools: ToolRequest | None) -> tuple[Any, list[Any] | None]:
    """The messages as the template should see them, and the tools it renders itself (if any)."""
    if tools is None and not _uses_tools(messages):
        return messages, None
    normalize_messages(messages)  # shape errors first, named as before
    try:
        if template_form(template).native:
            return native_messages(messages), [tool.for_template() for tool in tools.tools] if tools else None
        return generic_messages(messages, tools.tools if tools else None, _content_text), None
    except ToolError as exc:
        raise ChatFormatError(str(exc), exc.param) from None


def render_chat(
    messages: Any,
    template: str | None,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    tools: ToolRequest | None = None,
    enable_thinking: bool | None = None,
) -> str:
    """`enable_thinking`: given to templates that read it (Qwen3's and others': False turns thinking off)."""
    messages, template_tools = _tool_ready(messages, template, tools)
    normalized = normalize_messages(messages)
    extra: dict[str, Any] = {"tools": template_tools} if template_tools else {}
    if enable_thinking is not None:
        extra["enable_thinking"] = enable_thinking
    try:
        return _compile(template or CHATML_TEMPLATE).render(
            messages=normalized,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except ChatFormatError:
        raise
    except TemplateError as exc:
        raise ChatFormatError(f"the model's chat template failed: {exc}") from exc
