"""What an answer took in tokens: the engine counts them so, and a client reads a server's `usage`
back into them. No wire format: each API shapes them as its own `usage` (api/)."""

from __future__ import annotations

from typing import NamedTuple


class TokenCounts(NamedTuple):
    """What one answer took in tokens: the engine's figures, which each API shapes as its own `usage`."""

    prompt: int  # prompt tokens, computed or from the prefix cache
    cached: int  # ... of which came from the prefix cache
    output: int
    reasoning: int = 0  # ... of which a thinking model wrote inside its thinking block
