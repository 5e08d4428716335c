"""The third round of hostile input, against the real server: each reproduction an outside probe found,
and the class it belongs to closed (grammars that reach a dead end, references that leave the
schema, GGUF headers whose numbers are absurd, a Responses store without a byte bound, responses
that outlive `store: false` or DELETE).

The real tornado app of `magnitude serve` in this process, in front of the shared real engine.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import struct
import threading
from typing import ClassVar

import httpx
import pytest

from magnitude_jupyter.engine.gbnf_check import GrammarLanguageError, GrammarSyntaxError, check_grammar_language
from magnitude_jupyter.engine.patterns import PatternError, translate_pattern

from .test_untrusted_server import MESSAGES, assert_still_serving, post, schema_format

# -- grammars: the language check, without a model ------------------------------------------------


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        ("root ::= [z-a]", "empty"),
        ("root ::= [^\\x00-\\U0010FFFF]", "matches no character"),
        ('root ::= "a" x\nx ::= "b" x', "never finish"),
        ('root ::= "a" | "b" x\nx ::= "c" x', "rule 'x' can never finish"),
        ('root ::= root "a" | "b"', "left-recursive"),
        ("root ::= y", "never defines it"),
        ('x ::= "a"', "no 'root' rule"),
        ('root ::= "\\q"', "unknown escape"),
        ('root ::= "a"{3,1}', "at most fewer than at least"),
        ("root ::= ( [a-z]", "expects '\\)'"),
    ],
)
def test_a_grammar_with_a_dead_end_or_no_end_is_refused_in_words(grammar, words):
    with pytest.raises((GrammarLanguageError, GrammarSyntaxError), match=words):
        check_grammar_language(grammar)


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= [a-z]+ "!"?',
        'root ::= ("a" | "b")* "c"',
        'root ::= x\nx ::= "(" x ")" | ""',
        'root ::= "ab"{2,5} [^z] .',
        "root ::= [\\x00-\\x7F]{0,4} # a comment\n",
    ],
)
def test_grammars_that_can_finish_pass(grammar):
    check_grammar_language(grammar)


def test_every_grammar_the_engine_writes_itself_passes_the_check():
    from llama_cpp.llama_grammar import JSON_GBNF

    from magnitude_jupyter.engine.schema_grammar import schema_grammar

    check_grammar_language(JSON_GBNF)
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": -5, "maximum": 120},
            "s": {"type": "string", "pattern": "^[A-Z][a-z]+\\.\\d{2}$", "maxLength": 20},
            "e": {"enum": ["red", "green", {"x": 1}]},
            "a": {"type": "array", "items": {"type": "number", "minimum": 0}, "maxItems": 3},
        },
        "required": ["n", "s"],
    }
    check_grammar_language(schema_grammar(schema))


ANY_JSON_CHAR = "[\\x20-\\x21\\x23-\\x5B\\x5D-\\U0010FFFF]"  # what `.` may write inside a JSON string


@pytest.mark.parametrize(
    ("pattern", "translated"),
    [
        ("^\\d{3}$", "^[\\x30-\\x39]{3}$"),
        ("^(\\w+\\s?)+$", "^([\\x30-\\x39\\x41-\\x5A\\x5F\\x61-\\x7A]+[\\x20]?)+$"),
        ("^a\\.b$", "^a[\\x2E]b$"),
        ("^[\\w-]+$", "^[\\x2D\\x30-\\x39\\x41-\\x5A\\x5F\\x61-\\x7A]+$"),
        ("^(?:ab)+$", "^(ab)+$"),
        ("ab", f"^({ANY_JSON_CHAR})*ab({ANY_JSON_CHAR})*$"),
        ('^a"b\\\\$', "^a([\\x5C][\\x22])b([\\x5C][\\x5C])$"),
        ("^[^0-9]$", "^[\\x20-\\x21\\x23-\\x2F\\x3A-\\x5B\\x5D-\\U0010FFFF]$"),
    ],
)
def test_pattern_escapes_become_what_the_grammar_reads_for_a_json_strings_text(pattern, translated):
    """Classes are written out; what JSON escapes is written escaped, or left out of a class."""
    assert translate_pattern(pattern) == translated


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("^[z-a]$", "empty"),
        ("^\\bword$", "word boundary"),
        ("^(a)\\1$", "back-reference"),
        ("^(?=a)a$", "lookaround"),
        ("^\\p{L}$", "Unicode property"),
    ],
)
def test_patterns_a_grammar_cannot_hold_are_refused_by_name(pattern, words):
    with pytest.raises(PatternError, match=words):
        translate_pattern(pattern)


# -- grammars: against the real server --------------------------------------------------------------


@pytest.mark.model
def test_the_grammar_that_aborted_the_server_is_a_400_on_every_api_and_the_server_keeps_serving(inproc):
    r = post(inproc, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "grammar": "root ::= [z-a]"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "grammar" and "empty" in r.json()["error"]["message"]
    bad = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[z-a]$"}}, "required": ["s"]}
    answers = [
        post(inproc, {"messages": MESSAGES, "max_tokens": 8, "response_format": schema_format(bad)}),
        post(inproc, {"messages": MESSAGES, "max_tokens": 8, "tools": [_tool(bad)]}),
        post(
            inproc,
            {
                "input": "x",
                "max_output_tokens": 8,
                "text": {"format": {"type": "json_schema", "name": "a", "schema": bad}},
            },
            "/v1/responses",
        ),
        post(inproc, {"input": "x", "max_output_tokens": 8, "tools": [_responses_tool(bad)]}, "/v1/responses"),
        post(inproc, _messages_body(bad), "/v1/messages"),
    ]
    for r in answers:
        assert r.status_code == 400, r.text
        assert "empty" in json.dumps(r.json()), r.text
    assert_still_serving(inproc)


@pytest.mark.model
def test_a_grammar_that_ends_under_ignore_eos_finishes_the_answer_at_the_grammars_end(inproc):
    """`ignore_eos` bans end-of-generation tokens, but not under a grammar (request.bans_eog): a grammar
    at its end lets only those through, and banning them would leave no token at all. The answer ends
    whole at the grammar's end, greedy or sampled. (The sampler's guard for a grammar that lets
    nothing through is tested on the runner: test_runner.py.)"""
    body = {"messages": MESSAGES, "max_tokens": 16, "grammar": 'root ::= "yes"', "ignore_eos": True}
    r = post(inproc, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "yes" and choice["finish_reason"] == "stop"
    streamed = post(inproc, {**body, "temperature": 1.0, "seed": 3})
    assert streamed.status_code == 200 and streamed.json()["choices"][0]["message"]["content"] == "yes"
    assert_still_serving(inproc)


def _json_schema_format(schema):
    return {"type": "json_schema", "name": "a", "schema": schema}


def _tool(parameters):
    return {"type": "function", "function": {"name": "f", "description": "f", "parameters": parameters}}


def _responses_tool(parameters):
    return {"type": "function", "name": "f", "description": "f", "parameters": parameters}


def _messages_body(schema):
    return {
        "model": "smollm2-135m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "f", "description": "f", "input_schema": schema}],
    }


# -- references: nothing a request says opens a URL or a file --------------------------------------


class _Listener(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        _Listener.hits.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"type": "string"}')

    def log_message(self, *args) -> None:
        pass


def _ref_variants(url: str, path: str) -> list[dict]:
    """A `$ref` to a URL and to a file at every depth and in every slot a schema has, data slots too."""
    variants = []
    for target in (url, f"file://{path}", path, f"{url}#/x"):
        ref = {"$ref": target}
        variants += [
            {"type": "object", "properties": {"a": ref}},
            {"type": "object", "properties": {"a": {"type": "string", "enum": [ref]}}},
            {"type": "object", "properties": {"a": {"const": ref}}},
            {"type": "object", "properties": {"a": {"type": "string", "default": ref}}},
            {"type": "object", "properties": {"a": {"type": "array", "items": {"anyOf": [ref, {"type": "null"}]}}}},
            {"type": "object", "$defs": {"d": ref}, "properties": {"a": {"$ref": "#/$defs/d"}}},
            {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"allOf": [ref]}}}}},
            {"type": "object", "properties": {"a": {"type": "string", "examples": [ref]}}},
        ]
    return variants


@pytest.mark.model
def test_no_schema_slot_makes_the_server_fetch_a_url_or_open_a_file(inproc, tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text('{"type": "string"}')
    before = secret.stat().st_atime_ns
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Listener)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Listener.hits.clear()
    url = f"http://127.0.0.1:{server.server_address[1]}/e1"
    try:
        for schema in _ref_variants(url, str(secret)):
            bodies = [
                ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "tools": [_tool(schema)]}),
                (
                    "/v1/chat/completions",
                    {"messages": MESSAGES, "max_tokens": 2, "response_format": schema_format(schema)},
                ),
                ("/v1/responses", {"input": "x", "max_output_tokens": 2, "tools": [_responses_tool(schema)]}),
                ("/v1/messages", _messages_body(schema)),
                ("/v1/messages/count_tokens", {k: v for k, v in _messages_body(schema).items() if k != "max_tokens"}),
            ]
            for path, body in bodies:
                r = post(inproc, body, path)
                assert r.status_code in (200, 400), (path, schema, r.text)
        assert _Listener.hits == []
        assert secret.stat().st_atime_ns == before
    finally:
        server.shutdown()
    assert_still_serving(inproc)


def test_the_tool_schema_check_fetches_nothing_in_any_slot(tmp_path):
    """In this process, with an audit hook: parsing tools with every reference variant opens no
    socket, no URL and no file."""
    import sys

    from magnitude_jupyter.api.tools import openai_tools as parse_tools
    from magnitude_jupyter.engine.tools import ToolError

    secret = tmp_path / "secret.json"
    secret.write_text('{"type": "string"}')
    variants = _ref_variants("http://127.0.0.1:9/e1", str(secret))
    for schema in variants[:2]:  # warm: every import made before the hook listens
        with contextlib.suppress(ToolError, ValueError):
            parse_tools([_tool(schema)])
    events: list[tuple[str, str]] = []
    listening = [True]

    def hook(event: str, args: tuple) -> None:
        if listening[0] and event in ("open", "socket.connect", "urllib.Request", "socket.getaddrinfo"):
            events.append((event, str(args[0])[:200]))

    sys.addaudithook(hook)
    try:
        for schema in variants:
            with contextlib.suppress(ToolError, ValueError):
                parse_tools([_tool(schema)])
    finally:
        listening[0] = False
    assert [e for e in events if str(secret) in e[1] or e[0] != "open"] == []


# -- GGUF headers: every number bounded --------------------------------------------------------------


def _gguf(metadata: dict, tensors: int = 0) -> bytes:
    out = bytearray(b"GGUF" + struct.pack("<I", 3) + struct.pack("<QQ", tensors, len(metadata)))
    for key, (kind, value) in metadata.items():
        raw = key.encode()
        out += struct.pack("<Q", len(raw)) + raw + struct.pack("<I", kind)
        if kind == 8:
            data = value.encode()
            out += struct.pack("<Q", len(data)) + data
        else:
            out += struct.pack("<" + {4: "I", 10: "Q", 6: "f"}[kind], value)
    return bytes(out)


@pytest.mark.parametrize(
    "block_count",
    [(4, 100_000_000), (10, 2**62), (6, float("inf")), (6, float("nan"))],
)
def test_a_gguf_header_with_an_absurd_number_is_listed_with_its_error(tmp_path, block_count):
    from magnitude_jupyter.models.gguf_reader import GGUFError
    from magnitude_jupyter.models.registry import _read_model_info

    path = tmp_path / "bomb.gguf"
    path.write_bytes(
        _gguf({"general.architecture": (8, "llama"), "llama.block_count": block_count, "llama.context_length": (4, 8)})
    )
    with pytest.raises(GGUFError, match=r"llama\.block_count"):
        _read_model_info(str(path), path.stat().st_mtime_ns)


def test_a_gguf_header_full_of_kept_text_is_refused_within_its_byte_budget(tmp_path):
    from magnitude_jupyter.models.gguf_reader import KEPT_TEXT_BYTES, GGUFError, read_header

    big = "x" * (1 << 20)
    count = KEPT_TEXT_BYTES // len(big) + 2
    path = tmp_path / "text.gguf"
    path.write_bytes(_gguf({f"general.note{i}": (8, big) for i in range(count)}))
    with pytest.raises(GGUFError, match="metadata text"):
        read_header(path)


def test_magnitude_list_names_the_broken_file_and_lists_the_rest(tmp_path, monkeypatch):
    import subprocess
    import sys

    models = tmp_path / "models"
    models.mkdir()
    (models / "bomb.gguf").write_bytes(_gguf({"general.architecture": (8, "llama"), "llama.block_count": (10, 2**62)}))
    config = tmp_path / "config.yaml"
    config.write_text(f"models_dir: {models}\n")
    env = {**__import__("os").environ, "MAGNITUDE_CONFIG": str(config), "MAGNITUDE_CACHE_DIR": str(tmp_path / "c")}
    done = subprocess.run(
        [sys.executable, "-m", "magnitude_jupyter.cli", "list", "--show-details"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "bomb" in done.stdout and "block_count" in done.stdout
    assert "Traceback" not in done.stderr


# -- the Responses store: bounded in bytes, store: false and DELETE honoured ----------------------


@pytest.mark.parametrize(
    "metadata",
    [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, "zzz"],
)
@pytest.mark.model
def test_metadata_beyond_openais_limits_is_a_400(inproc, metadata):
    r = post(inproc, {"input": "x", "max_output_tokens": 2, "metadata": metadata}, "/v1/responses")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "metadata"


@pytest.mark.model
def test_store_and_text_of_the_wrong_type_are_a_400(inproc):
    for field, value in (("store", "no"), ("text", "json")):
        r = post(inproc, {"input": "x", "max_output_tokens": 2, field: value}, "/v1/responses")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field


def test_the_response_store_keeps_within_its_bytes_least_recently_used_out_first():
    from magnitude_jupyter.api.errors import ApiError
    from magnitude_jupyter.api.responses import ResponseStore

    def response(i: int, size: int) -> dict:
        text = "x" * size
        return {"id": f"resp_{i}", "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}

    store = ResponseStore(max_bytes=50_000)
    for i in range(3):
        store.put(response(i, 5_000), [{"role": "user", "content": "q"}])
    store.get("resp_0")  # used: resp_1 is now the least recently used
    for i in range(3, 5):
        store.put(response(i, 5_000), [{"role": "user", "content": "q"}])
    assert store.nbytes <= 50_000
    with pytest.raises(ApiError):
        store.get("resp_1")
    store.get("resp_0")
    assert not store.put(response(9, 60_000), [])  # alone over the limit: not kept


@pytest.mark.model
def test_a_response_not_stored_cannot_be_read_or_streamed_again_once_done(inproc):
    r = post(inproc, {"input": "Say hi.", "max_output_tokens": 4, "store": False}, "/v1/responses")
    assert r.status_code == 200, r.text
    response_id = r.json()["id"]
    for query in ("", "?stream=true"):
        got = httpx.get(f"{inproc.url}/v1/responses/{response_id}{query}", headers=inproc.headers(), timeout=30)
        assert got.status_code == 404, got.text


@pytest.mark.model
def test_a_deleted_response_is_gone_and_a_delete_while_it_runs_cancels_it(inproc):
    r = post(inproc, {"input": "Say hi.", "max_output_tokens": 4}, "/v1/responses")
    response_id = r.json()["id"]
    deleted = httpx.delete(f"{inproc.url}/v1/responses/{response_id}", headers=inproc.headers(), timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    for query in ("", "?stream=true"):
        got = httpx.get(f"{inproc.url}/v1/responses/{response_id}{query}", headers=inproc.headers(), timeout=30)
        assert got.status_code == 404, got.text
    # A long answer, deleted while it is being made: cancelled, and never stored.
    body = {"input": "Count to a thousand.", "max_output_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", inproc.url + "/v1/responses", json=body, headers=inproc.headers(), timeout=120) as s:
        lines = s.iter_lines()
        running_id = None
        for line in lines:
            if line.startswith("data:") and '"response.created"' in line:
                running_id = json.loads(line[5:])["response"]["id"]
                break
        assert running_id is not None
        deleted = httpx.delete(f"{inproc.url}/v1/responses/{running_id}", headers=inproc.headers(), timeout=30)
        assert deleted.status_code == 200, deleted.text
        tail = [line for line in lines if line.startswith("data:")]
    final = json.loads(tail[-1][5:])
    assert final["response"]["status"] == "cancelled"
    got = httpx.get(f"{inproc.url}/v1/responses/{running_id}", headers=inproc.headers(), timeout=30)
    assert got.status_code == 404, got.text
    assert_still_serving(inproc)


# -- the small ones -------------------------------------------------------------------------------


@pytest.mark.model
def test_a_sequence_number_with_leading_zeros_is_a_400(inproc):
    r = post(inproc, {"input": "Say hi.", "max_output_tokens": 2}, "/v1/responses")
    response_id = r.json()["id"]
    for raw in ("007", "-1", "1e3"):
        got = httpx.get(
            f"{inproc.url}/v1/responses/{response_id}?stream=true&starting_after={raw}",
            headers=inproc.headers(),
            timeout=30,
        )
        assert got.status_code == 400, (raw, got.text)
        assert got.json()["error"]["param"] == "starting_after"


@pytest.mark.model
def test_an_anthropic_text_block_without_text_says_so(inproc):
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}
    r = post(inproc, body, "/v1/messages")
    assert r.status_code == 400, r.text
    assert "messages[0].content[0].text must be a string" in r.json()["error"]["message"]


def test_apply_keeps_the_config_files_comments_and_never_writes_through_a_link(tmp_path):
    from magnitude_jupyter.calibrate.apply import applied, write_config

    text = (
        "# my server\ndefault_model: smollm2-135m  # the bundled one\nengine:\n  parallel: 2  # was 2\n  n_batch: 256\n"
    )
    new = applied(text, {"engine": {"parallel": 8, "max_waiting": 16}, "slo": {"e2e_p95_ms": 3000.0}})
    assert "# my server" in new and "# the bundled one" in new and "n_batch: 256" in new
    assert "parallel: 8" in new and "max_waiting: 16" in new and "e2e_p95_ms: 3000.0" in new
    real = tmp_path / "elsewhere.yaml"
    real.write_text(text)
    link = tmp_path / "config.yaml"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="link"):
        write_config(link, new)
    assert real.read_text() == text
    plain = tmp_path / "plain.yaml"
    plain.write_text(text)
    write_config(plain, new)
    assert plain.read_text() == new


# -- cheap requests never stall others ---------------------------------------------------------------


def test_large_bodies_are_worked_on_one_thread_of_their_own_and_dropped_when_their_client_left():
    import asyncio
    import threading as th

    from magnitude_jupyter.server.work import HEAVY_BODY_BYTES, ClientGone, off_loop

    class Handler:
        settings: ClassVar[dict] = {}
        connection_gone = False

    handler = Handler()

    async def run() -> tuple[str, str]:
        small = await off_loop(handler, 100, lambda: th.current_thread().name)
        large = await off_loop(handler, HEAVY_BODY_BYTES + 1, lambda: th.current_thread().name)
        return small, large

    small, large = asyncio.run(run())
    assert large.startswith("magnitude-heavy") and not small.startswith("magnitude-heavy")
    handler.connection_gone = True
    with pytest.raises(ClientGone):
        asyncio.run(off_loop(handler, HEAVY_BODY_BYTES + 1, lambda: "worked"))


@pytest.mark.model
def test_an_embedding_input_of_a_megabyte_is_refused_before_it_is_tokenized(inproc):
    r = post(inproc, {"input": "a" * 1_000_000}, "/v1/embeddings")
    assert r.status_code == 400, r.text
    assert "characters" in r.json()["error"]["message"]
    assert_still_serving(inproc)


@pytest.mark.model
def test_embeddings_stop_when_their_caller_stops_wanting_them(engine):
    import threading as th

    from magnitude_jupyter.engine.runner_api import EmbeddingCancelled

    stop = th.Event()
    stop.set()
    with pytest.raises(EmbeddingCancelled):
        engine.embed([f"text {i}" for i in range(200)], stop)
    vectors, _ = engine.embed(["still here"])
    assert len(vectors) == 1


# -- what changes nothing is accepted ----------------------------------------------------------------


@pytest.mark.model
def test_fields_that_change_nothing_are_accepted_on_every_api(inproc):
    """`store`, OpenAI's dashboard and routing hints, an empty tools list: as llama-server, vLLM and
    Ollama do, accepted and ignored (Pi Agent sends `store` on every request; Claude Code `tools: []`)."""
    ask = {"messages": MESSAGES, "max_tokens": 2}
    for extra in (
        {"store": False},
        {"store": True, "metadata": {"run": "1"}},
        {"service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u1"},
        {"tools": []},
        {"tools": [], "tool_choice": "auto", "parallel_tool_calls": False},
        {"parallel_tool_calls": True},
        {"logit_bias": {}},
        {"modalities": ["text"]},
        {"reasoning_effort": "low"},
        {"prediction": {"type": "content", "content": "Hi"}},
    ):
        r = post(inproc, {**ask, **extra})
        assert r.status_code == 200, (extra, r.text)
    r = post(inproc, {"prompt": "Hi", "max_tokens": 2, "store": False}, "/v1/completions")
    assert r.status_code == 200, r.text
    r = post(inproc, {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], "tools": []}, "/v1/messages")
    assert r.status_code == 200, r.text
    r = post(inproc, {"max_output_tokens": 2, "input": "Hi", "tools": [], "store": False}, "/v1/responses")
    assert r.status_code == 200, r.text
    # What would change the answer and cannot be honoured is still refused by name.
    for extra, param in (
        ({"logit_bias": {"50": 5}}, "logit_bias"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ):
        r = post(inproc, {**ask, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    for extra, param in (
        ({"store": "no"}, "store"),
        ({"metadata": "x"}, "metadata"),
        ({"reasoning_effort": "max"}, "reasoning_effort"),
    ):
        r = post(inproc, {**ask, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


# -- discovery: what agents probe to learn the context window -----------------------------------------


@pytest.mark.model
def test_agents_learn_the_context_window_from_models_and_props(inproc):
    models = httpx.get(inproc.url + "/v1/models", headers=inproc.headers(), timeout=60).json()["data"]
    default = next(m for m in models if m["default"])
    assert isinstance(default["context_length"], int) and default["context_length"] >= 1024
    for path in ("/props", "/v1/props"):
        props = httpx.get(inproc.url + path, headers=inproc.headers(), timeout=60).json()
        assert props["default_generation_settings"]["n_ctx"] == default["context_length"]
        assert props["model_alias"] == default["id"] and props["total_slots"] >= 1
    assert httpx.get(inproc.url + "/props", timeout=30).status_code == 401  # behind the same auth


def test_llama_servers_router_routes_list_load_and_refuse_in_words(inproc):
    """Pi's llama.cpp provider speaks llama-server's router: GET /models with each model's status,
    POST /models/load and /models/unload with {"model": ...}."""
    models = httpx.get(inproc.url + "/models", headers=inproc.headers(), timeout=60).json()["data"]
    default = next(m for m in models if m["default"])
    assert default["status"] == {"value": "loaded"}
    load = httpx.post(inproc.url + "/models/load", json={"model": default["id"]}, headers=inproc.headers(), timeout=60)
    assert load.status_code == 200 and load.json()["success"] is True and load.json()["loaded"] is True
    missing = httpx.post(inproc.url + "/models/load", json={}, headers=inproc.headers(), timeout=60)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    unknown = httpx.post(
        inproc.url + "/models/load", json={"model": "no-such-model"}, headers=inproc.headers(), timeout=60
    )
    assert unknown.status_code == 404
    assert httpx.get(inproc.url + "/models", timeout=30).status_code == 401  # behind the same auth
