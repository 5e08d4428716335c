"""Prompt-lookup drafts: guess a greedy answer's next tokens from where its last tokens appeared before.

A conversation resends its history, and small models repeat themselves and their prompt: when the
last `n` tokens of a sequence occurred earlier in it, the tokens that followed them then are a good
guess for what follows now. The guess (the draft) is decoded in the same step as the sequence's
next token, each draft token with its own logits row; the sequence keeps the drafts that its greedy
pick confirms, one by one, plus the pick at the first mismatch, so a step yields 1 to k+1 tokens,
the same ones that one-token steps would have picked. (Prompt lookup decoding, as in llama.cpp's
`lookup` example and vLLM's n-gram speculation; no draft model.)

A draft token costs a row of compute whether it is kept or not. On a CPU, a step of a few sequences
is bound by reading the weights, and extra rows are nearly free; a step of many is bound by
arithmetic, and every row costs about what a sequence's own token does. So drafts are made only
while few sequences decode (`EngineSettings.draft_max_sequences`).
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM = 3  # tokens that must match: 1 or 2 find many guesses that are wrong; 3 keeps most of the right ones


class NgramIndex:
    """Where each `NGRAM`-token run of one sequence's tokens last occurred, kept as tokens arrive."""

    def __init__(self, n: int = NGRAM) -> None:
        self.n = n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # run -> position of the token that followed it last

    def extend(self, tokens: Sequence[int]) -> None:
        n, seen, after = self.n, self.tokens, self._after
        for token in tokens:
            seen.append(token)
            end = len(seen) - 1
            if end >= n:
                after[tuple(seen[end - n : end])] = end

    def draft(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the last occurrence of the current final run; [] if none."""
        if k <= 0 or len(self.tokens) < self.n:
            return []
        start = self._after.get(tuple(self.tokens[-self.n :]))
        if start is None:
            return []
        return self.tokens[start : start + k]


def accepted(draft: Sequence[int], picks: Sequence[int]) -> int:
    """How many draft tokens the picks confirm: `picks[i]` is the token chosen after draft[:i]."""
    n = 0
    while n < len(draft) and n < len(picks) and picks[n] == draft[n]:
        n += 1
    return n
