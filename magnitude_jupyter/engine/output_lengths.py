"""How long answers run here: the estimate admission charges a request for, in place of its cap.

Agents ask for thousands of tokens and mostly stop after a few hundred; charging the cap up front
serves them one at a time (docs/decisions.md, "KV cells on demand"). The estimate is a high
percentile of the answers this engine has finished lately, per client (`user`) where it has seen
enough of that client, else per priority, else a prior; a request is never charged more than its
`max_tokens`, and a wrong guess costs a preemption, never an answer.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .request import Priority

WINDOW = 256  # answers remembered per key: recent behaviour, not the server's whole history
MIN_SAMPLES = 8  # answers seen before a key's own percentile is trusted over the broader one
PERCENTILE = 90.0
PRIOR_TOKENS = 256  # before anything has finished: a long chat answer


class OutputLengths:
    """Finished answers' lengths in tokens, and the charge estimate from them."""

    def __init__(self, percentile: float = PERCENTILE, prior: int = PRIOR_TOKENS) -> None:
        self.percentile = percentile
        self.prior = prior
        self._by_priority: dict[Priority, deque[int]] = {p: deque(maxlen=WINDOW) for p in Priority}
        self._by_client: dict[str, deque[int]] = {}
        self._clients_seen: deque[str] = deque()  # oldest first: bounds how many clients are kept
        # The uncapped guess per (priority, client), until the next record: admission asks for it once
        # per waiting request per step, a percentile each time otherwise.
        self._guesses: dict[tuple[Priority, str | None], int] = {}

    def record(self, priority: Priority, client: str | None, tokens: int) -> None:
        self._guesses.clear()
        self._by_priority[priority].append(tokens)
        if client is None:
            return
        lengths = self._by_client.get(client)
        if lengths is None:
            if len(self._clients_seen) >= WINDOW:
                self._by_client.pop(self._clients_seen.popleft(), None)
            self._clients_seen.append(client)
            lengths = self._by_client[client] = deque(maxlen=WINDOW)
        lengths.append(tokens)

    def estimate(self, priority: Priority, client: str | None, max_tokens: int) -> int:
        """Tokens to charge a request for up front (at least 1, at most `max_tokens`)."""
        key = (priority, client)
        guess = self._guesses.get(key)
        if guess is None:
            if len(self._guesses) >= WINDOW:  # many clients between two records: bounded all the same
                self._guesses.clear()
            guess = self._guesses[key] = self._guess(priority, client)
        return max(1, min(max_tokens, guess))

    def _guess(self, priority: Priority, client: str | None) -> int:
        lengths = self._by_client.get(client) if client is not None else None
        if lengths is None or len(lengths) < MIN_SAMPLES:
            lengths = self._by_priority[priority]
        if len(lengths) < MIN_SAMPLES:
            lengths = deque(n for q in self._by_priority.values() for n in q)
        return self.prior if len(lengths) < MIN_SAMPLES else int(np.percentile(lengths, self.percentile)) + 1
