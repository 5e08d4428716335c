"""OpenAI's embeddings API: `input` as a string, strings, or token arrays; vectors as floats or base64."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import refuse_unknown_fields
from .generation import bad_param

FIELDS = {"model", "input", "encoding_format", "user"}
MAX_INPUTS = 2048  # as OpenAI's API allows
REFUSED = {"dimensions": "'dimensions' is not supported: a model's embeddings have the size it was trained with"}


@dataclass
class EmbeddingRequest:
    model: str | None
    inputs: list[str] | list[list[int]]
    encoding_format: str = "float"


def parse_embeddings(data: dict[str, Any]) -> EmbeddingRequest:
    refuse_unknown_fields(data, FIELDS, REFUSED)
    raw = data.get("input")
    inputs: list[Any]
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        inputs = [raw]  # one token array
    elif isinstance(raw, list) and raw:
        inputs = raw
    else:
        raise bad_param("input", "'input' must be a string, a list of strings, or token arrays")
    if len(inputs) > MAX_INPUTS:
        raise bad_param("input", f"'input' holds {len(inputs)} items; the limit is {MAX_INPUTS}")
    strings = all(isinstance(x, str) for x in inputs)
    arrays = all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in inputs)
    if not (strings or arrays):
        raise bad_param("input", "'input' items must all be strings, or all token arrays (lists of integers)")
    if arrays and any(t < 0 for x in inputs for t in x):
        raise bad_param("input", "token ids are not negative")
    encoding = data.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad_param("encoding_format", "'encoding_format' must be 'float' or 'base64'")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_param("model", "'model' must be a string")
    return EmbeddingRequest(model, inputs, encoding)


def embeddings_response(model: str, vectors: list[np.ndarray], tokens: int, encoding: str) -> dict[str, Any]:
    def encoded(vector: np.ndarray) -> Any:
        if encoding == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return vector.astype(np.float32).tolist()

    return {
        "object": "list",
        "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
