"""The token budget the scheduler admits against (the arithmetic is in `kvmath.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVBudget:
    """Cells of the one unified KV cache, reserved per request for its whole lifetime.

    A request reserves ``prompt_tokens + max_tokens`` cells on admission, so a running request
    can never run out of cache mid-generation; the reservation is given back when it ends.
    """

    total: int
    reserved: dict[str, int] = field(default_factory=dict)

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

    def release(self, request_id: str) -> int:
        return self.reserved.pop(request_id, 0)
