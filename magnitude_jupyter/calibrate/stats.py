"""The arithmetic of a sweep: percentiles, the knee, scaling efficiency, a recommended `parallel`.

Plain functions over plain numbers; the sweep, the widget and the CLI only arrange them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from .records import Level, Percentiles


def percentiles(values: Sequence[float]) -> Percentiles:
    """p50/p95/p99 (linear interpolation, as numpy), mean and standard deviation; None when empty."""
    if not values:
        return Percentiles()
    arr = np.asarray(values, dtype=float)
    p50, p95, p99 = (float(np.percentile(arr, q)) for q in (50, 95, 99))
    std = float(arr.std(ddof=1)) if len(arr) > 1 else 0.0
    return Percentiles(p50=p50, p95=p95, p99=p99, mean=float(arr.mean()), std=std)


def scaling_efficiency(throughput: dict[int, float]) -> dict[int, float | None]:
    """thr(c) / (c · thr(1)): 1.0 is perfect scaling; needs a concurrency-1 level."""
    base = throughput.get(1)
    if not base:
        return dict.fromkeys(throughput)
    return {c: thr / (c * base) for c, thr in throughput.items()}


def knee(points: Sequence[tuple[float, float]], min_gain: float = 0.10) -> float | None:
    """The concurrency past which more concurrency stops paying: the last level whose throughput
    gain over the previous one, per doubling of concurrency, was at least `min_gain` (10%), when a
    later level gained less.

    `points` are (concurrency, throughput) pairs. None with fewer than two levels, and None when
    every step still gained `min_gain`: the knee lies beyond the largest level tested (see
    `knee_not_reached`), and calling the last level the knee would say capacity ends where the
    sweep did.
    """
    pts = sorted(points)
    if len(pts) < 2:
        return None
    best = pts[0][0]
    for (c0, t0), (c1, t1) in itertools.pairwise(pts):
        if t0 <= 0 or c1 <= c0:
            continue
        doublings = math.log2(c1 / c0)
        gain_per_doubling = (t1 / t0) ** (1 / doublings) - 1 if doublings > 0 else 0.0
        if gain_per_doubling < min_gain:
            return best
        best = c1
    return None


def knee_not_reached(points: Sequence[tuple[float, float]], min_gain: float = 0.10) -> bool:
    """Throughput was still rising at the largest level tested: try higher concurrency."""
    return len(points) >= 2 and knee(points, min_gain) is None


def e2e_p95_ms(level: Level) -> float | None:
    return level.e2e_ms.p95


def recommend_parallel(
    levels: Sequence[Level],
    target_ms: float,
    latency_ms: Callable[[Level], float | None] = e2e_p95_ms,
) -> int | None:
    """The highest-throughput concurrency whose latency figure (p95 end-to-end by default) stays within the target."""
    ok = [lv for lv in levels if lv.concurrency and (ms := latency_ms(lv)) is not None and ms <= target_ms]
    if not ok:
        return None
    return max(ok, key=lambda lv: (lv.output_tokens_per_s, -(lv.concurrency or 0))).concurrency


def saturated(levels: Sequence[Level], ttft_p95_limit_ms: float | None) -> str | None:
    """Why to stop the sweep after the last level, or None to go on."""
    if not levels:
        return None
    last = levels[-1]
    ttft_p95 = last.ttft_ms.p95 or 0.0
    if ttft_p95_limit_ms is not None and ttft_p95 > ttft_p95_limit_ms:
        return f"p95 TTFT {ttft_p95:.0f} ms is over the {ttft_p95_limit_ms:.0f} ms limit"
    if len(levels) >= 2:
        prev = levels[-2]
        slower = (last.e2e_ms.p50 or 0.0) > (prev.e2e_ms.p50 or 0.0)
        if last.output_tokens_per_s < 0.95 * prev.output_tokens_per_s and slower:
            return "throughput fell while latency climbed: the service is over-saturated"
    return None
