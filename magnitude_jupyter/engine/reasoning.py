"""An answer's reasoning apart from its content: the text between a thinking model's tags.

Models that think (Qwen3, DeepSeek-R1 distills, QwQ, SmolLM3...) write `<think>…</think>` before
their answer; gpt-oss writes its reasoning in the analysis channel of its harmony format and its
answer in the final channel. Clients expect the reasoning in a field of its own (`reasoning_content`,
as llama.cpp's server and vLLM give it) and the answer clean. Templates often open the block
themselves at the end of the prompt, so the answer may start inside it. A tag can arrive split over
tokens, so text that could still become a tag is held back, as the stop strings' assembler does
(text.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .text import held_back


@dataclass(frozen=True)
class ReasoningTags:
    """How a format marks its reasoning, as its answers' text reads: what opens and closes it, what
    the engine writes to close it for the model, and channel headers outside it that are not part
    of the answer."""

    open: str
    close: str
    force: str
    drop: tuple[str, ...] = ()


THINK = ReasoningTags("<think>", "</think>", "\n</think>")
# gpt-oss (harmony): the answer follows the prompt's `<|start|>assistant`; the analysis channel's
# message is the reasoning, then the model ends it and starts the final channel, or writes the final
# channel straight away. llama.cpp renders these markers as text (it makes them user-defined tokens).
# The analysis message ends where the next message starts: the final channel's answer, or a
# commentary-channel tool call (tools.HARMONY), whose header is then the call's own text.
HARMONY_FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"
HARMONY = ReasoningTags(
    "<|channel|>analysis<|message|>",
    "<|end|><|start|>assistant",
    HARMONY_FINAL,
    drop=("<|channel|>final<|message|>",),
)


def reasoning_tags(template: str | None) -> ReasoningTags | None:
    """How a chat template's model marks its reasoning (None: its answers carry none)."""
    if not template:
        return None
    if "<|channel|>" in template and "<|message|>" in template:
        return HARMONY
    if THINK.open in template and THINK.close in template:
        return THINK
    return None


def prompt_opens_thinking(prompt: str, tags: ReasoningTags = THINK) -> bool:
    """Whether a rendered prompt ends inside a thinking block the template opened for the answer."""
    opened = prompt.rfind(tags.open)
    return opened >= 0 and prompt.rfind(tags.close) < opened


@dataclass(frozen=True)
class Thinking:
    """What a request asks of a thinking model: its reasoning apart from the answer (`split`, as
    clients expect) or inline as written; thinking on or off where the template reads
    `enable_thinking` (None: the template's default); and at most `budget_tokens` of it, after which
    the engine closes the block for the model and it answers (None: no cap)."""

    split: bool = True
    enabled: bool | None = None
    budget_tokens: int | None = None


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Final text in, (reasoning, content) out; `inside` while the answer is in a thinking block.
    `inline`: everything stays content, as written, and the splitter only follows the block."""

    def __init__(self, inside: bool = False, tags: ReasoningTags = THINK, inline: bool = False) -> None:
        self.open_tag, self.close_tag, self.drop, self.force = tags.open, tags.close, tags.drop, tags.force
        self.inline = inline
        self.inside = inside
        self.seen_reasoning = inside
        self._held = ""
        self._content_started = False  # the blank lines templates put after </think> are not content

    def push(self, text: str) -> Split:
        out = self._push(text)
        return Split(content=text) if self.inline else out  # (_push follows the block all the same)

    def _push(self, text: str) -> Split:
        out = Split()
        text = self._held + text
        self._held = ""
        while text:
            tag = self.close_tag if self.inside else self.open_tag
            at = text.find(tag)
            if not self.inside:  # a channel header before the open tag is dropped, not content
                dropped = min(
                    ((i, d) for d in self.drop if (i := text.find(d)) >= 0 and (at < 0 or i < at)), default=None
                )
                if dropped is not None:
                    i, header = dropped
                    self._emit(out, text[:i])
                    text = text[i + len(header) :]
                    self.seen_reasoning = True  # (what follows a header is the answer: its leading blank too)
                    continue
            if at >= 0:
                self._emit(out, text[:at])
                text = text[at + len(tag) :]
                self.inside = not self.inside
                self.seen_reasoning = self.seen_reasoning or self.inside
                self._content_started = self._content_started and self.inside
                continue
            keep = held_back(text, [tag, *(() if self.inside else self.drop)])
            self._emit(out, text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return out

    def flush(self) -> Split:
        """At the end of the answer: what was held back could not become a tag."""
        out = Split()
        self._emit(out, self._held)
        self._held = ""
        return Split() if self.inline else out

    def _emit(self, out: Split, text: str) -> None:
        if self.inside:
            out.reasoning += text
            return
        if self.seen_reasoning and not self._content_started:
            text = text.lstrip()
        self._content_started = self._content_started or bool(text)
        out.content += text
