"""The inference engine: continuous batching on llama.cpp with a KV-budget scheduler.

Nothing in this package imports web or notebook code; `runner.py` is the only module that
imports `llama_cpp`.
"""

from __future__ import annotations

from .core import Engine, EngineError
from .request import (
    FinishReason,
    Priority,
    Request,
    RequestStatus,
    SamplingParams,
)
from .scheduler import OverloadedError, PromptTooLongError
from .streams import StreamEvent, StreamGoneError, UnknownStreamError

__all__ = [
    "Engine",
    "EngineError",
    "FinishReason",
    "OverloadedError",
    "Priority",
    "PromptTooLongError",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "StreamEvent",
    "StreamGoneError",
    "UnknownStreamError",
]
