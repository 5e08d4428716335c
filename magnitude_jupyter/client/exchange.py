"""One request's client-side plumbing, shared by the magics, the CLI, batch scoring, calibration,
agents and the benchmarks: the messages of a prompt, a usage block's figures, a timed streamed answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..token_counts import TokenCounts
from .http import StreamResult

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["TimedAnswer", "TokenCounts", "prompt_messages", "timed_stream", "token_counts"]


def token_counts(usage: dict[str, Any] | None) -> TokenCounts:
    """A server's OpenAI `usage` (None: it sent none) as counts."""
    usage = usage or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    reasoning = int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0))
    return TokenCounts(int(usage.get("prompt_tokens", 0)), cached, int(usage.get("completion_tokens", 0)), reasoning)


class StreamingClient(Protocol):
    def stream_chat(
        self, messages: list[dict[str, Any]], result: StreamResult | None = None, max_resumes: int = ..., **body: Any
    ) -> Iterator[str]: ...


def prompt_messages(prompt: str, system: str | None = None) -> list[dict[str, Any]]:
    """A one-turn conversation: the system message (if any), then the prompt as the user's."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


@dataclass
class TimedAnswer:
    """A streamed answer and when its pieces came: time to the first, between each, to the end."""

    result: StreamResult
    ttft_s: float | None = None
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    pieces: int = 0

    @property
    def counts(self) -> TokenCounts:
        return token_counts(self.result.usage)


def timed_stream(client: StreamingClient, messages: list[dict[str, Any]], **body: Any) -> TimedAnswer:
    """Stream one chat answer to its end, timing it (a ClientError propagates)."""
    timed = TimedAnswer(StreamResult())
    start = last = time.perf_counter()
    for _ in client.stream_chat(messages, result=timed.result, **body):
        now = time.perf_counter()
        if timed.ttft_s is None:
            timed.ttft_s = now - start
        else:
            timed.gaps_s.append(now - last)
        last = now
        timed.pieces += 1
    timed.e2e_s = time.perf_counter() - start
    return timed
