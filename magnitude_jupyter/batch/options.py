"""The batch options, declared once: `%%magnitude --df`, `%magnitude batch` and `magnitude batch` are
built from `BatchOptions`' fields (click options in the CLI, argparse in the magics).

Kept apart from `batch` so that the CLI can declare its options without importing the HTTP client
and Jinja2: every `magnitude serve` process imports the CLI.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .labels import parse_labels, probability_column

RESULT_COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens", "latency_ms", "error")
PROBABILITY_COLUMN = "probability"  # with logprobs: the answer's probability under the model (with labels:
# its share among them, see labels.py)
OVERFLOW_MODES = ("error", "truncate", "skip")
TOOL_CALLS_COLUMN = "tool_calls"


class BatchError(ValueError):
    """The batch cannot start: bad template, missing columns, bad options."""


@dataclass(frozen=True)
class Flag:
    """How one batch option is spelled on the command line and in the magics."""

    name: str
    help: str
    type: type = str
    short: str | None = None
    choices: tuple[str, ...] | None = None


def flag(name: str, help: str, type: type = str, **spelling: Any) -> dict[str, Flag]:
    return {"flag": Flag(name, help, type, **spelling)}


@dataclass
class BatchOptions:
    """Every batch option, declared once: `%%magnitude --df`, `%magnitude batch` and `magnitude batch`
    are built from these fields (see `batch_flags`)."""

    template: str
    system: str | None = field(default=None, metadata=flag("--system", "System message for every row.", short="-s"))
    output_column: str = field(default="answer", metadata=flag("--output-column", "Column for the answers."))
    concurrency: int = field(default=8, metadata=flag("--concurrency", "Rows in flight at once.", int))
    retry: int = field(default=3, metadata=flag("--retry", "Retries per row on timeouts, 429 and 5xx.", int))
    timeout: float = field(default=120.0, metadata=flag("--timeout", "Seconds per request.", float))
    max_tokens: int | None = field(default=256, metadata=flag("--max-tokens", "Most tokens per answer.", int))
    temperature: float = field(
        default=0.0, metadata=flag("--temperature", "Sampling temperature (0: greedy).", float, short="-t")
    )
    on_overflow: str = field(
        default="error",
        metadata=flag(
            "--on-overflow", "A row longer than the context: error, truncate or skip.", choices=OVERFLOW_MODES
        ),
    )
    checkpoint: str | Path | None = field(
        default=None, metadata=flag("--checkpoint", "JSONL file of finished rows; a rerun of the same job reuses them.")
    )
    model: str | None = field(
        default=None, metadata=flag("--model", "Model to ask for (default: the server's).", short="-m")
    )
    json_object: bool = field(default=False, metadata=flag("--json", "Each answer a JSON object, parsed.", bool))
    # Each surface reads --json-schema its own way (a notebook variable, a file) and passes the dict.
    json_schema: dict[str, Any] | None = field(
        default=None, metadata=flag("--json-schema", "A JSON Schema: answers follow it, its properties become columns.")
    )
    logprobs: bool = field(
        default=False, metadata=flag("--logprobs", "Add the answer's probability under the model.", bool)
    )
    labels: str | list[str] | None = field(
        default=None,
        metadata=flag(
            "--labels",
            "The only answers allowed, comma-separated (a grammar holds the model to them); "
            "with --logprobs, each label's probability.",
        ),
    )
    reproducible: bool = field(
        default=False,
        metadata=flag("--reproducible", "Each answer as an idle engine gives it, whatever else runs (slower).", bool),
    )
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


def batch_flags() -> list[tuple[str, Flag, Any]]:
    """(field name, flag, default) of every batch option a person can set."""
    return [(f.name, f.metadata["flag"], f.default) for f in fields(BatchOptions) if "flag" in f.metadata]


def add_batch_arguments(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """The batch options on an argparse parser (the magics); unset ones parse as None."""
    for name, flag, default in batch_flags():
        if name in skip:
            continue
        names = [flag.name, *([flag.short] if flag.short else [])]
        if flag.type is bool:
            parser.add_argument(*names, dest=name, action="store_true", default=None, help=flag.help)
        else:
            help_text = f"{flag.help} (default: {default})"
            parser.add_argument(*names, dest=name, type=flag.type, choices=flag.choices, default=None, help=help_text)


def given_options(values: Any) -> dict[str, Any]:
    """The batch options set in parsed arguments (an argparse Namespace or a dict), by field name."""
    values = values if isinstance(values, dict) else vars(values)
    return {name: values[name] for name, _, _ in batch_flags() if values.get(name) is not None}
