"""Following a TokenStream from the tornado loop: woken by the engine thread, never polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from tornado.iostream import StreamClosedError
from tornado.web import RequestHandler

from ..engine.streams import StreamEvent, TokenStream

Render = Callable[[StreamEvent], list[dict[str, Any]]]


class _Wakeup:
    """An asyncio.Event the engine thread can set safely, even after the loop has gone away."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def __call__(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self.loop.call_soon_threadsafe(self.event.set)


async def wait_final(stream: TokenStream) -> StreamEvent:
    """The final event of a stream, awaited without a thread; the waiter counts as a reader."""
    wake = _Wakeup()
    stream.add_listener(wake)
    stream.attach()
    try:
        while not stream.closed:
            wake.event.clear()
            if stream.closed:
                break
            await wake.event.wait()
        return stream.events_after(stream.last_id - 1)[-1]
    finally:
        stream.remove_listener(wake)
        stream.detach()


async def send_sse(handler: RequestHandler, stream: TokenStream, after: int, render: Render) -> None:
    """Write every event after `after` as SSE (`id: N`), then the live rest, then `data: [DONE]`.

    A client that goes away only ends this reader: the generation runs on for the grace period,
    and a new request with `Last-Event-ID` picks it up where the client stopped reading.
    """
    handler.set_header("Content-Type", "text/event-stream; charset=utf-8")
    handler.set_header("Cache-Control", "no-cache")
    handler.set_header("X-Accel-Buffering", "no")
    wake = _Wakeup()
    stream.add_listener(wake)
    stream.attach()
    try:
        # Headers go out at once: a queued request is accepted even before its first token.
        await handler.flush()
        cursor = after
        while True:
            wake.event.clear()
            events = stream.events_after(cursor)
            for event in events:
                for payload in render(event):
                    handler.write(f"id: {event.id}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n")
                cursor = event.id
            done = (events and events[-1].is_final) or (not events and stream.closed)
            if done:
                handler.write("data: [DONE]\n\n")
            if events or done:
                await handler.flush()
            if done:
                return
            await wake.event.wait()
    except StreamClosedError:
        return
    finally:
        stream.remove_listener(wake)
        stream.detach()
