"""Score a DataFrame row by row with a Jinja2 template, concurrently, without ever losing a finished row.

Problems with the template or the columns are reported before any request is sent. Each row is
retried with exponential backoff on timeouts, 429 and 5xx; a row that still fails carries its
error and the others go on. With a checkpoint (JSONL), every finished row is written as it
finishes and a rerun skips rows already scored. An interrupt returns the rows finished so far.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.meta

from .client import Client, ClientError, StreamResult, discover

if TYPE_CHECKING:
    import pandas as pd

RESULT_COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens", "latency_ms", "error")
OVERFLOW_MODES = ("error", "truncate", "skip")


class BatchError(ValueError):
    """The batch cannot start: bad template, missing columns, bad options."""


@dataclass
class BatchOptions:
    template: str
    system: str | None = None
    output_column: str = "answer"
    concurrency: int = 8
    retry: int = 3
    timeout: float = 120.0
    max_tokens: int | None = 256
    temperature: float = 0.0
    on_overflow: str = "error"
    checkpoint: str | Path | None = None
    model: str | None = None
    progress: bool = True
    json_object: bool = False  # each answer a JSON object (the server's grammar holds it to that), parsed
    json_schema: dict[str, Any] | None = None  # answers follow this schema; its properties become columns

    @property
    def wants_json(self) -> bool:
        return self.json_object or self.json_schema is not None

    @property
    def schema_columns(self) -> list[str]:
        """The schema's top-level properties: one column each, filled from the parsed answers."""
        properties = (self.json_schema or {}).get("properties")
        return [str(name) for name in properties] if isinstance(properties, dict) else []

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

    def check_columns(self, columns: list[str]) -> None:
        """The output columns must not overwrite the input's or each other."""
        produced = [self.output_column, *self.schema_columns, *RESULT_COLUMNS]
        clash = sorted({c for c in produced if c in columns} | {c for c in produced if produced.count(c) > 1})
        if clash:
            raise BatchError(
                f"the output column{'s' if len(clash) > 1 else ''} {', '.join(map(repr, clash))} would overwrite "
                "an input column or another output; choose another --output-column or rename the schema's properties"
            )


