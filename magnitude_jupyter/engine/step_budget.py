"""Work counted in steps, with a deadline behind it: what bounds the work a request or a model file
causes after admission (the check after generation, a chat template's render).

Steps are what stop the work, the same way on any machine, so a test can say exactly where; the
deadline is a backstop for a machine too slow or too busy for the steps to come first. The budget
of the work running on a thread is that thread's (`running`), so code deep inside a library's
callbacks charges it without being handed it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class StepBudget:
    """`limit` steps and `seconds`; `over(message)` makes the error raised past either."""

    __slots__ = ("deadline", "depth", "limit", "over", "seconds", "steps", "what")

    def __init__(self, limit: int, seconds: float, what: str, over: Callable[[str], Exception]) -> None:
        self.limit, self.seconds, self.what, self.over = limit, seconds, what, over
        self.steps = 0
        self.depth = 0  # how deep the counted work is nested, for those who bound that too
        self.deadline = time.monotonic() + seconds

    def charge(self, steps: int = 1) -> None:
        self.steps += steps
        if self.steps > self.limit:
            raise self.over(f"{self.what} took more than {self.limit:,} steps")
        if time.monotonic() > self.deadline:
            raise self.over(f"{self.what} ran for more than {self.seconds:g} s")


_running = threading.local()


def running() -> StepBudget | None:
    """The budget of the work running on this thread, if any."""
    budget: StepBudget | None = getattr(_running, "budget", None)
    return budget


@contextlib.contextmanager
def within(make: Callable[[], StepBudget]) -> Iterator[StepBudget]:
    """Run the block within a budget: the one already running on this thread, else `make()`'s."""
    budget = running()
    if budget is not None:
        yield budget
        return
    budget = _running.budget = make()
    try:
        yield budget
    finally:
        _running.budget = None
