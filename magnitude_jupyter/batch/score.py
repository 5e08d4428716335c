"""Score a DataFrame row by row with a Jinja2 template, concurrently, without ever losing a finished row.

Problems with the template or the columns are reported before any request is sent. Each row is
retried with exponential backoff on timeouts, 429 and 5xx; a row that still fails carries its
error and the others go on. With a checkpoint (JSONL), every finished row is written as it
finishes and a rerun skips rows already scored. An interrupt returns the rows finished so far.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import jinja2
import jinja2.meta

from ..client.exchange import prompt_messages
from ..client.http import ClientError, StreamResult, discover
from .labels import label_shares, labels_grammar, probability_column
from .options import PROBABILITY_COLUMN, TOOL_CALLS_COLUMN, BatchError, BatchOptions

log = logging.getLogger(__name__)


class ChatClient(Protocol):
    """What a batch needs of a client: `client.Client` over HTTP, or `inprocess.EngineClient`."""

    api_base: str

    def stream_chat(
        self, messages: list[dict[str, Any]], result: StreamResult | None = None, max_resumes: int = 5, **body: Any
    ) -> Iterator[str]: ...
    def cancel(self, completion_id: str) -> None: ...
    def models(self) -> list[dict[str, Any]]: ...
    def close(self) -> None: ...
    def with_timeout(self, timeout: float) -> ChatClient: ...


if TYPE_CHECKING:
    import pandas as pd


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


def request_for(prompt: str, opts: BatchOptions) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """(messages, request body) for one row."""
    messages = prompt_messages(prompt, opts.system)
    body: dict[str, Any] = {"temperature": opts.temperature, "priority": "batch"}
    if opts.max_tokens is not None:
        body["max_tokens"] = opts.max_tokens
    if opts.model:
        body["model"] = opts.model
    if opts.wants_json:
        body["response_format"] = opts.response_format()
    if opts.logprobs:
        body["logprobs"] = True
    if opts.reproducible:
        body["reproducible"] = True
    if opts.tools:
        body["tools"] = opts.tools
        if opts.tool_choice is not None:
            body["tool_choice"] = opts.tool_choice
    return messages, body


def job_key(messages: list[dict[str, str]], body: dict[str, Any], opts: BatchOptions, model: str | None) -> str:
    """What made a row's answer, hashed: the messages, every sampling setting, the model that
    answers (the server's default when none is named) and the columns the answer lands in."""
    made_of = {
        "messages": messages,
        "body": {k: v for k, v in body.items() if k != "priority"},
        "model": model,
        "columns": opts.columns,
        **({"labels": opts.label_list} if opts.labels is not None else {}),  # other jobs keep their keys
    }
    return hashlib.sha256(json.dumps(made_of, sort_keys=True, default=str).encode()).hexdigest()[:32]


class Checkpoint:
    """Finished rows, one JSON line each, keyed by row index and by what made the answer (`job_key`).

    A rerun reuses a record only where both match, so a checkpoint written by another template,
    model, system prompt, sampling setting, schema or DataFrame is never mixed in; `unmatched`
    counts the records it held that this job could not use.
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self.records: dict[tuple[str, str], dict[str, Any]] = {}
        self.failure: str | None = None  # why the checkpoint stopped being written, in words
        self._torn_tail = False  # the file ends inside a line (a crash or a full disk cut it short)
        if self.path is not None and self.path.exists():
            data = self.path.read_bytes()
            self._torn_tail = bool(data) and not data.endswith(b"\n")
            for line in data.decode("utf-8", errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash: that row is simply scored again
                if isinstance(record, dict) and record.get("error") is None:
                    self.records[(str(record.get("row")), str(record.get("key")))] = record

    def take(self, row: Any, key: str) -> dict[str, Any] | None:
        """The saved result of this row of this job, if there is one (removed from `records`)."""
        record = self.records.pop((str(row), key), None)
        return None if record is None else {k: v for k, v in record.items() if k not in ("row", "key")}

    @property
    def unmatched(self) -> int:
        return len(self.records)

    def append(self, row: Any, key: str, record: dict[str, Any]) -> None:
        """Save a finished row. A line that cannot be written (a full disk, a file gone read-only)
        stops the saving, said in `failure`: the batch goes on, its rows in its result, and the next
        record written (by a rerun) starts on a line of its own after the torn one."""
        if self.path is None or self.failure is not None:
            return
        line = json.dumps({"row": str(row), "key": key, **record}, default=str) + "\n"
        with self._lock:
            try:
                with self.path.open("a", encoding="utf-8") as fh:
                    if self._torn_tail:
                        fh.write("\n")
                        self._torn_tail = False
                    fh.write(line)
                    fh.flush()
            except OSError as exc:
                self._torn_tail = True
                self.failure = (
                    f"the checkpoint {self.path} could not be written ({exc.strerror or exc}): rows finished "
                    "from then on are in the result but not saved for a rerun"
                )
                log.warning("%s", self.failure)


def answer_probability(logprobs: list[dict[str, Any]]) -> float | None:
    """The probability of the whole answer: the product of its tokens' probabilities."""
    if not logprobs:
        return None
    return math.exp(sum(float(entry["logprob"]) for entry in logprobs))


def _calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A row's tool calls as {name, arguments}, the arguments parsed (their text where they do not parse)."""
    out = []
    for call in tool_calls:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = function.get("arguments")
        out.append({"name": function.get("name"), "arguments": arguments})
    return out


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


def _score_labels(
    score: Callable[[dict[str, Any], BatchOptions], dict[str, Any]], body: dict[str, Any], opts: BatchOptions
) -> dict[str, Any]:
    """A row with --labels: each label's likelihood (labels.py), the most likely one the answer.
    `score(body, opts)` scores the row once."""
    start = time.monotonic()
    each = replace(opts, labels=None, logprobs=True, json_object=False, json_schema=None)
    likelihoods: dict[str, float] = {}
    records = []
    for label in opts.label_list:
        record = score({**body, "logprobs": True, "grammar": labels_grammar([label])}, each)
        if record.get("error"):
            return record
        records.append(record)
        likelihoods[label] = record[PROBABILITY_COLUMN] or 0.0
    shares = label_shares(likelihoods)
    answer = max(likelihoods, key=lambda label: likelihoods[label])
    out = {
        opts.output_column: answer,
        "finish_reason": "stop",
        "prompt_tokens": records[0]["prompt_tokens"],
        "completion_tokens": sum(r["completion_tokens"] or 0 for r in records),
        "latency_ms": round((time.monotonic() - start) * 1000, 1),
        "error": None,
    }
    if opts.logprobs:
        out[PROBABILITY_COLUMN] = shares[answer]
        out |= {probability_column(label): share for label, share in shares.items()}
    return out


def _score_row(
    client: ChatClient,
    messages: list[dict[str, str]],
    body: dict[str, Any],
    opts: BatchOptions,
    stop: threading.Event,
    inflight: dict[int, str],
) -> dict[str, Any]:
    if opts.labels is not None:
        return _score_labels(lambda b, o: _score_row(client, messages, b, o, stop, inflight), body, opts)
    messages = list(messages)
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
            if opts.logprobs:
                record[PROBABILITY_COLUMN] = answer_probability(result.logprobs)
            if opts.tools:
                record[TOOL_CALLS_COLUMN] = _calls(result.tool_calls)
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


def score_dataframe(
    df: pd.DataFrame, template: str, client: ChatClient | None = None, origin: str = "batch", **options: Any
) -> pd.DataFrame:
    """A new DataFrame (the input untouched, its index kept) with the answers and per-row figures.

    Options are `BatchOptions` fields; `origin` names the batch in the server's panel, each row as
    "ORIGIN · row INDEX · N rows" (the panel groups them by ORIGIN). Rows go out with the engine's
    batch priority, so interactive cells stay responsive while a batch runs. A dask DataFrame is
    scored on the Dask workers' own engines by `dask.score_dask_dataframe` (dask builds on this
    module, never the other way).
    """
    if is_dask_dataframe(df):
        raise BatchError(
            "a dask DataFrame is scored by the workers' engines: "
            "from magnitude_jupyter.batch.dask import score_dask_dataframe"
        )
    opts = BatchOptions(template=template, **options)
    opts.validate()
    opts.check_columns([str(c) for c in df.columns])
    prompts = render_prompts(df, template)
    worker = (client or discover()).with_timeout(opts.timeout)
    run = _BatchRun(df, prompts, opts, worker, origin)
    try:
        run.score()
    finally:
        worker.close()
    return run.frame()


class _BatchRun:
    """One batch: the rows a checkpoint already holds, the others scored `opts.concurrency` at a time,
    each finished row written to the checkpoint as it comes; an interrupt keeps what finished."""

    def __init__(
        self, df: pd.DataFrame, prompts: dict[Any, str], opts: BatchOptions, worker: ChatClient, origin: str
    ) -> None:
        self.df, self.opts, self.worker, self.origin = df, opts, worker, origin
        self.checkpoint = Checkpoint(opts.checkpoint)
        model = opts.model or (served_model(worker) if self.checkpoint.path is not None else None)
        self.requests = {index: request_for(prompts[index], opts) for index in df.index}
        self.keys = {index: job_key(*self.requests[index], opts, model) for index in df.index}
        self.results: dict[Any, dict[str, Any]] = {}
        for index in df.index:
            record = self.checkpoint.take(index, self.keys[index])
            if record is not None:
                self.results[index] = record
        self.reused = len(self.results)
        self.collected: set[Any] = set()
        self.interrupted = False
        self.stop = threading.Event()
        self.inflight: dict[int, str] = {}
        self.shown_errors = 0  # for the bar; the count returned is recounted from the results

    def score(self) -> None:
        from tqdm.auto import tqdm

        todo = [index for index in self.df.index if index not in self.results]
        self.bar = tqdm(
            total=len(self.df), initial=self.reused, desc="magnitude batch", unit="row", disable=not self.opts.progress
        )
        pool = ThreadPoolExecutor(max_workers=self.opts.concurrency, thread_name_prefix="magnitude-batch")
        futures: dict[Future, Any] = {self._submit(pool, i): i for i in todo}
        try:
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for future in finished:
                    self._collect(futures[future], future)
        except KeyboardInterrupt:
            self.interrupted = True
            self.stop.set()
            for completion_id in list(self.inflight.values()):
                self.worker.cancel(completion_id)
            for future in futures:
                future.cancel()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for future, index in futures.items():  # rows that finished while we were stopping, or mid-collect
                if future.done() and not future.cancelled():
                    self._collect(index, future)
            self.bar.close()

    def _submit(self, pool: ThreadPoolExecutor, index: Any) -> Future:
        messages, body = self.requests[index]
        origin = f"{self.origin} · row {index} · {len(self.df)} rows"
        return pool.submit(
            _score_row, self.worker, messages, {**body, "origin": origin}, self.opts, self.stop, self.inflight
        )

    def _collect(self, index: Any, future: Future) -> None:
        # Ctrl-C can land between any two lines here, and `score` collects again whatever did not
        # reach `collected`: so the row is written to the checkpoint first (a second copy of a line
        # is harmless), and counts as a result only once it is there.
        if index in self.collected:
            return
        record = future.result()
        if record.get("error") == "not run (interrupted)":
            return
        if not record.get("error"):
            self.checkpoint.append(index, self.keys[index], record)
        self.results[index] = record
        self.collected.add(index)
        self.shown_errors += bool(record.get("error"))
        self.bar.update(1)
        self.bar.set_postfix(errors=self.shown_errors, refresh=False)

    def frame(self) -> pd.DataFrame:
        import pandas as pd

        df, results = self.df, self.results
        out = df.copy()
        for column in self.opts.columns:
            out[column] = pd.Series([results.get(i, {}).get(column) for i in df.index], index=df.index, dtype=object)
        for index in df.index:
            if index not in results:
                out.at[index, "error"] = "not run (interrupted)"
        out.attrs["magnitude"] = {
            "interrupted": self.interrupted,
            "errors": sum(1 for i in self.collected if results[i].get("error")),
            "skipped_from_checkpoint": self.reused,
            "checkpoint_unmatched": self.checkpoint.unmatched,
            "checkpoint_failure": self.checkpoint.failure,
        }
        return out


def is_dask_dataframe(df: Any) -> bool:
    return type(df).__module__.startswith("dask.") and hasattr(df, "map_partitions")


def served_model(client: ChatClient) -> str | None:
    """The model a server answers with when none is named (for checkpoint keys)."""
    try:
        models = client.models()
    except ClientError:
        return None
    return str(models[0]["id"]) if models else None


def summary_line(result: pd.DataFrame, checkpoint: str | Path | None = None, done_as: str = "scored") -> str:
    """One line for a person: rows scored (or `done_as`), failed, reused, and checkpoint records of another job."""
    info = result.attrs.get("magnitude", {})
    done = int(result["error"].isna().sum())
    note = f"{done} of {len(result)} rows {done_as}"
    if info.get("errors"):
        note += f", {info['errors']} failed (see the 'error' column)"
    if info.get("skipped_from_checkpoint"):
        note += f", {info['skipped_from_checkpoint']} reused from the checkpoint"
    if info.get("checkpoint_unmatched"):
        note += (
            f"; the checkpoint {checkpoint} also holds {info['checkpoint_unmatched']} rows of a different job "
            "(another template, model, DataFrame or setting): they were not reused"
        )
    if info.get("checkpoint_failure"):
        note += f"; {info['checkpoint_failure']}"
    if info.get("interrupted"):
        note += "; interrupted: the finished rows are kept" + (
            ", rerun with the same checkpoint to finish" if checkpoint else ""
        )
    return note
