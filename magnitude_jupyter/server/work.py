"""Where a request's own work runs, off the event loop: parsing a body, rendering a chat template,
tokenizing, turning a schema into a grammar.

Small bodies, what nearly every client sends, run at once: parsing on the shared pool, and what a
model's own files decide (its chat template, its tokenizer) on that model's lane, `MODEL_LANE_THREADS`
threads of its own, so that a model file whose template works to its budget (engine/template_budget.py)
holds up no other model's requests. Bodies over `HEAVY_BODY_BYTES` queue for one thread of their own:
a burst of megabyte prompts or grammars then takes one core from the engine at most, never every
core, and never holds up the small requests of other clients, whose work does not wait behind them.
A heavy request whose client has gone before its turn comes is dropped without being worked on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .handlers import ApiMixin

HEAVY_BODY_BYTES = 64 << 10
HEAVY_KEY = "magnitude_heavy_lane"
MODEL_LANES_KEY = "magnitude_model_lanes"
MODEL_LANE_THREADS = 4
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection while its work waited its turn."""


def heavy_lane(handler: ApiMixin) -> ThreadPoolExecutor:
    lane: ThreadPoolExecutor | None = handler.settings.get(HEAVY_KEY)
    if lane is None:
        lane = handler.settings[HEAVY_KEY] = ThreadPoolExecutor(1, thread_name_prefix="magnitude-heavy")
    return lane


def model_lane(handler: ApiMixin, model: str) -> ThreadPoolExecutor:
    lanes: dict[str, ThreadPoolExecutor] = handler.settings.setdefault(MODEL_LANES_KEY, {})
    lane = lanes.get(model)
    if lane is None:
        lane = lanes[model] = ThreadPoolExecutor(MODEL_LANE_THREADS, thread_name_prefix=f"magnitude-{model[:24]}")
    return lane


async def off_loop(handler: ApiMixin, body_bytes: int, work: Callable[[], T], model: str | None = None) -> T:
    """Run `work` for a request of `body_bytes` on its lane and wait for it: `model`'s lane for work
    that runs that model's template or tokenizer."""
    loop = asyncio.get_running_loop()
    if body_bytes <= HEAVY_BODY_BYTES:
        return await loop.run_in_executor(model_lane(handler, model) if model is not None else None, work)

    def when_its_turn_comes() -> T:
        if handler.connection_gone:
            raise ClientGone("the client closed its connection before its request was read")
        return work()

    return await loop.run_in_executor(heavy_lane(handler), when_its_turn_comes)
