"""How many threads llama.cpp may use, given what the rest of the machine is doing.

llama.cpp splits each decode across its threads and makes them meet at a barrier after every
operation. When another process keeps a core busy (a notebook kernel crunching pandas), one of
those threads is off the CPU for a whole scheduler time slice while the others wait for it, many
times per token: throughput collapses to a few tokens/s. Fewer threads than cores then decode far
faster than all of them. `ThreadGovernor` watches the CPU time other processes take and gives
llama.cpp the cores they leave free (never fewer than one), and all of them again once they go.
"""

from __future__ import annotations

import psutil


def _busy_seconds() -> float:
    """CPU seconds spent on any work, by any process, since boot (all cores together)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


class ThreadGovernor:
    """Reads the machine's CPU use now and then; `update()` says when the thread count should change."""

    def __init__(self, max_threads: int, interval_s: float = 1.0, cores: int | None = None) -> None:
        self.max_threads = max_threads
        self.interval_s = interval_s
        self.cores = cores or psutil.cpu_count() or 1
        self.threads = max_threads
        self.others_cores = 0.0  # CPU time other processes took over the last interval, in cores
        self._process = psutil.Process()
        self._last: tuple[float, float, float] | None = None  # (when, busy seconds, own seconds)
        self._next = 0.0

    def _own_seconds(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system

    def update(self, now: float) -> int | None:
        """The new thread count if it should change now, else None."""
        if now < self._next:
            return None
        self._next = now + self.interval_s
        reading = (now, _busy_seconds(), self._own_seconds())
        last, self._last = self._last, reading
        if last is None or reading[0] <= last[0]:
            return None
        elapsed = reading[0] - last[0]
        self.others_cores = max(0.0, ((reading[1] - last[1]) - (reading[2] - last[2])) / elapsed)
        wanted = self.threads_for(self.others_cores)
        if wanted == self.threads:
            return None
        self.threads = wanted
        return wanted

    def threads_for(self, others_cores: float) -> int:
        """Every free core; a core counts as taken once other processes use more than 40% of one."""
        free = self.cores - others_cores
        return max(1, min(self.max_threads, int(free + 0.4)))


def busy_and_own_seconds() -> tuple[float, float]:
    """(CPU seconds any process spent working since boot, CPU seconds this process spent)."""
    own = psutil.Process().cpu_times()
    return _busy_seconds(), own.user + own.system


def others_cores_now(sample_s: float = 0.3) -> float:
    """How many cores other processes keep busy now, read over `sample_s`."""
    import time

    busy_before, own_before = busy_and_own_seconds()
    started = time.perf_counter()
    time.sleep(sample_s)
    busy_after, own_after = busy_and_own_seconds()
    elapsed = max(1e-6, time.perf_counter() - started)
    return max(0.0, ((busy_after - busy_before) - (own_after - own_before)) / elapsed)


def threads_free_now(max_threads: int | None = None, sample_s: float = 0.3) -> int:
    """The threads a llama.cpp context made now should use: the cores other processes leave free over
    `sample_s` (as the governor counts them), at most `max_threads` (default: every core). For
    short-lived contexts (measurements, probes) that no governor watches."""
    cores = psutil.cpu_count() or 1
    return ThreadGovernor(max_threads or cores, cores=cores).threads_for(others_cores_now(sample_s))