def compile_template(template: str, columns: list[str]) -> jinja2.Template:
    """The row template, checked against the DataFrame's columns before anything is sent."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
    try:
        parsed = env.parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise BatchError(f"template error on line {exc.lineno}: {exc.message}") from None
    missing = sorted(jinja2.meta.find_undeclared_variables(parsed) - set(columns))
    if missing:
        raise BatchError(
            f"the template uses column{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
            f"that the DataFrame does not have; its columns are: {', '.join(map(str, columns))}"
        )
    return env.from_string(template)


def render_prompts(df: pd.DataFrame, template: str) -> dict[Any, str]:
    compiled = compile_template(template, [str(c) for c in df.columns])
    prompts = {}
    for index, row in zip(df.index, df.to_dict("records"), strict=True):
        try:
            prompts[index] = compiled.render(**{str(k): v for k, v in row.items()})
        except jinja2.TemplateError as exc:
            raise BatchError(f"the template failed on row {index!r}: {exc}") from None
    return prompts


def backoff_seconds(attempt: int, retry_after: float | None = None, base: float = 0.5, cap: float = 30.0) -> float:
    """Exponential backoff: 0.5, 1, 2, 4 … s, or what the server asked for (Retry-After), never above `cap`."""
    if retry_after is not None:
        return min(cap, retry_after)
    return min(cap, base * 2**attempt)


class _Checkpoint:
    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()

    def load(self) -> dict[str, dict[str, Any]]:
        done: dict[str, dict[str, Any]] = {}
        if self.path is None or not self.path.exists():
            return done
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash: that row is simply scored again
            if record.get("error") is None:
                done[record["key"]] = record
        return done

    def append(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with self._lock, self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, default=str) + "\n")
            fh.flush()


def _parse_json_answer(record: dict[str, Any], opts: BatchOptions) -> dict[str, Any]:
    """The answer as a parsed object, its schema's properties as columns; unparseable text is the row's error
    (so a checkpointed rerun scores it again), kept as text in the answer column."""
    text = record[opts.output_column]
    try:
        value = json.loads(text)
    except ValueError as exc:
        cut = " (cut off at --max-tokens)" if record["finish_reason"] == "length" else ""
        return {**record, "error": f"the answer is not valid JSON{cut}: {exc}"}
    record[opts.output_column] = value
    for column in opts.schema_columns:
        record[column] = value.get(column) if isinstance(value, dict) else None
    return record


def _score_row(
    client: Client, prompt: str, opts: BatchOptions, stop: threading.Event, inflight: dict[int, str]
) -> dict[str, Any]:
    messages = ([{"role": "system", "content": opts.system}] if opts.system else []) + [
        {"role": "user", "content": prompt}
    ]
    body: dict[str, Any] = {"temperature": opts.temperature, "priority": "batch"}
    if opts.max_tokens is not None:
        body["max_tokens"] = opts.max_tokens
    if opts.model:
        body["model"] = opts.model
    if opts.wants_json:
        body["response_format"] = opts.response_format()
    start = time.monotonic()
    last_error = "not run"
    for attempt in range(opts.retry + 1):
        if stop.is_set():
            return {"error": "not run (interrupted)"}
        result = StreamResult()
        try:
            for _ in client.stream_chat(messages, result=result, **body):
                if result.id:
                    inflight[threading.get_ident()] = result.id
            if result.engine_finish_reason in ("cancelled", "error"):
                error = (result.raw_final.get("magnitude") or {}).get("error")
                return {"error": f"{result.engine_finish_reason} by the server" + (f": {error}" if error else "")}
            usage = result.usage or {}
            record = {
                opts.output_column: result.text,
                "finish_reason": result.finish_reason,
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "latency_ms": round((time.monotonic() - start) * 1000, 1),
                "error": None,
            }
            return _parse_json_answer(record, opts) if opts.wants_json else record
        except ClientError as exc:
            last_error = str(exc)
            if exc.code == "context_length_exceeded":
                if opts.on_overflow == "skip":
                    return {"finish_reason": "skipped", "error": f"skipped: {exc}"}
                if opts.on_overflow == "truncate" and attempt < opts.retry:
                    keep = max(1, int(len(messages[-1]["content"]) * 0.7))
                    messages[-1] = {"role": "user", "content": messages[-1]["content"][:keep]}
                    continue
                return {"error": last_error}
            if not exc.retryable:
                return {"error": last_error}
            retry_after = exc.retry_after
        except Exception as exc:  # timeouts and transport errors: retry
            last_error = f"{type(exc).__name__}: {exc}"
            retry_after = None
        finally:
            inflight.pop(threading.get_ident(), None)
        if attempt < opts.retry:
            stop.wait(backoff_seconds(attempt, retry_after))
    return {"error": f"failed after {opts.retry + 1} attempts: {last_error}"}


def score_dataframe(df: pd.DataFrame, template: str, client: Client | None = None, **options: Any) -> pd.DataFrame:
    """A new DataFrame (the input untouched, its index kept) with the answers and per-row figures.

    Options are `BatchOptions` fields. Rows go out with the engine's batch priority, so interactive
    cells stay responsive while a batch runs.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    opts = BatchOptions(template=template, **options)
    opts.validate()
    opts.check_columns([str(c) for c in df.columns])
    prompts = render_prompts(df, template)
    base = client or discover()
    worker = Client(base.api_base, base.token, timeout=opts.timeout, source=base.source)
    checkpoint = _Checkpoint(opts.checkpoint)
    done = checkpoint.load()

    results: dict[Any, dict[str, Any]] = {}
    for index in df.index:
        record = done.get(str(index))
        if record is not None:
            results[index] = {k: v for k, v in record.items() if k != "key"}
    todo = [index for index in df.index if index not in results]

    stop = threading.Event()
    inflight: dict[int, str] = {}
    errors = 0
    bar = tqdm(total=len(df), initial=len(results), desc="magnitude batch", unit="row", disable=not opts.progress)
    pool = ThreadPoolExecutor(max_workers=opts.concurrency, thread_name_prefix="magnitude-batch")
    futures: dict[Future, Any] = {pool.submit(_score_row, worker, prompts[i], opts, stop, inflight): i for i in todo}
    interrupted = False

    def collect(future: Future) -> None:
        nonlocal errors
        index = futures[future]
        record = future.result()
        if record.get("error") == "not run (interrupted)":
            return
        results[index] = record
        if record.get("error"):
            errors += 1
        else:
            checkpoint.append({"key": str(index), **record})
        bar.update(1)
        bar.set_postfix(errors=errors, refresh=False)

    try:
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in finished:
                collect(future)
    except KeyboardInterrupt:
        interrupted = True
        stop.set()
        for completion_id in list(inflight.values()):
            worker.cancel(completion_id)
        for future in futures:
            future.cancel()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for future, index in futures.items():  # rows that finished while we were stopping
            if index not in results and future.done() and not future.cancelled():
                collect(future)
        bar.close()
        worker.close()

    out = df.copy()
    columns = (opts.output_column, *opts.schema_columns, *RESULT_COLUMNS)
    for column in columns:
        out[column] = pd.Series([results.get(i, {}).get(column) for i in df.index], index=df.index, dtype=object)
    never_run = [i for i in df.index if i not in results]
    for index in never_run:
        out.at[index, "error"] = "not run (interrupted)"
    out.attrs["magnitude"] = {"interrupted": interrupted, "errors": errors, "skipped_from_checkpoint": len(done)}
    return out
