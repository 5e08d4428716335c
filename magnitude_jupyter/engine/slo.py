"""Service-level objectives, judged live over a rolling window of finished requests.

Each objective is a 95th percentile held under a limit (TTFT, end to end, a conversation's later
rounds) or a rate held above one (output tokens/s per request, for 95% of requests). Over the window
the server computes the percentile itself (every finished request is kept, so it is exact, not a
histogram's estimate), the compliance ratio (the share of requests within the limit), and the burn
rate: the share outside it against the 5% the objective allows (1: the error budget is spent as
fast as it comes; above 1 the objective breaks if it lasts). Cancelled requests count for TTFT only
(one cancelled before its first token is a miss); requests that ended in an error are misses for
every objective.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np

from ..config import SloSettings
from .metrics import Finished

PERCENTILE = 95.0
ALLOWED_MISSES = 1 - PERCENTILE / 100  # the error budget: 5% of requests may miss
AMBER_BURN = 0.5  # half the window's budget spent: still holding, worth a look


@dataclass(frozen=True)
class Objective:
    name: str  # the setting: ttft_p95_ms, e2e_p95_ms, round_p95_ms, min_tokens_per_s
    what: str
    unit: str
    higher_is_better: bool
    value: Callable[[Finished], float | None]  # a request's figure (ms or tok/s); None: not counted
    counts: Callable[[Finished], bool]  # the requests the objective is judged on


def _ms(seconds: float | None) -> float | None:
    return seconds * 1000 if seconds is not None else None


OBJECTIVES = (
    # Every request: one that never got a first token (cancelled while waiting, failed) is a miss.
    Objective("ttft_p95_ms", "TTFT p95", "ms", False, lambda f: _ms(f.ttft_s), lambda f: True),
    Objective("e2e_p95_ms", "end-to-end p95", "ms", False, lambda f: _ms(f.e2e_s), lambda f: f.outcome != "cancelled"),
    Objective(
        "round_p95_ms",
        "round p95",
        "ms",
        False,
        lambda f: _ms(f.e2e_s),
        lambda f: f.round and f.outcome != "cancelled",
    ),
    Objective(
        "min_tokens_per_s",
        "output tok/s (p5)",
        "tok/s",
        True,
        lambda f: f.decode_tokens_per_s,
        lambda f: f.outcome != "cancelled" and (f.decode_tokens_per_s is not None or f.outcome == "error"),
    ),
)


@dataclass(frozen=True)
class ObjectiveState:
    name: str
    what: str
    unit: str
    objective: float
    requests: int  # judged in the window
    current: float | None  # the window's p95 (p5 for a rate); None with no requests
    compliance: float | None  # share of requests within the objective
    burn_rate: float | None  # misses / allowed misses
    budget_left: float | None  # 1 - burn rate, at least 0: what is left of the window's error budget
    holds: bool | None  # None: no requests in the window yet

    @property
    def color(self) -> str:
        """green: holds with over half its error budget left; amber: holds, but has spent half of it or
        more; red: broken; grey: nothing to judge yet."""
        if self.holds is None:
            return "grey"
        if not self.holds:
            return "red"
        return "green" if (self.burn_rate or 0.0) < AMBER_BURN else "amber"

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "color": self.color}


def judge(objective: Objective, limit: float, finished: Iterable[Finished]) -> ObjectiveState:
    """One objective over the requests given (the window's)."""
    judged = [f for f in finished if objective.counts(f)]
    values = [objective.value(f) for f in judged]
    good = 0
    for item, value in zip(judged, values, strict=True):
        if item.outcome == "error" or value is None:
            continue  # a miss
        if value >= limit if objective.higher_is_better else value <= limit:
            good += 1
    known = [v for v in values if v is not None]
    if not judged:
        return ObjectiveState(objective.name, objective.what, objective.unit, limit, 0, None, None, None, None, None)
    # The rate's objective is on its slow end: the 5th percentile must stay above the minimum.
    q = 100 - PERCENTILE if objective.higher_is_better else PERCENTILE
    current = float(np.percentile(known, q)) if known else None
    compliance = good / len(judged)
    burn = (1 - compliance) / ALLOWED_MISSES
    holds = compliance >= PERCENTILE / 100
    return ObjectiveState(
        objective.name,
        objective.what,
        objective.unit,
        limit,
        len(judged),
        round(current, 2) if current is not None else None,
        round(compliance, 4),
        round(burn, 3),
        round(max(0.0, 1 - burn), 3),
        holds,
    )


def evaluate(
    settings: SloSettings, finished_since: Callable[[float], list[Finished]], now: float | None = None
) -> list[ObjectiveState]:
    """Every objective set, over the last `settings.window` seconds of finished requests."""
    now = time.monotonic() if now is None else now
    if not settings.any:
        return []
    window = finished_since(now - settings.window)
    states = []
    for objective in OBJECTIVES:
        limit = getattr(settings, objective.name)
        if limit is not None:
            states.append(judge(objective, float(limit), window))
    return states


class Shed(Exception):
    """An interactive request that would miss the TTFT objective waiting for a slot: refused now."""

    def __init__(self, wait_s: float, objective_ms: float, model: str = "") -> None:
        self.model = model
        super().__init__(
            f"the server is past its TTFT objective ({objective_ms:,.0f} ms): this request would wait about "
            f"{wait_s:,.1f} s for its first token; retry after that, or send it with priority 'batch' to queue"
        )
        self.retry_after = wait_s


def check_shed(
    settings: SloSettings,
    predict_wait_s: Callable[[], float | None],
    model: str = "",
    release_unread: Callable[[], int] | None = None,
) -> None:
    """Raise Shed when shedding is on and the predicted wait breaks `model`'s TTFT objective; the wait
    is predicted only then (every request passes here). Before shedding a reader, `release_unread`
    stops the answers nobody reads (their clients left) and the wait is predicted again without them:
    an answer nobody reads never holds a slot against one somebody does."""
    if not settings.shed or settings.ttft_p95_ms is None:
        return
    predicted_wait_s = predict_wait_s()
    breaks = predicted_wait_s is not None and predicted_wait_s * 1000 > settings.ttft_p95_ms
    if breaks and release_unread is not None and release_unread():
        predicted_wait_s = predict_wait_s()
    if predicted_wait_s is not None and predicted_wait_s * 1000 > settings.ttft_p95_ms:
        raise Shed(predicted_wait_s, settings.ttft_p95_ms, model)
