"""The batch options, declared once: `%%magnitude --df`, `%magnitude batch` and `magnitude batch` are
built from `BatchOptions`' fields (click options in the CLI, argparse in the magics).

Kept apart from `batch` so that the CLI can declare its options without importing the HTTP client
and Jinja2: every `magnitude serve` process imports the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..options import given_values, option
from .labels import parse_labels, probability_column

RESULT_COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens", "latency_ms", "error")
PROBABILITY_COLUMN = "probability"  # with logprobs: the answer's probability under the model (with labels:
# its share among them, see labels.py)
OVERFLOW_MODES = ("error", "truncate", "skip")
TOOL_CALLS_COLUMN = "tool_calls"


class BatchError(ValueError):
    """The batch cannot start: bad template, missing columns, bad options."""


@dataclass
class BatchOptions:
    """Every batch option, declared once: `%%magnitude --df`, `%magnitude batch` and `magnitude batch`
    are built from these fields (`options.add_arguments`, `options.click_options`)."""

    template: str
    system: str | None = option(None, "System message for every row.", "--system", "-s")
    output_column: str = option("answer", "Column for the answers.")
    concurrency: int = option(8, "Rows in flight at once.")
    retry: int = option(3, "Retries per row on timeouts, 429 and 5xx.")
    timeout: float = option(120.0, "Seconds per request.")
    max_tokens: int | None = option(256, "Most tokens per answer.")
    temperature: float = option(0.0, "Sampling temperature (0: greedy).", "--temperature", "-t")
    on_overflow: str = option(
        "error", "A row longer than the context: error, truncate or skip.", choices=OVERFLOW_MODES
    )
    checkpoint: str | Path | None = option(
        None, "JSONL file of finished rows; a rerun of the same job reuses them.", type=str
    )
    model: str | None = option(None, "Model to ask for (default: the server's).", "--model", "-m")
    json_object: bool = option(False, "Each answer a JSON object, parsed.", "--json")
    # Each surface reads --json-schema its own way (a notebook variable, a file) and passes the dict.
    json_schema: dict[str, Any] | None = option(
        None, "A JSON Schema: answers follow it, its properties become columns.", type=str
    )
    logprobs: bool = option(False, "Add the answer's probability under the model.")
    labels: str | list[str] | None = option(
        None,
        "The only answers allowed, comma-separated (a grammar holds the model to them); "
        "with --logprobs, each label's probability.",
        type=str,
    )
    reproducible: bool = option(False, "Each answer as an idle engine gives it, whatever else runs (slower).")
    # Tools the model may call (OpenAI's shape), from Python only: each row's calls land in the
    # `tool_calls` column, as {name, arguments} with the arguments parsed.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # auto | required | none | {type: function, ...}
    progress: bool = True

    @property
    def wants_json(self) -> bool:
        return self.json_object or self.json_schema is not None

    @property
    def schema_columns(self) -> list[str]:
        """The schema's top-level properties: one column each, filled from the parsed answers."""
        properties = (self.json_schema or {}).get("properties")
        return [str(name) for name in properties] if isinstance(properties, dict) else []

    @property
    def label_list(self) -> list[str]:
        return parse_labels(self.labels)

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns a batch adds to the input."""
        extra: tuple[str, ...] = ()
        if self.logprobs:
            extra = (PROBABILITY_COLUMN, *(probability_column(label) for label in self.label_list))
        calls = (TOOL_CALLS_COLUMN,) if self.tools else ()
        return (self.output_column, *calls, *self.schema_columns, *extra, *RESULT_COLUMNS)

    def response_format(self) -> dict[str, Any] | None:
        if self.json_schema is not None:
            return {"type": "json_schema", "json_schema": {"name": "row", "schema": self.json_schema}}
        return {"type": "json_object"} if self.json_object else None

    def validate(self) -> None:
        if self.concurrency < 1:
            raise BatchError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.retry < 0:
            raise BatchError(f"--retry must be 0 or more, got {self.retry}")
        if self.timeout <= 0:
            raise BatchError(f"--timeout must be positive, got {self.timeout}")
        if self.on_overflow not in OVERFLOW_MODES:
            raise BatchError(f"--on-overflow must be one of {', '.join(OVERFLOW_MODES)}, got {self.on_overflow!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise BatchError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise BatchError(f"--json-schema must be a JSON Schema object, got {type(self.json_schema).__name__}")
        if self.labels is not None:
            try:
                parse_labels(self.labels)
            except ValueError as exc:
                raise BatchError(str(exc)) from None
            if self.wants_json:
                raise BatchError("--labels holds each answer to a label: it does not combine with --json/--json-schema")
        if self.tools is not None:
            if not isinstance(self.tools, list) or not self.tools:
                raise BatchError("tools must be a non-empty list of OpenAI tool definitions")
            if self.wants_json or self.labels is not None:
                raise BatchError("tools hold an answer to a call's schema: they do not combine with json or labels")
        elif self.tool_choice is not None:
            raise BatchError("tool_choice needs tools")

    def check_columns(self, columns: list[str]) -> None:
        """The output columns must not overwrite the input's or each other."""
        produced = list(self.columns)
        clash = sorted({c for c in produced if c in columns} | {c for c in produced if produced.count(c) > 1})
        if clash:
            raise BatchError(
                f"the output column{'s' if len(clash) > 1 else ''} {', '.join(map(repr, clash))} would overwrite "
                "an input column or another output; choose another --output-column or rename the schema's properties"
            )


def given_options(values: Any) -> dict[str, Any]:
    """The batch options set in parsed arguments (an argparse Namespace or a dict), by field name."""
    return given_values(BatchOptions, values)
