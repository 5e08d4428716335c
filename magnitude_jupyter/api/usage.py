"""Token counts and OpenAI's `usage`: the engine's counts shaped as Chat Completions' usage, and a
`usage` a server sent read back into counts (the clients)."""

from __future__ import annotations

from typing import Any

from ..token_counts import TokenCounts

__all__ = ["TokenCounts", "openai_usage", "token_counts"]


def openai_usage(counts: TokenCounts | None) -> dict[str, Any] | None:
    """Chat Completions' (and completions') `usage` object."""
    if counts is None:
        return None
    usage: dict[str, Any] = {
        "prompt_tokens": counts.prompt,
        "completion_tokens": counts.output,
        "total_tokens": counts.prompt + counts.output,
        "prompt_tokens_details": {"cached_tokens": counts.cached},
    }
    if counts.reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": counts.reasoning}
    return usage


def token_counts(usage: dict[str, Any] | None) -> TokenCounts:
    """A server's OpenAI `usage` (None: it sent none) as counts."""
    usage = usage or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    reasoning = int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0))
    return TokenCounts(int(usage.get("prompt_tokens", 0)), cached, int(usage.get("completion_tokens", 0)), reasoning)
