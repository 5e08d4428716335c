"""Prompt-lookup drafts: guess a greedy answer's next tokens from where its last tokens appeared before.

A conversation resends its history, and small models repeat themselves and their prompt: when the
last `n` tokens of a sequence occurred earlier in it, the tokens that followed them then are a good
guess for what follows now. The guess (the draft) is decoded in the same step as the sequence's
next token, each draft token with its own logits row; the sequence keeps the drafts that its greedy
pick confirms, one by one, plus the pick at the first mismatch, so a step yields 1 to k+1 tokens,
the ones one-token steps pick (bit for bit on one thread; on several, llama.cpp divides a one-token
step's attention between them and rounds differently, as any change of batch does). (Prompt lookup
decoding, as in llama.cpp's `lookup` example and vLLM's n-gram speculation; no draft model.)

Guesses come from the sequence itself and, through `AnswerMemory`, from the answers that finished
before it: a notebook cell run again, an agent's retry or a batch row like an earlier one asks for
an answer the engine has already given, and its greedy tokens then confirm the earlier ones.
(llama.cpp's `lookup` example keeps such a "dynamic" n-gram cache across generations too; REST,
He et al. 2023, drafts from a datastore of text the same way.)

How many of the guessed tokens a step decodes is `draft_policy.py`'s call: a draft token costs a
row of compute whether it is kept or not, so it is decoded only where its chance of being kept
outweighs that cost on this machine, now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NGRAM = 4  # tokens that must match: fewer find more guesses, and more of them wrong
MAX_MATCH = 16  # how far back a match is measured (a longer match is a better guess, up to here)
MEMORY_KEY = 8  # tokens that must match an earlier answer: its prompt's tail ends in a chat template's
# turn header, which every answer shares, so the key must reach into the user's words before it
MEMORY_TOKENS = 32_768  # tokens of earlier answers kept (the newest half is kept when it is full)


def matched_before(source: Sequence[int], start: int, tokens: Sequence[int], matched: int = 0) -> int:
    """How many tokens before `source[start]` equal the last ones of `tokens`, up to MAX_MATCH
    (`matched` of them already known to)."""
    end = len(tokens)
    longest = min(MAX_MATCH, end)
    while matched < longest and start > matched and source[start - matched - 1] == tokens[end - matched - 1]:
        matched += 1
    return matched


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
        return Guess(tokens[start : start + k], matched_before(tokens, start, tokens, self.n))


class AnswerMemory:
    """The answers that finished lately, each with its prompt's last tokens, looked up by their last
    `MEMORY_KEY` tokens: a guess for a sequence that repeats what one of them said."""

    def __init__(self, capacity: int = MEMORY_TOKENS) -> None:
        self.capacity = capacity
        self.tokens: list[int] = []  # answers one after another, each after a -1 so no match spans two
        self._after: dict[int, int] = {}  # hash of a run -> position of the token that followed it last

    def remember(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        if not answer:
            return
        if len(self.tokens) + MAX_MATCH + len(answer) > self.capacity:
            kept = self.tokens[len(self.tokens) // 2 :]
            self.tokens, self._after = [], {}
            self._append(kept)
        self._append([-1, *prompt[-MAX_MATCH:], *answer])

    def _append(self, tokens: Sequence[int]) -> None:
        seen, after, n = self.tokens, self._after, MEMORY_KEY
        for token in tokens:
            seen.append(token)
            end = len(seen) - 1
            if end >= n:
                after[hash(tuple(seen[end - n : end]))] = end

    def guess(self, tokens: Sequence[int], k: int) -> Guess | None:
        """Up to `k` tokens that followed the sequence's last `MEMORY_KEY` tokens in an earlier
        answer, and how many tokens match there (None: no earlier answer went this way)."""
        if k <= 0 or len(tokens) < MEMORY_KEY:
            return None
        start = self._after.get(hash(tuple(tokens[-MEMORY_KEY:])))
        if start is None:
            return None
        matched = matched_before(self.tokens, start, tokens)
        if matched < MEMORY_KEY:  # another run with the same hash
            return None
        guess = self.tokens[start : start + k]
        if -1 in guess:
            guess = guess[: guess.index(-1)]
        return Guess(guess, matched) if guess else None
