"""Append-only event logs, one per request, that readers can follow from any event id.

The engine thread appends; any number of readers (blocking iterators here, or async hosts woken
by the engine's step listeners) read every event after the last id they saw. A log outlives its
readers: the registry tells the engine which live requests have had no reader for the grace
period (to cancel them), and drops finished logs after the retention period. Reading from
an id that is no longer held raises `StreamGoneError`; there is never a silent gap.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..token_counts import TokenCounts


class UnknownStreamError(LookupError):
    """No stream with that id was ever known here."""


class StreamGoneError(LookupError):
    """The stream, or the events asked for, were dropped: replay is no longer possible."""


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log probability under the model, and the most likely alternatives there."""

    token: bytes  # the token's text, as bytes: a piece may be part of a UTF-8 character
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass(frozen=True)
class StreamEvent:
    id: int
    type: str  # "token" | "done"
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    counts: TokenCounts | None = None  # on the final event
    timings: dict[str, Any] | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # for the tokens of this event, when the request asked
    stopped_by: str | None = None  # the final event of an answer a stop string ended: that string
    reasoning: str = ""  # text of a thinking block (reasoning.py), kept out of `text`

    @property
    def is_final(self) -> bool:
        return self.type == "done"


@dataclass(eq=False)
class TokenStream:
    request_id: str
    max_retained_events: int = 100_000
    _events: list[StreamEvent] = field(default_factory=list)
    _first_retained_id: int = 1
    _next_id: int = 1
    _closed: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _done: threading.Event = field(default_factory=threading.Event)
    readers: int = 0
    detached_since: float | None = field(default_factory=time.monotonic)
    closed_at: float | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def last_id(self) -> int:
        return self._next_id - 1

    def append(self, type: str, **fields: Any) -> StreamEvent:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"stream {self.request_id} is closed")
            event = StreamEvent(id=self._next_id, type=type, **fields)
            self._next_id += 1
            self._events.append(event)
            if len(self._events) > self.max_retained_events:
                dropped = len(self._events) - self.max_retained_events
                del self._events[:dropped]
                self._first_retained_id += dropped
            if event.is_final:
                self._closed = True
                self.closed_at = time.monotonic()
                self._done.set()
            self._cond.notify_all()
        return event

    def events_after(self, after_id: int) -> list[StreamEvent]:
        """Every held event with an id above `after_id`; raises if some of them were dropped."""
        with self._cond:
            return self._events_after_locked(after_id)

    def _events_after_locked(self, after_id: int) -> list[StreamEvent]:
        if after_id < 0 or after_id > self.last_id:
            raise ValueError(f"event id {after_id} out of range for stream {self.request_id} (last id {self.last_id})")
        if after_id + 1 < self._first_retained_id:
            raise StreamGoneError(
                f"stream {self.request_id}: events after {after_id} were dropped "
                f"(the oldest event still held is {self._first_retained_id})"
            )
        return self._events[after_id + 1 - self._first_retained_id :]

    def attach(self) -> None:
        with self._cond:
            self.readers += 1
            self.detached_since = None

    def detach(self) -> None:
        with self._cond:
            self.readers = max(0, self.readers - 1)
            if self.readers == 0:
                self.detached_since = time.monotonic()

    def wait_final(self, timeout: float | None = None) -> StreamEvent:
        """Block until the final event (without waking on every token) and return it; counts as a reader."""
        self.attach()
        try:
            if not self._done.wait(timeout):
                raise TimeoutError(f"stream {self.request_id} did not finish within {timeout} s")
        finally:
            self.detach()
        with self._cond:
            return self._events[-1]

    def read(self, after_id: int = 0, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Every event after `after_id`, then the live rest, until the final event.

        The reader counts as attached while the iterator is open. `timeout` bounds each wait for
        a new event (TimeoutError), not the whole read.
        """
        self.attach()
        try:
            cursor = after_id
            while True:
                with self._cond:
                    batch = self._events_after_locked(cursor)
                    if not batch:
                        if self._closed:
                            return
                        if not self._cond.wait(timeout):
                            raise TimeoutError(f"no event on stream {self.request_id} for {timeout} s")
                        continue
                for event in batch:
                    cursor = event.id
                    yield event
                    if event.is_final:
                        return
        finally:
            self.detach()


class StreamRegistry:
    """All streams by request id, plus a bounded memory of the ones already dropped (for 410s)."""

    def __init__(self, max_retained_events: int = 100_000, remember_gone: int = 10_000) -> None:
        self._streams: dict[str, TokenStream] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._max_retained_events = max_retained_events
        self._remember_gone = remember_gone

    def create(self, request_id: str) -> TokenStream:
        with self._lock:
            if request_id in self._streams or request_id in self._gone:
                raise ValueError(f"stream id {request_id!r} is already used")
            stream = TokenStream(request_id, max_retained_events=self._max_retained_events)
            self._streams[request_id] = stream
            return stream

    def get(self, request_id: str) -> TokenStream:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None:
                return stream
            if request_id in self._gone:
                raise StreamGoneError(f"stream {request_id} has expired: its events are no longer held")
        raise UnknownStreamError(f"no stream with id {request_id!r}")

    def abandoned(self, now: float, grace_seconds: float) -> list[str]:
        """Open streams that nobody has read for the whole grace period."""
        with self._lock:
            streams = list(self._streams.values())
        return [
            s.request_id
            for s in streams
            if not s.closed and s.detached_since is not None and now - s.detached_since >= grace_seconds
        ]

    def drop_expired(self, now: float, retention_seconds: float) -> list[str]:
        """Forget finished streams that nobody reads, once the retention period is over."""
        with self._lock:
            expired = [
                rid
                for rid, s in self._streams.items()
                if s.closed and s.readers == 0 and s.closed_at is not None and now - s.closed_at >= retention_seconds
            ]
            for rid in expired:
                del self._streams[rid]
                self._gone[rid] = None
            while len(self._gone) > self._remember_gone:
                self._gone.popitem(last=False)
        return expired
