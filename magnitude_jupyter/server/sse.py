"""Following a TokenStream from the tornado loop: woken by the engine thread, never polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from tornado.iostream import StreamClosedError
from tornado.web import RequestHandler

from ..engine import Engine
from ..engine.streams import StreamEvent, TokenStream

POOL_KEY = "magnitude_pool"
HUB_KEY = "magnitude_step_hubs"

Render = Callable[[StreamEvent], list[dict[str, Any]]]


class StepHub:
    """Wakes every reader on one event loop once per engine step (one cross-thread call per step)."""

    def __init__(self, engine: Engine) -> None:
        self.loop = asyncio.get_running_loop()
        self.readers: set[asyncio.Event] = set()
        self._pending = False
        engine.add_step_listener(self._on_step)

    def _on_step(self) -> None:  # engine thread
        if self._pending or not self.readers:
            return
        self._pending = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self.loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        self._pending = False
        for event in self.readers:
            event.set()

    @contextlib.contextmanager
    def reader(self, stream: TokenStream, attach: bool = True) -> Iterator[asyncio.Event]:
        """An Event set after every engine step while the block runs; with `attach`, the block
        counts as a stream reader (a stream nobody reads is cancelled after the grace period)."""
        event = asyncio.Event()
        self.readers.add(event)
        if attach:
            stream.attach()
        try:
            yield event
        finally:
            self.readers.discard(event)
            if attach:
                stream.detach()


def step_hub(handler: RequestHandler, engine: Engine) -> StepHub:
    """The hub of one engine on this loop (one per resident model; forgotten with the engine)."""
    hubs: weakref.WeakKeyDictionary[Engine, StepHub] = handler.settings.setdefault(HUB_KEY, weakref.WeakKeyDictionary())
    hub = hubs.get(engine)
    if hub is None:
        hub = hubs[engine] = StepHub(engine)
    return hub


class Reader(Protocol):
    """The handler side of a reader: it can say that its client went away."""

    connection_gone: bool

    def wake_on_close(self, wake: asyncio.Event | None) -> None: ...


async def wait_final(handler: Reader, hub: StepHub, stream: TokenStream) -> StreamEvent | None:
    """The final event of a stream, awaited on the loop (counting as a reader), or None as soon as
    the client goes away."""
    with hub.reader(stream) as wake:
        handler.wake_on_close(wake)
        while not stream.closed:
            wake.clear()
            if stream.closed or handler.connection_gone:
                break
            await wake.wait()
        handler.wake_on_close(None)
    if not stream.closed:
        return None
    return stream.events_after(stream.last_id - 1)[-1]


async def wait_closed(hub: StepHub, stream: TokenStream) -> StreamEvent:
    """The final event of a stream, awaited without counting as its reader: an abandoned
    generation is still cancelled after the grace period, and this then returns its final event."""
    with hub.reader(stream, attach=False) as wake:
        while not stream.closed:
            wake.clear()
            if stream.closed:
                break
            await wake.wait()
    return stream.events_after(stream.last_id - 1)[-1]


async def send_sse(
    handler: RequestHandler,
    hub: StepHub,
    stream: TokenStream,
    after: int,
    render: Render,
    named: bool = False,
) -> None:
    """Write every event after `after` as SSE (`id: N`), then the live rest, then `data: [DONE]`;
    `named`: each payload's `type` as the SSE event name and no `[DONE]` (Anthropic's streams).

    A client that goes away only ends this reader: the generation runs on for the grace period,
    and a new request with `Last-Event-ID` picks it up where the client stopped reading.
    """
    reader: Reader = handler  # type: ignore[assignment]
    handler.set_header("Content-Type", "text/event-stream; charset=utf-8")
    handler.set_header("Cache-Control", "no-cache")
    handler.set_header("X-Accel-Buffering", "no")
    with hub.reader(stream) as wake:
        reader.wake_on_close(wake)
        try:
            # Headers go out at once: a queued request is accepted even before its first token.
            await handler.flush()
            cursor = after
            while not reader.connection_gone:
                wake.clear()
                events = stream.events_after(cursor)
                for event in events:
                    for payload in render(event):
                        name = f"event: {payload['type']}\n" if named else ""
                        handler.write(f"id: {event.id}\n{name}data: {json.dumps(payload, separators=(',', ':'))}\n\n")
                    cursor = event.id
                done = (events and events[-1].is_final) or (not events and stream.closed)
                if done and not named:
                    handler.write("data: [DONE]\n\n")
                if events or done:
                    await handler.flush()
                if done:
                    return
                await wake.wait()
        except StreamClosedError:
            return
        finally:
            reader.wake_on_close(None)
