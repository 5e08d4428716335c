"""Chat messages to a prompt, through the Jinja chat template stored in the GGUF file."""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from .template_budget import BudgetedEnvironment, TemplateBudgetError
from .template_budget import render as render_within_budget
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
    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True)
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


# Where a control token's text stood in a message: MARK_OPEN, its index in the shielded list, MARK_CLOSE
# (characters of Unicode's private use area, which templates pass through as they are).
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"
MARK = re.compile("\ue000([0-9]+)\ue001")


def _shield_text(text: str, pattern: re.Pattern[str], shielded: list[str]) -> str:
    def mark(match: re.Match[str]) -> str:
        shielded.append(match.group(0))
        return f"{MARK_OPEN}{len(shielded) - 1}{MARK_CLOSE}"

    return pattern.sub(mark, text)


@functools.lru_cache(maxsize=8)
def _control_pattern(texts: tuple[str, ...]) -> re.Pattern[str]:
    """One pattern for every text, written as a trie (`<\\|im_(?:start|end)\\|>`): matching it reads
    each character once, where a plain alternation would try every text at every `<` (a
    vocabulary may hold thousands of control tokens, and a prompt thousands of `<`)."""
    trie: dict[str, dict] = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}  # a text ends here
    return re.compile(_trie_regex(trie))


def _trie_regex(node: dict[str, dict]) -> str:
    branches = [re.escape(char) + _trie_regex(child) for char, child in sorted(node.items()) if char]
    ends = "" in node
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f"(?:{body})?" if ends else body


def _shield_messages(messages: list[dict[str, Any]], texts: tuple[str, ...], shielded: list[str]) -> None:
    """Each control token's text in the messages' text (content, tool-call arguments) replaced by a mark."""
    pattern = _control_pattern(texts)
    for message in messages:
        message["content"] = _shield_text(message["content"], pattern, shielded)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_shield_call(call, pattern, shielded) for call in calls]


def _shield_call(call: Any, pattern: re.Pattern[str], shielded: list[str]) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": _shield_text(function["arguments"], pattern, shielded)}}


def split_shielded(text: str, shielded: list[str]) -> list[tuple[str, bool]]:
    """A rendered prompt as (piece, is it message text that spelled a control token), in order."""
    pieces: list[tuple[str, bool]] = []
    at = 0
    for match in MARK.finditer(text):
        index = int(match.group(1))
        if index >= len(shielded):
            continue
        if match.start() > at:
            pieces.append((text[at : match.start()], False))
        pieces.append((shielded[index], True))
        at = match.end()
    if at < len(text):
        pieces.append((text[at:], False))
    return pieces


def restore_shielded(text: str, shielded: list[str]) -> str:
    """The rendered prompt as the model reads it: each mark back to the text it stood for."""
    return "".join(piece for piece, _ in split_shielded(text, shielded))


def render_chat(
    messages: Any,
    template: str | None,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    tools: ToolRequest | None = None,
    enable_thinking: bool | None = None,
    shield: tuple[str, ...] = (),
    shielded: list[str] | None = None,
) -> str:
    """`enable_thinking`: given to templates that read it (Qwen3's and others': False turns thinking off).
    `shield`: control tokens' texts that, written in a message, are replaced by marks, each original
    appended to `shielded` (`split_shielded` puts them back, to be tokenized as plain text)."""
    messages, template_tools = _tool_ready(messages, template, tools)
    normalized = normalize_messages(messages)
    if shield and shielded is not None:
        _shield_messages(normalized, shield, shielded)
    extra: dict[str, Any] = {"tools": template_tools} if template_tools else {}
    if enable_thinking is not None:
        extra["enable_thinking"] = enable_thinking
    try:
        return render_within_budget(
            _compile(template or CHATML_TEMPLATE),
            messages=normalized,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except ChatFormatError:
        raise
    except TemplateBudgetError as exc:
        raise ChatFormatError(f"the model's chat template was stopped: {exc}") from None
    except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError, MemoryError) as exc:
        # A model file's template is not the server's code: whatever breaks in it is said, not a 500.
        raise ChatFormatError(f"the model's chat template failed: {type(exc).__name__}: {exc}"[:500]) from None
