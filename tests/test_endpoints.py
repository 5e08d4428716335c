"""Magnitude-aware orchestration: weights from calibration profiles, partitions dealt by weight."""

from __future__ import annotations

from collections import Counter

import pytest

from magnitude_jupyter.batch.endpoints import Endpoint, assign_partitions, endpoint_weights, normalize_url
from magnitude_jupyter.calibrate.archive import archive
from magnitude_jupyter.calibrate.profile import Profile
from magnitude_jupyter.calibrate.records import Summary


def profile_of(url: str, peak: float) -> Profile:
    return Profile(
        machine={},
        server={"url": url, "engine": "openai-compatible"},
        model={"id": "m", "sha256": "ab" * 32},
        engine={},
        config={},
        levels=[],
        summary=Summary(peak_tokens_per_s=peak),
    )


def test_weights_come_from_the_newest_profile_of_each_server(profile_archive):
    archive(profile_of("http://a:8000", 10.0))
    archive(profile_of("http://a:8000/v1/", 30.0))  # newer, same server: it counts
    archive(profile_of("http://b:8000", 10.0))
    spread = endpoint_weights(["http://a:8000", "http://b:8000/v1", "http://c:8000"])
    assert [e.url for e in spread] == ["http://a:8000", "http://b:8000", "http://c:8000"]
    assert [e.weight for e in spread] == [30.0, 10.0, 20.0]
    assert "calibrated: peak 30.0 tok/s" in spread[0].why and "mean of the others" in spread[2].why
    given = endpoint_weights(["http://a:8000", "http://c:8000"], weights={"http://c:8000/": 90})
    assert [e.weight for e in given] == [30.0, 90.0] and given[1].why == "given"


def test_without_profiles_every_server_counts_alike():
    assert {e.weight for e in endpoint_weights(["http://x:1", "http://y:2"])} == {1.0}
    with pytest.raises(ValueError, match="at least one"):
        endpoint_weights([])
    with pytest.raises(ValueError, match="must be > 0"):
        endpoint_weights(["http://x:1"], weights={"http://x:1": 0})


def test_partitions_follow_the_weights_and_interleave():
    plan = assign_partitions([Endpoint("a", 3.0, ""), Endpoint("b", 1.0, "")], 8)
    assert Counter(plan) == {"a": 6, "b": 2}
    assert plan.index("b") < 4, "b's share is spread over the batch, not left to its end"
    assert Counter(assign_partitions([Endpoint("a", 104.6, ""), Endpoint("b", 52.3, "")], 30)) == {"a": 20, "b": 10}
    assert normalize_url(" http://h:1/v1/ ") == "http://h:1"
