"""The caps on what a client sends, checked without a model: schemas, grammars, GGUF headers, ids.

Each test names the mechanism it needs; without it the input would reach the converter, llama.cpp's
grammar parser or a file walk unbounded.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from magnitude_jupyter.api.errors import ApiError
from magnitude_jupyter.api.tools import openai_tools as parse_tools
from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import schema_limits
from magnitude_jupyter.engine.gbnf_limits import (
    MAX_NESTING,
    MAX_REPETITION,
    GrammarLimitError,
    measure_grammar,
    run_on_grammar_stack,
)
from magnitude_jupyter.engine.grammar import GrammarError, json_grammar
from magnitude_jupyter.engine.schema_limits import SchemaLimitError, check_schema
from magnitude_jupyter.engine.tools import ToolError
from magnitude_jupyter.models.gguf_reader import GGUFError, read_header
from magnitude_jupyter.models.registry import ModelNotFoundError, list_models, resolve_model
from magnitude_jupyter.server.handlers import parse_event_id


def string_schema(**keywords):
    return {"type": "object", "properties": {"s": {"type": "string", **keywords}}, "required": ["s"]}


# -- schemas ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        (string_schema(minLength=10_000_000), "minLength"),
        (string_schema(minLength=5000), "minLength"),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 1_000_000}, "minItems"),
        ({"enum": [f"v{i}" for i in range(100_000)]}, "enum"),
        ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}, "properties"),
        ({"anyOf": [{"type": "string"}] * 100}, "anyOf"),
        (string_schema(pattern="^a{1000000}$"), "pattern"),
        (string_schema(pattern="x" * 5000), "pattern"),
        ({"type": "integer", "maximum": 10**15 + 5}, "maximum"),
    ],
    ids=["minLength-huge", "minLength", "minItems", "enum", "properties", "anyOf", "repeat", "pattern-length", "range"],
)
def test_a_schema_over_a_cap_is_refused_naming_the_keyword_its_value_and_the_cap(schema, keyword):
    with pytest.raises(SchemaLimitError) as caught:
        json_grammar(schema)
    message = str(caught.value)
    assert f"'{keyword}'" in message and "limit" in message, message


def test_the_caps_hold_exactly_at_their_limit():
    json_grammar(string_schema(minLength=schema_limits.MAX_STRING_LENGTH))
    json_grammar({"enum": [f"v{i}" for i in range(schema_limits.MAX_ENUM)]})
    with pytest.raises(SchemaLimitError):
        json_grammar(string_schema(minLength=schema_limits.MAX_STRING_LENGTH + 1))


@pytest.mark.parametrize(
    ("schema", "written"),
    [
        (string_schema(maxLength=10_000_000), "{0,4096}"),  # the schema that crashed the server
        (string_schema(maxLength=524_288), "{0,4096}"),  # what Claude Code sends for a script
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000}, "{0,1023}"),
    ],
)
def test_a_maximum_over_its_cap_is_lowered_to_the_cap_so_every_answer_still_validates(schema, written):
    grammar = json_grammar(schema)
    assert written in grammar
    measure_grammar(grammar)


def test_an_integer_bound_at_javascripts_safe_limit_means_no_bound():
    """zod's int() writes maximum 9007199254740991: clients mean any integer."""
    grammar = json_grammar({"type": "integer", "minimum": 0, "maximum": 2**53 - 1})
    assert "9007199254740991" not in grammar


@pytest.mark.parametrize("pattern", ["(a+)+", "^(ab*)*$", "((x|y)+z)+", "(a{2,})+"])
def test_nested_unbounded_repetition_in_a_pattern_is_refused(pattern):
    with pytest.raises(SchemaLimitError, match="repeats a group"):
        check_schema(string_schema(pattern=pattern))


@pytest.mark.parametrize("pattern", ["^[a-z]+$", "^(ab)+$", "^(a|b){1,3}c*$", r"^\d{3}-\d{4}$", "^([a-z]{2})+$"])
def test_ordinary_patterns_pass(pattern):
    check_schema(string_schema(pattern=pattern))


def test_a_deep_schema_is_refused_without_recursing():
    schema: dict = {"type": "string"}
    for _ in range(10_000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaLimitError, match="nested more than"):
        check_schema(schema)


@pytest.mark.parametrize(
    "ref", ["http://127.0.0.1:9/internal?x=1", "https://example.com/s.json", "file:///etc/passwd", "other.json#/a"]
)
def test_a_reference_outside_the_document_is_refused_before_any_resolver_runs(ref):
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
    with pytest.raises(SchemaLimitError, match="outside the schema"):
        json_grammar(schema)
    with pytest.raises(ToolError, match="outside the schema"):
        parse_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])


