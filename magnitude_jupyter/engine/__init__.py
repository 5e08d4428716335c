"""The inference engine: continuous batching on llama.cpp with a KV-budget scheduler.

Nothing in this package imports web or notebook code; `runner.py` is the only module that calls
into llama.cpp (`grammar.py` borrows llama-cpp-python's pure-Python GBNF tools).
"""

from __future__ import annotations

from .admission_errors import OverloadedError, PromptTooLongError
from .core import Engine, EngineError
from .request import (
    FinishReason,
    Priority,
    Request,
    RequestStatus,
    SamplingParams,
)
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
