"""The hostile client and the hostile file against the real server: each defect an outside probe found,
reproduced, and the server still serving after it.

Most tests use the real tornado app of `magnitude serve` in this process (in front of the shared real
engine); the GGUF and SIGTERM tests start a `magnitude serve` of their own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import uuid

import httpx
import psutil
import pytest

from magnitude_jupyter.client.runtime import LocalServer

from .conftest import wait_for

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": "Say hi."}]


def post(inproc, body, path: str = "/v1/chat/completions", timeout: float = 120):
    return httpx.post(inproc.url + path, json=body, headers=inproc.headers(), timeout=timeout)


def assert_still_serving(inproc) -> None:
    r = post(inproc, {"messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200, r.text


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


CRASH_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10_000_000}}, "required": ["s"]}


def test_the_schema_that_crashed_the_server_is_served_within_the_cap_and_the_server_keeps_serving(inproc):
    """maxLength 10,000,000 once ran llama.cpp's stack out. The maximum is now written as a flat
    repetition, lowered to the cap (a stricter schema: every answer still validates), so the request
    is answered, as real clients need (Claude Code sends maxLength 524,288)."""
    body = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "response_format": schema_format(CRASH_SCHEMA)}
    r = post(inproc, body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert len(json.loads(content)["s"]) <= 4096
    assert_still_serving(inproc)


def test_a_minimum_over_its_cap_is_a_400_naming_keyword_value_and_cap(inproc):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 10_000_000}}, "required": ["s"]}
    r = post(inproc, {"messages": MESSAGES, "max_tokens": 4, "response_format": schema_format(schema)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "'minLength' is 10000000" in error["message"]
    assert "4096" in error["message"]
    assert_still_serving(inproc)


def test_a_raw_grammar_that_would_run_llama_cpp_out_of_stack_is_a_400(inproc):
    for grammar in ('root ::= "a"{0,10000000}', "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000):
        r = post(inproc, {"messages": MESSAGES, "max_tokens": 4, "grammar": grammar})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "grammar"
    assert_still_serving(inproc)


def test_schemas_at_the_caps_are_served(inproc):
    """The caps refuse only what is over them: the largest string length and enum still run."""
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 4096},
            "e": {"enum": [f"value {i}" for i in range(256)]},
        },
        "required": ["e", "s"],
    }
    r = post(
        inproc, {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "response_format": schema_format(schema)}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "schema",
    [
        {"enum": [f"v{i}" for i in range(100_000)]},
        {"type": "string", "pattern": "^(a+)+$"},
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}},
        {"type": "string", "pattern": "^a{1000000}$"},
    ],
    ids=["enum-100k", "nested-quantifier", "properties-10k", "huge-repeat"],
)
def test_schemas_that_stalled_other_clients_are_refused_before_compiling(inproc, schema):
    """The probe saw these raise another client's 4-token request from 0.15 s to 2-4 s: refused, they
    never reach the grammar compiler or the engine's thread."""
    r = post(inproc, {"messages": MESSAGES, "max_tokens": 4, "response_format": schema_format(schema)})
    assert r.status_code == 400, r.text
    assert "limit" in r.json()["error"]["message"] or "repeats a group" in r.json()["error"]["message"]


