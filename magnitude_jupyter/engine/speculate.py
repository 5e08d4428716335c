"""Prompt-lookup drafts: guess a greedy answer's next tokens from where its last tokens appeared before.

A conversation resends its history, and small models repeat themselves and their prompt: when the
last `n` tokens of a sequence occurred earlier in it, the tokens that followed them then are a good
guess for what follows now. The guess (the draft) is decoded in the same step as the sequence's
next token, each draft token with its own logits row; the sequence keeps the drafts that its greedy
pick confirms, one by one, plus the pick at the first mismatch, so a step yields 1 to k+1 tokens,
the ones one-token steps pick (bit for bit on one thread; on several, llama.cpp divides a one-token
step's attention between them and rounds differently, as any change of batch does). (Prompt lookup
decoding, as in llama.cpp's `lookup` example and vLLM's n-gram speculation; no draft model.)

How many of the guessed tokens a step decodes is `draft_policy.py`'s call: a draft token costs a
row of compute whether it is kept or not, so it is decoded only where its chance of being kept
outweighs that cost on this machine, now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NGRAM = 4  # tokens that must match: fewer find more guesses, and more of them wrong
MAX_MATCH = 16  # how far back a match is measured (a longer match is a better guess, up to here)


@dataclass(frozen=True)
class Guess:
    tokens: list[int]  # what followed the last occurrence of the sequence's final run
    matched: int  # how many tokens before them match the sequence's last ones (NGRAM to MAX_MATCH)


class NgramIndex:
    """Where each `NGRAM`-token run of one sequence's tokens last occurred, kept as tokens arrive."""

    def __init__(self, n: int = NGRAM) -> None:
        self.n = n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # run -> position of the token that followed it last
        # This sequence's own record, against what the policy expected of its guesses (draft_policy.py).
        self.kept = 0.0
        self.expected = 0.0

    def extend(self, tokens: Sequence[int]) -> None:
        n, seen, after = self.n, self.tokens, self._after
        for token in tokens:
            seen.append(token)
            end = len(seen) - 1
            if end >= n:
                after[tuple(seen[end - n : end])] = end

    def guess(self, k: int) -> Guess | None:
        """Up to `k` tokens that followed the last occurrence of the current final run, and how long
        the match there is; None if the run never occurred before."""
        tokens = self.tokens
        if k <= 0 or len(tokens) < self.n:
            return None
        start = self._after.get(tuple(tokens[-self.n :]))
        if start is None:
            return None
        matched, end = self.n, len(tokens)
        while matched < MAX_MATCH and start > matched and tokens[start - matched - 1] == tokens[end - matched - 1]:
            matched += 1
        return Guess(tokens[start : start + k], matched)
