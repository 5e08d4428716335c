"""The engine's token counts shaped as Chat Completions' `usage` (the clients read one back with
`client.exchange.token_counts`)."""

from __future__ import annotations

from typing import Any

from ..token_counts import TokenCounts

__all__ = ["TokenCounts", "openai_usage"]


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