class Listener:
    """A local HTTP listener that counts the connections it receives."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.sock.close()


def test_a_remote_or_file_reference_is_a_400_and_nothing_is_fetched_or_opened(inproc, tmp_path):
    listener = Listener()
    secret = tmp_path / "secret.json"
    secret.write_text('{"type": "string"}')
    try:
        refs = [
            f"http://127.0.0.1:{listener.port}/internal?x=1",
            f"https://127.0.0.1:{listener.port}/s.json",
            f"file://{secret}",
            f"file://{tmp_path}/missing.json",
        ]
        answers = []
        for ref in refs:
            schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
            tools = [{"type": "function", "function": {"name": "f", "description": "", "parameters": schema}}]
            for body in (
                {"messages": MESSAGES, "max_tokens": 4, "tools": tools},
                {"messages": MESSAGES, "max_tokens": 4, "response_format": schema_format(schema)},
            ):
                r = post(inproc, body)
                assert r.status_code == 400, r.text
                answers.append(r.json()["error"]["message"])
        assert listener.connections == 0
        # The same words whatever the target: no oracle for which files exist or what they hold.
        assert all("points outside the schema" in message for message in answers)
    finally:
        listener.close()
    assert_still_serving(inproc)


def test_with_a_cache_salt_another_users_identical_prefix_reports_no_cached_tokens(inproc):
    system = f"{uuid.uuid4().hex} You answer questions about lighthouses, briefly and politely. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Where is the oldest one?"}]

    def cached(salt: str | None) -> int:
        body = {"messages": messages, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = post(inproc, body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("victim") == 0
    own = cached("victim")
    assert own > 20  # the same user's second turn still hits its own entries
    assert cached("attacker") == 0  # an empty scope: nothing at all
    # Nor does a request without a salt see the salted entry: at most the chat template's opening and
    # the random id's first token, which an unsalted entry of another test may share.
    assert cached(None) < 10 < own


def test_two_hundred_idle_sockets_do_not_keep_others_from_being_served(inproc):
    host, port = inproc.url.removeprefix("http://").split(":")
    idle = []
    try:
        for _ in range(200):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            idle.append(sock)
        assert_still_serving(inproc)
    finally:
        for sock in idle:
            sock.close()


def test_a_streaming_client_that_never_reads_holds_no_cells_once_its_answer_is_done(inproc, engine):
    host, port = inproc.url.removeprefix("http://").split(":")
    body = json.dumps(
        {"messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # so the server's writes back up soon
    sock.connect((host, int(port)))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {inproc.token}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        live = wait_for(lambda: engine.stats().live, what="the never-read stream running")
        request = engine.get_request(live[0].id)
        assert_still_serving(inproc)  # another client, meanwhile
        wait_for(lambda: request.is_finished, timeout=300, what="the unread answer to finish")
        assert request.finish_reason == "length"
        stats = wait_for(lambda: (s := engine.stats().scheduler).running == 0 and s, what="no request running")
        assert stats.kv_cells_reserved == stats.prefix_cache_cells  # only the cache holds cells
    finally:
        sock.close()


# -- a server of its own: hostile files in models_dir, SIGTERM ----------------------------------------


def hostile_models_dir(folder, model_path, outside):
    folder.mkdir()
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    name = b"a.b"
    (folder / "huge-array.gguf").write_bytes(
        header + struct.pack("<Q", len(name)) + name + struct.pack("<IIQ", 9, 4, 1 << 60)
    )
    entries = b"".join(
        struct.pack("<Q", len(f"k{i}")) + f"k{i}".encode() + struct.pack("<II", 4, i) for i in range(150_000)
    )
    (folder / "many-entries.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 150_000) + entries)
    with open(model_path, "rb") as fh:
        (folder / "truncated.gguf").write_bytes(fh.read(1 << 20))
    target = outside / "private-name.gguf"
    shutil.copyfile(folder / "huge-array.gguf", target)
    os.symlink(target, folder / "linked.gguf")


def test_hostile_model_files_are_listed_with_errors_in_words_and_sigterm_ends_the_server(tmp_path, model_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = tmp_path / "models"
    hostile_models_dir(folder, model_path, outside)
    server = LocalServer(("--parallel", "2", "--ctx-size", "1024"), token="t", config=f"models_dir: {folder}\n")
    try:
        process = psutil.Process(server.proc.pid)
        before = process.memory_info().rss
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer t"}, timeout=60)
        assert r.status_code == 200, r.text
        listed = {m["id"]: m for m in r.json()["data"]}
        assert "linked" not in listed and "private-name" not in r.text  # a link out of models_dir
        for alias, words in (
            ("huge-array", "more than the"),
            ("truncated", "truncated"),
        ):
            assert words in listed[alias]["error"], listed[alias]
            assert "Traceback" not in listed[alias]["error"] and "IndexError" not in listed[alias]["error"]
        assert "many-entries" in listed  # read in full, or refused by the time limit: either way listed
        assert process.memory_info().rss - before < 200 << 20  # nothing allocated per claimed item
        # a request for the linked model names the alias, never the target
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "linked", "messages": MESSAGES, "max_tokens": 2},
            headers={"Authorization": "Bearer t"},
            timeout=60,
        )
        assert r.status_code in (400, 404) and "private-name" not in r.text and "linked" in r.text
        # SIGTERM while a generation runs: the process ends, within the shutdown deadline plus start-up slack
        threading.Thread(
            target=lambda: httpx.post(
                server.url + "/v1/completions",
                json={"prompt": "Once", "max_tokens": 900, "ignore_eos": True},
                headers={"Authorization": "Bearer t"},
                timeout=60,
            ),
            daemon=True,
        ).start()
        wait_for(lambda: server.proc.poll() is None and process.cpu_percent(0.2) > 0, what="the server busy")
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM did not end the server")
    finally:
        server.stop()


ENUM = ["red", "green", "grey", "greyish", "blue", "", "1", 'a "quoted" one', "ünïcode", 1, None, True]


@pytest.mark.parametrize("seed", range(6))
def test_an_enum_written_as_a_trie_allows_exactly_its_values(inproc, seed):
    """Enums share their prefixes in the grammar (a trie): sampled answers still land on a value, every time."""
    schema = {"type": "object", "properties": {"c": {"enum": ENUM}}, "required": ["c"]}
    body = {
        "messages": [{"role": "user", "content": "Pick a colour."}],
        "max_tokens": 40,
        "temperature": 1.5,
        "seed": seed,
        "response_format": schema_format(schema),
    }
    r = post(inproc, body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert json.loads(content)["c"] in ENUM
