"""Prompt-lookup drafts: guess a greedy answer's next tokens from where its last tokens appeared before.

A conversation resends its history, and small models repeat themselves and their prompt: when the
last `n` tokens of a sequence occurred earlier in it, the tokens that followed them then are a good
guess for what follows now. The guess (the draft) is decoded in the same step as the sequence's
next token, each draft token with its own logits row; the sequence keeps the drafts that its greedy
pick confirms, one by one, plus the pick at the first mismatch, so a step yields 1 to k+1 tokens,
the ones one-token steps pick (bit for bit on one thread; on several, llama.cpp divides a one-token
step's attention between them and rounds differently, as any change of batch does). (Prompt lookup
decoding, as in llama.cpp's `lookup` example and vLLM's n-gram speculation; no draft model.)

A draft token costs a row of compute whether it is kept or not, and on a 2-core CPU a row costs a
good part of a one-token step, so drafts pay only where most of them are kept. Hence a 4-token
match, a short draft unless 8 tokens match, and guesses only from the sequence itself.
`benchmarks/conversations.py` and `benchmarks/server_throughput.py` run the server with and without
drafts in one run: conversations gain, short single prompts come out about even.
`EngineSettings.draft_max_sequences` bounds drafting for machines where rows in large steps cost
as much as they save.
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM = 4  # tokens that must match: fewer find more guesses, and more of them wrong
# A longer match is a better guess, so a short match drafts only a little.
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
