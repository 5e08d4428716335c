"""The engine's token counts, read once for every API's own `usage` shape."""

from __future__ import annotations

from typing import Any, NamedTuple


class TokenCounts(NamedTuple):
    prompt: int  # prompt tokens, computed or from the prefix cache
    cached: int  # ... of which came from the prefix cache
    output: int
    reasoning: int = 0  # ... of which a thinking model wrote inside its thinking block


def token_counts(usage: dict[str, Any] | None) -> TokenCounts:
    usage = usage or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    reasoning = int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0))
    return TokenCounts(int(usage.get("prompt_tokens", 0)), cached, int(usage.get("completion_tokens", 0)), reasoning)
