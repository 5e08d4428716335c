"""Prompt-lookup drafts: guess a greedy answer's next tokens from where its last tokens appeared before.

A conversation resends its history, and small models repeat themselves and their prompt: when the
last `n` tokens of a sequence occurred earlier in it, the tokens that followed them then are a good
guess for what follows now. The guess (the draft) is decoded in the same step as the sequence's
next token, each draft token with its own logits row; the sequence keeps the drafts that its greedy
pick confirms, one by one, plus the pick at the first mismatch, so a step yields 1 to k+1 tokens,
the ones one-token steps pick (bit for bit on one thread; on several, llama.cpp divides a one-token
step's attention between them and rounds differently, as any change of batch does). (Prompt lookup
decoding, as in llama.cpp's `lookup` example and vLLM's n-gram speculation; no draft model.)

A draft token costs a row of compute whether it is kept or not: on the 2-core machine this was
measured on, a one-sequence step of 1 token took 17.6 ms and each draft row about 10 ms more, so
drafts pay only where most of them are kept. Hence a 4-token match (3 finds more guesses, and more
wrong ones), a short draft unless 8 tokens match, and guesses only from the sequence itself. In
steps of many sequences the extra rows go into larger matrix products, which this CPU runs more
efficiently per row; conversations gained there too (8 and 16 sessions: about 1.2x), and
`EngineSettings.draft_max_sequences` bounds it for machines where they do not.
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM = 4  # tokens that must match: fewer find more guesses, and more of them wrong
# A longer match is a better guess: measured on conversations, 4-7 matching tokens kept about half of
# a 6-token draft, 8 or more kept 80-98%. A short match drafts only a little.
LONG_MATCH = 8
SHORT_MATCH_DRAFT = 1


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
        """Up to `k` tokens that followed the last occurrence of the current final run (up to
        `SHORT_MATCH_DRAFT` where fewer than `LONG_MATCH` tokens match there); [] if none."""
        tokens = self.tokens
        if k <= 0 or len(tokens) < self.n:
            return []
        start = self._after.get(tuple(tokens[-self.n :]))
        if start is None:
            return []
        matched, end = self.n, len(tokens)
        while matched < LONG_MATCH and start > matched and tokens[start - matched - 1] == tokens[end - matched - 1]:
            matched += 1
        if matched < LONG_MATCH:
            k = min(k, SHORT_MATCH_DRAFT)
        return tokens[start : start + k]


def accepted(draft: Sequence[int], picks: Sequence[int]) -> int:
    """How many draft tokens the picks confirm: `picks[i]` is the token chosen after draft[:i]."""
    n = 0
    while n < len(draft) and n < len(picks) and picks[n] == draft[n]:
        n += 1
    return n
