"""How many guessed tokens a step decodes: only those whose chance of being kept pays for their row.

A step of N tokens takes T(N) seconds and yields Y tokens (one per sequence it samples, plus the
drafts kept). Draft tokens kept with probabilities q1, q2, ... make it N + k tokens yielding
Y + q1 + ... + qk; the policy decodes the k that gives the step the most tokens per second (the
goodput rule SmartSpec, Liu et al. 2024, proposes for vLLM).

Every decision is a function of counts and of figures fixed when the model loads, never of a clock
read while serving: a draft step computes its rows in one batch, whose sums llama.cpp orders unlike
a one-row step's, so a near tie between two tokens can go either way, and a policy that followed
measured step times would make the same greedy request answer differently on an idle server
(docs/decisions.md, "Drafts decided from counts").

- `StepCost`: T(N), measured once at load (`measure_step_costs`: decode steps of 1, 2, 4, ... rows
  of a scratch sequence, the fastest of a few each), straight lines between the sizes. Where a few
  more rows are nearly free drafts run long; where a row costs a good part of a one-token step (a
  small model on a 2-core CPU) only a near-certain guess pays, and less so the more sequences share
  the step, since each extra row then slows all of them.
- `AcceptanceModel`: the chance that draft token j is kept when the ones before it were, from the
  length of the match the guess came from (4 matching tokens guess worse than 12: fixed figures
  from conversation data), and per sequence, how its own guesses fared against that (a conversation
  that resends its history keeps most, an answer that echoes a phrase once few). What every draft
  kept is counted too, for /status, without moving the decisions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

from .speculate import Guess, NgramIndex

STEP_EWMA = 0.1  # weight of a new step time in its band's average: the machine's load drifts
# Match lengths (tokens) from which a guess counts in the next class up, and what each class is
# expected to keep per draft token before anything is counted (from conversation data: docs/decisions.md).
MATCH_CLASSES = (4, 6, 8, 12, 16)
PRIOR_KEPT = (0.55, 0.65, 0.8, 0.88, 0.92)
PRIOR_WEIGHT = 4.0  # the prior counts as this many drafts: the first counted ones soon outweigh it
MAX_COUNT = 2000.0  # counts are halved past this, so the model follows a workload that changes
SEQUENCE_WEIGHT = 4.0  # how many expected tokens a sequence's own record needs to move its chances
MAX_CHANCE = 0.99
# How much more tokens per second drafts must promise than the step without them: a step time is an
# average over a drifting machine, and a draft also costs what the step time does not show (a row
# of logits to read, refused cells to drop), so a promise within the noise is not taken.
MIN_GAIN = 1.1
SHOWN_STEP_SIZES = (1, 2, 4, 8, 16, 32)
MEASURED_REPEATS = 3  # each step size is decoded this often at load; the fastest counts


class StepCost:
    """Seconds per decode step as a function of its tokens, from the steps timed at load."""

    def __init__(self) -> None:
        self._bands: dict[int, list[float]] = {}  # N -> [N, mean seconds, steps]

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        band = self._bands.get(tokens)
        if band is None:
            self._bands[tokens] = [float(tokens), seconds, 1.0]
        else:
            band[0] += STEP_EWMA * (tokens - band[0])
            band[1] += STEP_EWMA * (seconds - band[1])
            band[2] += 1

    def points(self) -> list[tuple[float, float]]:
        """(tokens, mean seconds) per step size measured, smallest first (safe from another thread)."""
        return sorted((n, t) for n, t, _ in list(self._bands.values()))

    def seconds(self, tokens: int) -> float:
        """T(N) at N = `tokens`: straight lines between the bands' averages, the end ones extended.
        Before two sizes of step have been seen, a row is taken to cost as much as the rest of a
        one-token step (a CPU's case; a GPU's steps soon show otherwise)."""
        points = self.points()
        if len(points) < 2:
            per_token = points[0][1] / (points[0][0] + 1) if points else 1.0
            return per_token * (tokens + 1)
        i = 1
        while i < len(points) - 1 and points[i][0] < tokens:
            i += 1
        (n0, t0), (n1, t1) = points[i - 1], points[i]
        slope = max(0.0, (t1 - t0) / (n1 - n0))
        return max(t0 + slope * (tokens - n0), 1e-9)


class AcceptanceModel:
    """The chance a draft token is kept given the ones before it were, per match class and position."""

    def __init__(self, positions: int) -> None:
        self.tried = [[PRIOR_WEIGHT] * positions for _ in MATCH_CLASSES]
        self.kept = [[PRIOR_WEIGHT * p] * positions for p in PRIOR_KEPT]
        self.drafts = [0] * len(MATCH_CLASSES)  # drafts recorded per class (never halved: for /status)

    @staticmethod
    def labels() -> list[str]:
        return [*(f"{low}-{high - 1}" for low, high in pairwise(MATCH_CLASSES)), f"{MATCH_CLASSES[-1]}+"]

    @staticmethod
    def match_class(matched: int) -> int:
        return max(i for i, low in enumerate(MATCH_CLASSES) if matched >= low or i == 0)

    def chance(self, match_class: int, position: int) -> float:
        """What the drafts counted so far kept at this position (for /status)."""
        return self.kept[match_class][position] / self.tried[match_class][position]

    @staticmethod
    def prior(match_class: int) -> float:
        """What the policy expects a draft token of this match class to keep: a fixed figure."""
        return PRIOR_KEPT[match_class]

    def record(self, matched: int, drafted: int, kept: int, index: NgramIndex) -> None:
        """Count a draft of `drafted` tokens of which the first `kept` were confirmed: position j was
        put to the test only if every draft token before it was kept."""
        c = self.match_class(matched)
        self.drafts[c] += 1
        tried, kept_at = self.tried[c], self.kept[c]
        for j in range(min(kept + 1, drafted)):
            index.expected += self.prior(c)
            index.kept += j < kept
            tried[j] += 1
            kept_at[j] += j < kept
            if tried[j] > MAX_COUNT:
                tried[j] /= 2
                kept_at[j] /= 2

    def chances(self, guess: Guess, index: NgramIndex) -> list[float]:
        """For each token of the guess, the chance that it and every one before it are kept."""
        c = self.match_class(guess.matched)
        # The sequence's own record against the class's: a repetitive answer keeps more, a fresh one less.
        own = (index.kept + SEQUENCE_WEIGHT) / (index.expected + SEQUENCE_WEIGHT)
        chances, q = [], 1.0
        for _ in range(min(len(guess.tokens), len(self.tried[c]))):
            q *= min(MAX_CHANCE, self.prior(c) * own)
            chances.append(q)
        return chances


class DraftPolicy:
    """Decides, each step, how many tokens of each sequence's guess to decode (see the module doc)."""

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft
        self.cost = StepCost()  # until measure_step_costs: a row priced as a whole one-token step
        self.acceptance = AcceptanceModel(max_draft)

    def plan(
        self, guesses: Sequence[tuple[Guess, NgramIndex]], step_tokens: int, yielded: int, budget: int
    ) -> list[int]:
        """How many tokens of each guess to decode, in a step of `step_tokens` tokens so far that
        samples `yielded` sequences, with room for `budget` more tokens."""
        candidates: list[tuple[float, int, int]] = []  # (-chance, position, guess)
        for i, (guess, index) in enumerate(guesses):
            candidates += [(-q, j, i) for j, q in enumerate(self.acceptance.chances(guess, index))]
        # Best first across sequences: a guess's chances fall with each position, so whatever the
        # number of rows, the likeliest ones are prefixes of the guesses. The number of rows is the
        # one that gives the step the most tokens per second: costs need not be convex (on a CPU a
        # second row can cost nearly a whole step, and the next few little), so every count is tried.
        candidates.sort()
        best_rows = self._best_rows(candidates[:budget], step_tokens, yielded)
        lengths = [0] * len(guesses)
        for _, _, i in candidates[:best_rows]:
            lengths[i] += 1
        return lengths

    def _best_rows(self, candidates: list[tuple[float, int, int]], step_tokens: int, yielded: int) -> int:
        """The number of the likeliest rows that gives the step the most tokens per second."""
        plain_rate = yielded / self.cost.seconds(step_tokens)
        best_rows, best_rate, gain = 0, plain_rate * MIN_GAIN, 0.0
        for rows, (neg_q, _, _) in enumerate(candidates, start=1):
            gain -= neg_q
            rate = (yielded + gain) / self.cost.seconds(step_tokens + rows)
            if rate > best_rate:
                best_rows, best_rate = rows, rate
        return best_rows

    def snapshot(self) -> dict[str, Any]:
        """What the policy has measured, for /status: a step's milliseconds by its tokens (as timed
        at load), and per match length the chance of keeping each draft position the drafts counted
        so far showed, with their number."""
        measured = len(self.cost.points()) >= 2
        model, labels = self.acceptance, self.acceptance.labels()
        return {
            "step_ms": {str(n): round(self.cost.seconds(n) * 1000, 2) for n in SHOWN_STEP_SIZES} if measured else {},
            "kept_chance": {
                label: [round(model.chance(c, j), 3) for j in range(self.max_draft)] for c, label in enumerate(labels)
            },
            "drafts_counted": dict(zip(labels, model.drafts, strict=True)),
        }


def measure_step_costs(decode_rows: Callable[[int], None], max_rows: int) -> StepCost:
    """T(N) at N = 1, 2, 4, ... up to `max_rows`, each the fastest of MEASURED_REPEATS steps, the
    sizes taken in turn: `decode_rows(n)` decodes one step of n rows (at load, before any request)."""
    sizes, n = [], 1
    while n < max_rows:
        sizes.append(n)
        n *= 2
    sizes.append(max_rows)
    best = dict.fromkeys(sizes, float("inf"))
    for _ in range(MEASURED_REPEATS):
        for size in sizes:
            started = time.perf_counter()
            decode_rows(size)
            best[size] = min(best[size], time.perf_counter() - started)
    cost = StepCost()
    for size, seconds in best.items():
        cost.observe(size, seconds)
    return cost
