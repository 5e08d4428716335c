"""The token budget the scheduler admits against (the arithmetic is in `kvmath.py`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class KVBudget:
    """Cells of the one unified KV cache, reserved per request for its whole lifetime.

    A request reserves ``prompt_tokens + max_tokens`` cells on admission, so a running request
    can never run out of cache mid-generation; the reservation is given back when it ends.
    """

    total: int
    reserved: dict[str, int] = field(default_factory=dict)
    # A hold's key: the requests whose sequences still hold its cells (`hold`).
    holders: dict[str, set[str]] = field(default_factory=dict)
    _holds: itertools.count = field(default_factory=itertools.count)

    @property
    def used(self) -> int:
        return sum(self.reserved.values())

    @property
    def free(self) -> int:
        return self.total - self.used

    def fits(self, cells: int) -> bool:
        return cells <= self.free

    def reserve(self, request_id: str, cells: int) -> None:
        if request_id in self.reserved:
            raise ValueError(f"request {request_id} already holds KV cells")
        if not self.fits(cells):
            raise ValueError(f"{cells} KV cells requested, {self.free} free")
        self.reserved[request_id] = cells

    @property
    def held(self) -> int:
        """Cells kept counted for the requests that hold them (`hold`)."""
        return sum(self.reserved[key] for key in self.holders)

    def hold(self, cells: int, holders: list[str]) -> None:
        """Keep `cells` counted while any of the requests `holders` runs: cells of a cache entry that
        left the prefix cache while they still share them (llama.cpp frees a cell when no sequence
        holds it). They were counted already, as the cache's: no room is asked for."""
        key = f"held-{next(self._holds)}"
        self.reserved[key] = cells
        self.holders[key] = set(holders)

    def release(self, request_id: str) -> int:
        """Give back a request's cells, and every hold it was the last holder of."""
        for key, holders in list(self.holders.items()):
            holders.discard(request_id)
            if not holders:
                del self.holders[key]
                self.reserved.pop(key, None)
        return self.reserved.pop(request_id, 0)
