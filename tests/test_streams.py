from __future__ import annotations

import threading
import time

import pytest

from magnitude_jupyter.engine.streams import StreamGoneError, StreamRegistry, TokenStream, UnknownStreamError


def fill(stream: TokenStream, n: int) -> None:
    for i in range(n):
        stream.append("token", text=f"t{i} ")
    stream.append("done", finish_reason="stop")


def test_replay_from_any_id_equals_the_suffix():
    stream = TokenStream("s")
    fill(stream, 5)
    full = list(stream.read(0))
    assert [e.id for e in full] == [1, 2, 3, 4, 5, 6]
    for k in range(6):
        assert list(stream.read(k)) == full[k:]


def test_reader_follows_live_events():
    stream = TokenStream("s")
    got: list[str] = []

    def reader():
        got.extend(e.text for e in stream.read(0, timeout=5))

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.05)
    fill(stream, 3)
    thread.join(5)
    assert "".join(got) == "t0 t1 t2 "


def test_dropped_events_raise_gone_never_a_gap():
    stream = TokenStream("s", max_retained_events=3)
    fill(stream, 5)  # ids 1..6, only 4..6 held
    assert [e.id for e in stream.read(3)] == [4, 5, 6]
    with pytest.raises(StreamGoneError, match="oldest event still held is 4"):
        list(stream.read(1))


def test_registry_abandonment_and_expiry():
    registry = StreamRegistry()
    live = registry.create("live")
    done = registry.create("done")
    fill(done, 1)
    now = time.monotonic()
    assert registry.abandoned(now + 10, grace_seconds=5) == ["live"]
    live.attach()
    assert registry.abandoned(now + 10, grace_seconds=5) == []
    assert registry.drop_expired(now + 100, retention_seconds=50) == ["done"]
    with pytest.raises(StreamGoneError):
        registry.get("done")
    with pytest.raises(UnknownStreamError):
        registry.get("never")
