"""The arithmetic of a sweep: percentiles, the knee, scaling efficiency, a recommended `parallel`.

Plain functions over plain numbers; the sweep, the widget and the CLI only arrange them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float | None]:
    """p50/p95/p99 (linear interpolation, as numpy), mean and standard deviation; None when empty."""
    keys = [f"p{q:g}" for q in qs] + ["mean", "std"]
    if not values:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}
    out["mean"] = float(arr.mean())
    out["std"] = float(arr.std(ddof=1)) if len(arr) > 1 else 0.0
    return out


def scaling_efficiency(throughput: dict[int, float]) -> dict[int, float | None]:
    """thr(c) / (c · thr(1)): 1.0 is perfect scaling; needs a concurrency-1 level."""
    base = throughput.get(1)
    if not base:
        return dict.fromkeys(throughput)
    return {c: thr / (c * base) for c, thr in throughput.items()}


def knee(points: Sequence[tuple[float, float]], min_gain: float = 0.10) -> float | None:
    """The concurrency past which more concurrency stops paying: the last level whose throughput
    gain over the previous one, per doubling of concurrency, was at least `min_gain` (10%).

    `points` are (concurrency, throughput) pairs. Returns None with fewer than two levels.
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
        if gain_per_doubling >= min_gain:
            best = c1
        else:
            break
    return best


def e2e_p95_ms(level: dict[str, Any]) -> float | None:
    return (level.get("e2e_ms") or {}).get("p95")


def recommend_parallel(
    levels: Sequence[dict[str, Any]],
    target_ms: float,
    latency_ms: Callable[[dict[str, Any]], float | None] = e2e_p95_ms,
) -> int | None:
    """The highest-throughput concurrency whose latency figure (p95 end-to-end by default) stays within the target."""
    ok = [lv for lv in levels if (ms := latency_ms(lv)) is not None and ms <= target_ms]
    if not ok:
        return None
    return int(max(ok, key=lambda lv: (lv["output_tokens_per_s"], -lv["concurrency"]))["concurrency"])


def saturated(levels: Sequence[dict[str, Any]], ttft_p95_limit_ms: float | None) -> str | None:
    """Why to stop the sweep after the last level, or None to go on."""
    if not levels:
        return None
    last = levels[-1]
    if ttft_p95_limit_ms is not None and (last.get("ttft_ms") or {}).get("p95", 0) > ttft_p95_limit_ms:
        return f"p95 TTFT {last['ttft_ms']['p95']:.0f} ms is over the {ttft_p95_limit_ms:.0f} ms limit"
    if len(levels) >= 2:
        prev = levels[-2]
        if last["output_tokens_per_s"] < 0.95 * prev["output_tokens_per_s"] and (last.get("e2e_ms") or {}).get(
            "p50", 0
        ) > (prev.get("e2e_ms") or {}).get("p50", 0):
            return "throughput fell while latency climbed: the service is over-saturated"
    return None