def test_an_id_naming_a_location_is_refused_so_local_refs_cannot_be_rebased():
    schema = {"$id": "http://127.0.0.1:9/", "type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}
    with pytest.raises(SchemaLimitError, match="'\\$id'"):
        check_schema(schema)


def test_no_request_makes_a_connection_or_opens_a_file(tmp_path):
    """A listener and a file that a remote or file reference would reach: nothing touches either."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    secret = tmp_path / "secret.json"
    secret.write_text('{"type": "string"}')
    before = secret.stat().st_atime_ns
    for ref in (f"http://127.0.0.1:{port}/internal?x=1", f"file://{secret}", f"http://127.0.0.1:{port}/#/a"):
        schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
        for attempt in (
            lambda s=schema: parse_tools([{"type": "function", "function": {"name": "f", "parameters": s}}]),
            lambda s=schema: json_grammar(s),
        ):
            with pytest.raises((ToolError, GrammarError)):
                attempt()
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()
    assert secret.stat().st_atime_ns == before


def test_local_references_still_work():
    schema = {
        "type": "object",
        "$defs": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "properties": {"from": {"$ref": "#/$defs/city"}, "to": {"$ref": "#/$defs/city"}},
        "required": ["from", "to"],
    }
    assert "Paris" in json_grammar(schema)
    parse_tools([{"type": "function", "function": {"name": "trip", "parameters": schema}}])


def test_too_many_tools_are_refused():
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(schema_limits.MAX_TOOLS + 1)]
    with pytest.raises(ToolError, match="the limit is"):
        parse_tools(tools)


# -- grammars ---------------------------------------------------------------------------------------


def test_string_lengths_become_flat_repetitions_not_nested_groups():
    """llama-cpp-python's converter wrote {0,n} as n nested groups, and llama.cpp's parser recursed once
    per group: this is what overflowed its stack."""
    grammar = json_grammar(string_schema(maxLength=4000))
    assert measure_grammar(grammar).deepest < 8
    assert "{0,4000}" in grammar


def test_arrays_with_bounds_keep_their_separators():
    grammar = json_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5})
    assert 'integer ("," space integer){1,4} "]"' in grammar


@pytest.mark.parametrize(
    ("grammar", "what"),
    [
        ('root ::= "a"{0,10000000}', "repeats an element"),
        ("root ::= " + "(" * (MAX_NESTING + 1) + '"a"' + ")" * (MAX_NESTING + 1), "nests groups"),
        ("root ::= " + " | ".join(f'"{i}"' for i in range(5000)), "alternatives"),
        ("\n".join(f'r{i} ::= "x"{{{MAX_REPETITION}}}' for i in range(300)) + "\nroot ::= r0", "expands to"),
        ('root ::= "a', "unterminated"),
    ],
    ids=["repetition", "nesting", "choices", "expansion", "unterminated"],
)
def test_a_grammar_over_a_cap_is_refused_before_llama_cpp_parses_it(grammar, what):
    with pytest.raises(GrammarLimitError, match=what):
        measure_grammar(grammar)


def test_json_grammars_and_tool_grammars_pass_the_scan():
    from llama_cpp.llama_grammar import JSON_GBNF

    measure_grammar(JSON_GBNF)
    measure_grammar(json_grammar({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}}))


def test_grammar_work_hands_back_its_value_and_its_error():
    assert run_on_grammar_stack(lambda: threading.current_thread().name) == "magnitude-grammar"
    with pytest.raises(ZeroDivisionError):
        run_on_grammar_stack(lambda: 1 // 0)


# -- GGUF headers -----------------------------------------------------------------------------------


def gguf_bytes(metadata: list[bytes], tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, len(metadata)) + b"".join(metadata)


def key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_an_array_that_claims_2_60_items_is_an_error_in_words_at_once(tmp_path):
    path = tmp_path / "huge.gguf"
    path.write_bytes(gguf_bytes([key("a.b") + struct.pack("<IIQ", 9, 4, 1 << 60)]))
    assert path.stat().st_size < 200
    started = time.process_time()
    with pytest.raises(GGUFError, match=r"more than the .* bytes left"):
        read_header(path)
    assert time.process_time() - started < 1.0  # CPU time: nothing was walked or allocated per item


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"NOPE" + b"\0" * 40, "not a GGUF file"),
        (b"GGUF" + struct.pack("<IQQ", 7, 0, 0), "version 7"),
        (gguf_bytes([key("general.name") + struct.pack("<IQ", 8, 100) + b"abc"]), "100 bytes, more than the 3"),
        (gguf_bytes([key("general.name")]), "ends inside the type of 'general.name'"),
        (gguf_bytes([], tensors=1) + key("t") + struct.pack("<I", 9) + b"\0" * 40, "dimensions"),
        (b"GGUF" + struct.pack("<I", 3), "too short"),
    ],
    ids=["magic", "version", "long-string", "truncated", "dims", "short"],
)
def test_a_bad_header_is_an_error_in_words(tmp_path, content, words):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=words):
        read_header(path)


def test_many_metadata_entries_are_read_within_the_time_limit_or_refused(tmp_path):
    entries = [key(f"k{i}") + struct.pack("<II", 4, i) for i in range(150_000)]
    path = tmp_path / "many.gguf"
    path.write_bytes(gguf_bytes(entries))
    try:
        header = read_header(path, seconds=2.0)
    except GGUFError as exc:  # a slow machine: refused by the time limit, not hung
        assert "took over" in str(exc)
    else:
        assert len(header.metadata) == 150_000


def test_the_bundled_model_reads_as_before(model_path):
    from magnitude_jupyter.models.registry import read_model_info

    header = read_header(model_path)
    info = read_model_info(model_path)
    assert info.layers == 30 and info.vocab_size == 49152 and info.has_chat_template
    assert header.array_lengths["tokenizer.ggml.tokens"] == 49152
    assert sum(info.weight_types.values()) > 100_000_000


# -- models_dir links -------------------------------------------------------------------------------


def test_a_link_out_of_models_dir_is_not_served_and_errors_name_the_alias_only(tmp_path, model_path):
    folder, elsewhere = tmp_path / "models", tmp_path / "private"
    folder.mkdir()
    elsewhere.mkdir()
    target = elsewhere / "secret-name.gguf"
    target.write_bytes(b"GGUF")
    os.symlink(target, folder / "linked.gguf")
    os.symlink(model_path, folder / "bundled-link.gguf")
    settings = Settings(models_dir=folder)
    aliases = {e.alias for e in list_models(settings)}
    assert "linked" not in aliases and "bundled-link" not in aliases
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("linked", settings)
    assert "secret-name" not in str(caught.value) and "private" not in str(caught.value)
    assert "models_dir_follow_links" in str(caught.value)
    allowed = Settings(models_dir=folder, models_dir_follow_links=True)
    entries = {e.alias: e for e in list_models(allowed)}
    assert entries["linked"].path == folder.resolve() / "linked.gguf"  # the alias's path, not the target


def test_a_link_inside_models_dir_is_served(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "real.gguf").write_bytes(b"GGUF")
    os.symlink(folder / "real.gguf", folder / "alias.gguf")
    assert {"real", "alias"} <= {e.alias for e in list_models(Settings(models_dir=folder))}


# -- ids and files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["  5", "5 ", "+5", "05", "0x5", "５", "-1", ""])
def test_an_event_id_is_a_plain_decimal_number_and_nothing_else(raw):
    with pytest.raises(ApiError):
        parse_event_id(raw)


def test_event_ids_that_are_plain_numbers_parse():
    assert parse_event_id("0") == 0 and parse_event_id("12") == 12


def test_the_background_server_log_is_owner_only(tmp_path, monkeypatch):
    from magnitude_jupyter.client import http as client_module

    monkeypatch.setenv("MAGNITUDE_RUNTIME_DIR", str(tmp_path))
    log = tmp_path / "serve.log"
    log.write_text("old\n")
    log.chmod(0o644)

    class NoServer(Exception):
        pass

    def refuse(*args, **kwargs):
        raise NoServer

    monkeypatch.setattr(client_module, "LocalServer", refuse)
    with pytest.raises(NoServer):
        client_module.start_background_server()
    assert (log.stat().st_mode & 0o777) == 0o600


def test_a_grammar_field_over_a_cap_is_refused_by_the_parser_of_requests():
    from magnitude_jupyter.api.openai import parse_generation

    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}
    body["response_format"]["json_schema"] = {"name": "x", "schema": string_schema(minLength=10_000_000)}
    with pytest.raises(ApiError) as caught:
        parse_generation(body, "chat")
    assert caught.value.status == 400 and caught.value.param == "response_format"
    assert "'minLength' is 10000000" in caught.value.message


def test_cache_salt_and_user_are_bounded_strings():
    from magnitude_jupyter.api.openai import parse_generation

    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_generation({**base, "cache_salt": "alice"}, "chat").cache_salt == "alice"
    for bad in ("", "x" * 300, 5):
        with pytest.raises(ApiError):
            parse_generation({**base, "cache_salt": bad}, "chat")


def test_magnitude_list_shows_a_bad_file_with_its_error_and_lists_the_rest(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from magnitude_jupyter.cli.main import main

    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "huge.gguf").write_bytes(gguf_bytes([key("a.b") + struct.pack("<IIQ", 9, 4, 1 << 60)]))
    (tmp_path / "config.yaml").write_text(f"models_dir: {folder}\n")
    monkeypatch.setenv("MAGNITUDE_CONFIG", str(tmp_path / "config.yaml"))
    monkeypatch.setenv("MAGNITUDE_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("MAGNITUDE_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(main, ["list", "--show-details"])
    assert result.exit_code == 0, result.output
    assert "cannot read huge" in result.output and "more than the" in result.output
    assert "smollm2-135m" in result.output and "Traceback" not in result.output


def test_enum_values_with_quotes_and_backslashes_become_well_formed_literals():
    """llama-cpp-python's converter did not escape backslashes: a value holding a quote ended its
    GBNF literal early. Each value's JSON text is now one literal, whatever it holds."""
    grammar = json_grammar({"enum": ['a "quoted" one', "back\\slash", "tab\there", "plain"]})
    measure_grammar(grammar)  # no unterminated literal, no stray character
    assert '"a \\\\\\"quoted\\\\\\" one\\""' in grammar
    assert '"back\\\\\\\\slash\\""' in grammar
