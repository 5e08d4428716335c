"""Chat messages to a prompt, through the Jinja chat template stored in the GGUF file."""

from __future__ import annotations

import functools
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a GGUF file carries no template: ChatML, which most small instruct models follow.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
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
    return env.from_string(template)


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
        if message.get("tool_calls") is not None:
            out[-1]["tool_calls"] = message["tool_calls"]  # for chat templates that render them
    return out


def render_chat(
    messages: Any,
    template: str | None,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    normalized = normalize_messages(messages)
    try:
        return _compile(template or CHATML_TEMPLATE).render(
            messages=normalized,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except ChatFormatError:
        raise
    except TemplateError as exc:
        raise ChatFormatError(f"the model's chat template failed: {exc}") from exc
