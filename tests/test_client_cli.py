"""Finding a server, the CLI twins of the magics, and the batch's pure parts."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from magnitude_jupyter.batch.options import BatchError, BatchOptions
from magnitude_jupyter.batch.score import backoff_seconds, compile_template
from magnitude_jupyter.client.http import discover, iter_sse
from magnitude_jupyter.client.runtime import serve_runtime_files

from .conftest import wait_for


def test_backoff_is_exponential_capped_and_honours_retry_after():
    assert [backoff_seconds(k) for k in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_seconds(10) == 30.0
    assert backoff_seconds(0, retry_after=3.0) == 3.0


def test_template_checks_happen_before_any_request():
    with pytest.raises(BatchError, match=r"'rating'.*columns are: review"):
        compile_template("{{ rating }}", ["review"])
    with pytest.raises(BatchError, match="template error on line 1"):
        compile_template("{{ review ", ["review"])
    assert compile_template("A {{ review|upper }}", ["review"]).render(review="x") == "A X"


def test_json_batch_options_and_column_clashes():
    schema = {"type": "object", "properties": {"sentiment": {"type": "string"}, "stars": {"type": "integer"}}}
    opts = BatchOptions(template="{{ review }}", json_schema=schema)
    assert opts.wants_json and opts.schema_columns == ["sentiment", "stars"]
    assert opts.response_format() == {"type": "json_schema", "json_schema": {"name": "row", "schema": schema}}
    assert BatchOptions(template="x", json_object=True).response_format() == {"type": "json_object"}
    assert BatchOptions(template="x").response_format() is None
    opts.check_columns(["review"])
    with pytest.raises(BatchError, match="'stars' would overwrite"):
        opts.check_columns(["review", "stars"])
    with pytest.raises(BatchError, match="'error'"):
        BatchOptions(template="x", output_column="error").check_columns(["review"])
    with pytest.raises(BatchError, match="--json-schema must be a JSON Schema object"):
        BatchOptions(template="x", json_schema=["not", "a", "schema"]).validate()


def test_sse_parser():
    lines = ["id: 1", "data: a", "", ": comment", "id: 2", "data: b", "data: c", "", "data: [DONE]", ""]
    assert list(iter_sse(iter(lines))) == [(1, "a"), (2, "b\nc"), (None, "[DONE]")]


@pytest.mark.model
def test_discover_starts_one_background_server_and_reuses_it(tmp_path, monkeypatch):
    for var in ("MAGNITUDE_URL", "MAGNITUDE_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MAGNITUDE_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MAGNITUDE_CONFIG", str(tmp_path / "none.yaml"))
    client = None
    try:
        client = discover()
        assert client.source == "magnitude serve (started)"
        assert client.health()["status"] == "ok"
        again = discover()
        assert again.api_base == client.api_base and again.source == "magnitude serve"
    finally:
        for info in serve_runtime_files():
            os.kill(info["pid"], signal.SIGTERM)
        if client is not None:
            client.close()


def magnitude(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "magnitude_jupyter.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


@pytest.mark.model
def test_cli_chat_and_batch(server, tmp_path):
    env = {"MAGNITUDE_URL": server.url, "MAGNITUDE_TOKEN": server.token}
    done = magnitude("chat", "Say hello.", "--max-tokens", "12", "--format", "json", env=env)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["text"] and answer["usage"]["completion_tokens"] <= 12 and answer["model"] == "smollm2-135m"

    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"review": f"review number {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "out.jsonl"

    def batch(template: str, *options: str):
        return magnitude("batch", "--input", str(rows), "--output", str(out), "--template", template, *options, env=env)

    done = batch("Classify: {{ review }}", "--max-tokens", "4", "--concurrency", "3")
    assert done.returncode == 0, done.stderr
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["review"] for r in scored] == [f"review number {i}" for i in range(6)]
    assert all(r["answer"] and r["error"] is None for r in scored)
    assert "6 of 6 rows scored" in done.stderr

    done = batch("{{ missing }}")
    assert done.returncode != 0 and "'missing'" in done.stderr
    done = batch("{{ review }}", "--max-tokens", "2", "--fail-on-truncation")
    assert done.returncode == 1 and "hit max tokens" in done.stderr
    schema = tmp_path / "schema.json"
    label_schema = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}}, "required": ["label"]}
    schema.write_text(json.dumps(label_schema))
    done = batch("Pick a or b for {{ review }}, as JSON.", "--json-schema", str(schema), "--max-tokens", "16")
    assert done.returncode == 0, done.stderr
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in scored] == [r["answer"]["label"] for r in scored]
    assert all(r["label"] in ("a", "b") and r["error"] is None for r in scored)
    done = batch("Classify: {{ review }}", "--max-tokens", "3", "--logprobs")
    assert done.returncode == 0, done.stderr
    assert all(0 < json.loads(line)["probability"] <= 1 for line in out.read_text().splitlines())
    done = magnitude("chat", "hi", "--url", "http://127.0.0.1:9")
    assert done.returncode != 0 and "cannot reach" in done.stderr


@pytest.mark.model
def test_a_checkpoint_is_reused_only_by_the_same_job(server, tmp_path):
    env = {"MAGNITUDE_URL": server.url, "MAGNITUDE_TOKEN": server.token}
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"review": f"review number {i}"}) + "\n" for i in range(6)))
    checkpoint = tmp_path / "ck.jsonl"

    def generated() -> int:
        return httpx.get(server.url + "/status", headers={"Authorization": f"Bearer {server.token}"}).json()[
            "generated_tokens_total"
        ]

    def batch(template: str, *options: str):
        out = tmp_path / "out.jsonl"
        before = generated()
        done = magnitude(
            "batch", "--input", str(rows), "--output", str(out), "--template", template,
            "--checkpoint", str(checkpoint), "--max-tokens", "4", *options, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stderr, generated() - before

    said, tokens = batch("Classify: {{ review }}")
    assert "6 of 6 rows scored" in said and tokens >= 6
    said, tokens = batch("Classify: {{ review }}")
    assert "6 reused from the checkpoint" in said and tokens == 0
    for changed in (("Summarize: {{ review }}",), ("Classify: {{ review }}", "--system", "Be terse."),
                    ("Classify: {{ review }}", "--temperature", "0.5"), ("Classify: {{ review }}", "--max-tokens", "5"),
                    ("Classify: {{ review }}", "--output-column", "label")):  # fmt: skip
        said, tokens = batch(*changed)
        assert "reused from the checkpoint" not in said and tokens >= 6, (changed, said)
        assert "rows of a different job" in said and "not reused" in said


@pytest.mark.model
def test_a_checkpoint_that_cannot_be_written_is_said_and_the_finished_rows_are_output(server, tmp_path):
    """A checkpoint whose writes fail (a full disk, a folder gone) stops being written, said in
    words; the batch goes on and --output holds every finished row."""
    env = {"MAGNITUDE_URL": server.url, "MAGNITUDE_TOKEN": server.token}
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"review": f"review number {i}"}) + "\n" for i in range(4)))
    out = tmp_path / "out.jsonl"
    done = magnitude(
        "batch", "--input", str(rows), "--output", str(out), "--template", "Classify: {{ review }}",
        "--checkpoint", str(tmp_path / "gone" / "ck.jsonl"), "--max-tokens", "3", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "4 of 4 rows scored" in done.stderr and "could not be written" in done.stderr
    assert "Traceback" not in done.stderr
    assert len(out.read_text().splitlines()) == 4


@pytest.mark.model
def test_a_rerun_after_a_torn_checkpoint_line_starts_its_records_on_a_line_of_their_own(server, tmp_path):
    env = {"MAGNITUDE_URL": server.url, "MAGNITUDE_TOKEN": server.token}
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"review": f"review number {i}"}) + "\n" for i in range(3)))
    checkpoint, out = tmp_path / "ck.jsonl", tmp_path / "out.jsonl"

    def batch() -> str:
        done = magnitude(
            "batch", "--input", str(rows), "--output", str(out), "--template", "Classify: {{ review }}",
            "--checkpoint", str(checkpoint), "--max-tokens", "3", env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stderr

    batch()
    lines = checkpoint.read_text().splitlines()
    checkpoint.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # a crash cut the second line
    said = batch()
    assert "1 reused from the checkpoint" in said
    records = checkpoint.read_text().splitlines()
    assert records[1] == lines[1][: len(lines[1]) // 2]  # the torn line stays torn, alone on its line
    assert len(records) == 4 and all(json.loads(line)["row"] for line in (records[0], *records[2:]))
    assert "3 reused from the checkpoint" in batch()


@pytest.mark.model
def test_cli_chat_reads_a_piped_prompt(server):
    env = {**os.environ, "MAGNITUDE_URL": server.url, "MAGNITUDE_TOKEN": server.token}
    done = subprocess.run(
        [sys.executable, "-m", "magnitude_jupyter.cli", "chat", "--max-tokens", "8", "--format", "json"],
        input="Say hello to the pipe.",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["message"] == {"role": "assistant", "content": answer["text"]} and answer["text"]
    assert answer["usage"]["prompt_tokens"] > 5


@pytest.mark.model
def test_cli_chat_holds_a_conversation_at_a_terminal(server):
    import pexpect

    def recent(n: int = 1) -> list[dict]:
        status = httpx.get(server.url + "/status", headers={"Authorization": f"Bearer {server.token}"}).json()
        return status["recent"][:n]

    env = {**os.environ, "MAGNITUDE_URL": server.url, "MAGNITUDE_TOKEN": server.token}
    child = pexpect.spawn(
        sys.executable, ["-m", "magnitude_jupyter.cli", "chat", "--max-tokens", "12"], env=env, timeout=120
    )
    try:
        child.expect("you> ")
        child.sendline("My name is Ada.")
        child.expect("you> ")
        (first,) = recent()
        child.sendline("What is my name?")
        child.expect("you> ")
        (second,) = recent()
        # the second turn carried the first one with it
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
        child.sendline("/reset")
        child.expect("forgotten")
        child.expect("you> ")
        child.sendline("What is my name?")
        child.expect("you> ")
        (fresh,) = recent()
        assert fresh["prompt_tokens"] < second["prompt_tokens"]
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0

    # Ctrl-C stops the answer being written (and its generation on the server), not the session
    long = ["-m", "magnitude_jupyter.cli", "chat", "--max-tokens", "3000", "--ignore-eos"]
    # A test run started in the background of a non-interactive shell inherits SIGINT ignored, and
    # so would the chat: give it the default disposition a person's terminal gives it.
    default_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    child = pexpect.spawn(sys.executable, long, env=env, timeout=120, preexec_fn=default_sigint)
    try:
        child.expect("you> ")
        child.sendline("Count from one to one thousand, in words.")
        child.expect("in words\\.\r\n")  # the terminal's echo of the question
        child.expect(r"\w+\W+\w+\W+\w+", timeout=60)  # the answer is being written
        child.sendintr()
        child.expect(r"\(stopped")
        child.expect("you> ")
        wait_for(lambda: recent()[0]["finish_reason"] == "cancelled", timeout=30, what="the cancel on the server")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


@pytest.mark.model
@pytest.mark.parametrize("when", ["before", "after"])
def test_ctrl_c_as_a_row_is_written_to_the_checkpoint_loses_nothing(engine, tmp_path, monkeypatch, when):
    # Ctrl-C can land on any line of the batch loop: here, just before or just after a row's
    # checkpoint write. Every row the interrupted run counts as done must be in the checkpoint,
    # and every row in the checkpoint counted as done, or the rerun scores it twice or loses it.
    import pandas as pd

    from magnitude_jupyter.batch import score as batch_module
    from magnitude_jupyter.batch.inprocess import EngineClient

    write = batch_module.Checkpoint.append
    writes: list[object] = []

    def interrupted_write(self, row, key, record):
        writes.append(row)
        if when == "before" and len(writes) == 2:
            raise KeyboardInterrupt
        write(self, row, key, record)
        if when == "after" and len(writes) == 2:
            raise KeyboardInterrupt

    df = pd.DataFrame({"text": [f"Name a colour, number {i}." for i in range(12)]})
    options = {"max_tokens": 4, "concurrency": 2, "checkpoint": str(tmp_path / "rows.jsonl"), "progress": False}
    with monkeypatch.context() as patch:
        patch.setattr(batch_module.Checkpoint, "append", interrupted_write)
        first = batch_module.score_dataframe(df, "{{ text }}", client=EngineClient(engine), **options)
    assert first.attrs["magnitude"]["interrupted"]
    done = int(first["error"].isna().sum())
    assert 2 <= done < 12
    second = batch_module.score_dataframe(df, "{{ text }}", client=EngineClient(engine), **options)
    assert second.attrs["magnitude"]["skipped_from_checkpoint"] == done
    assert second["error"].isna().all()
