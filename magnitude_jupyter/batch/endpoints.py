"""Magnitude-aware orchestration: a batch's partitions spread over OpenAI-compatible servers in
proportion to what each one was measured to sustain.

An endpoint's weight is the peak output tokens/s of the newest calibration profile archived for its
URL (`magnitude calibrate --url URL` measures any OpenAI-compatible server: llama-server, vLLM,
another `magnitude serve`); weights given by hand win; an endpoint nobody calibrated counts as the
mean of those that were (all alike when none was). Partitions are dealt by smooth weighted round
robin, so every endpoint gets its share spread over the whole batch, not one block at the end.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..calibrate.archive import archived


@dataclass(frozen=True)
class Endpoint:
    url: str
    weight: float
    why: str  # where the weight comes from, for a person


def normalize_url(url: str) -> str:
    """The server's base URL as calibration records it: no trailing slash, no `/v1`."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def measured_throughput(folder: Path | None = None) -> dict[str, tuple[float, str]]:
    """{server URL: (peak output tokens/s, profile file)} from the newest sweep profile of each URL."""
    found: dict[str, tuple[float, str]] = {}
    for entry in archived(folder):  # oldest first: a newer profile replaces an older one
        profile = entry.profile
        peak = profile.summary.peak_tokens_per_s
        url = profile.server.get("url")
        if isinstance(url, str) and peak and profile.workflow is None:
            found[normalize_url(url)] = (float(peak), entry.path.name)
    return found


def endpoint_weights(
    urls: Sequence[str], weights: Mapping[str, float] | None = None, folder: Path | None = None
) -> list[Endpoint]:
    if not urls:
        raise ValueError("endpoints: give at least one server URL")
    given = {normalize_url(u): float(w) for u, w in (weights or {}).items()}
    for url, weight in given.items():
        if not weight > 0:
            raise ValueError(f"endpoint {url}: a weight must be > 0, got {weight!r}")
    unknown = set(given) - {normalize_url(u) for u in urls}
    if unknown:
        raise ValueError(f"weights for servers not in endpoints: {', '.join(sorted(unknown))}")
    measured = measured_throughput(folder)
    out: list[Endpoint | None] = []
    for raw in urls:
        url = normalize_url(raw)
        if url in given:
            out.append(Endpoint(url, given[url], "given"))
        elif url in measured:
            peak, file = measured[url]
            out.append(Endpoint(url, peak, f"calibrated: peak {peak:.1f} tok/s ({file})"))
        else:
            out.append(None)
    known = [e.weight for e in out if e is not None]
    default = statistics.mean(known) if known else 1.0
    why = "not calibrated: the mean of the others" if known else "not calibrated: all alike"
    return [e if e is not None else Endpoint(normalize_url(u), default, why) for e, u in zip(out, urls, strict=True)]


def assign_partitions(endpoints: Sequence[Endpoint], n: int) -> list[str]:
    """The endpoint URL of each of `n` partitions, by smooth weighted round robin (nginx's): over
    any stretch of partitions each endpoint's share follows its weight."""
    total = sum(e.weight for e in endpoints)
    current = [0.0] * len(endpoints)
    plan = []
    for _ in range(n):
        for i, e in enumerate(endpoints):
            current[i] += e.weight
        best = max(range(len(endpoints)), key=lambda i: current[i])
        current[best] -= total
        plan.append(endpoints[best].url)
    return plan
