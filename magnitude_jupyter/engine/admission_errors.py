"""What a request is told when the engine cannot take it: it could never fit, or the queue is full."""

from __future__ import annotations


class PromptTooLongError(ValueError):
    """The request could never fit: the message states the numbers."""


class OverloadedError(RuntimeError):
    """The waiting queue is full; try again later."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
