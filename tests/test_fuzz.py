"""Generated JSON schemas, tool lists and message histories against the real server (Hypothesis).

A fixed number of examples, derandomized so every run of one version sends the same ones. For each:
the server stays up, every answer is a 200 or a JSON 4xx in OpenAI's shape, and another client's
small request sent meanwhile is answered, before the generated one ends where that one generates.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.model

SMALL = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-0123456789", min_size=1, max_size=12)
sizes = st.one_of(st.integers(0, 8), st.integers(4000, 5000), st.sampled_from([10**7, -1, 2**63]))
patterns = st.sampled_from(
    ["^[a-z]+$", "^(a+)+$", "^a{1000000}$", "[", "^\\d{3}$", "(x|y)*z", "^(ab){2,5}$", "a" * 2000]
)
refs = st.sampled_from(["#/$defs/a", "#/nope", "http://127.0.0.1:9/x", "file:///etc/hostname", "#", "a.json"])
junk = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8))


def leaf_schema() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("string")}, optional={"maxLength": sizes, "minLength": sizes}),
        st.fixed_dictionaries({"type": st.just("string"), "pattern": patterns}),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["integer", "number"])},
            optional={"minimum": st.integers(-(10**20), 10**20), "maximum": st.integers(-(10**20), 10**20)},
        ),
        st.fixed_dictionaries(
            {"enum": st.lists(st.one_of(st.text(max_size=6), st.integers()), min_size=1, max_size=6)}
        ),
        st.fixed_dictionaries({"$ref": refs}),
        st.just({"type": "boolean"}),
        st.dictionaries(st.sampled_from(["type", "maxItems", "anyOf", "not", "$id", "items"]), junk, max_size=3),
    )


schemas = st.recursive(
    leaf_schema(),
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(names, inner, max_size=4)},
            optional={"required": st.lists(names, max_size=3), "$defs": st.fixed_dictionaries({"a": inner})},
        ),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={"maxItems": sizes}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
    ),
    max_leaves=8,
)

object_schemas = st.fixed_dictionaries(
    {"type": st.just("object"), "properties": st.dictionaries(names, schemas, max_size=4)},
    optional={"required": st.lists(names, max_size=2)},
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": names, "parameters": st.one_of(object_schemas, schemas)}),
        }
    ),
    min_size=1,
    max_size=3,
)

contents = st.one_of(
    st.text(max_size=40), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})), junk
)
odd_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "nobody"]), "content": contents}
    ),
    min_size=1,
    max_size=4,
)
plain_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": st.text(min_size=1, max_size=60)}),
    min_size=1,
    max_size=3,
).map(lambda history: [*history, {"role": "user", "content": "Answer in JSON."}])
messages = st.one_of(plain_messages, plain_messages, plain_messages, odd_messages)

bodies = st.one_of(
    st.fixed_dictionaries(
        {
            "messages": messages,
            "response_format": st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries({"name": names, "schema": st.one_of(object_schemas, schemas)}),
                }
            ),
        }
    ),
    st.fixed_dictionaries({"messages": messages, "tools": tools}),
    st.fixed_dictionaries({"messages": messages}, optional={"cache_salt": st.text(max_size=4), "stop": junk}),
)


def post(inproc, body, results: dict[str, Any], key: str) -> None:
    try:
        content = json.dumps(body).encode()  # NaN and Infinity as Python writes them: not JSON, a 400
        headers = {**inproc.headers(), "Content-Type": "application/json"}
        results[key] = httpx.post(inproc.url + "/v1/chat/completions", content=content, headers=headers, timeout=300)
    except Exception as exc:  # recorded, and asserted below
        results[key] = exc
    results[key + "_at"] = time.monotonic()


@settings(
    max_examples=100,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(body=bodies)
def test_generated_requests_never_take_the_server_down_or_hold_others_up(inproc, body):
    body = {**body, "max_tokens": 32, "temperature": 0}
    results: dict[str, Any] = {}
    generated = threading.Thread(target=post, args=(inproc, body, results, "generated"))
    generated.start()
    post(inproc, SMALL, results, "small")
    generated.join(300)
    small, answer = results["small"], results["generated"]
    assert isinstance(small, httpx.Response) and small.status_code == 200, small
    assert isinstance(answer, httpx.Response), answer
    assert answer.status_code == 200 or 400 <= answer.status_code < 500, answer.text
    error = answer.json().get("error")
    if answer.status_code != 200:
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"], answer.text
    elif answer.json()["usage"]["completion_tokens"] >= 16:
        # it generated for a while: the small request, sent as it started, did not wait for its end
        assert results["small_at"] <= results["generated_at"]


# -- grammars and patterns: whatever a client writes, nothing a sampler can reach is a dead end ------

alphabet = st.sampled_from([*list("az09-_ "), "\\x00", "\\x7F", "\\u00E9", "\\U0010FFFF", "\\n", "\\]", "\\\\"])
char_ranges = st.lists(
    st.one_of(alphabet, st.tuples(alphabet, alphabet).map(lambda pair: f"{pair[0]}-{pair[1]}")), min_size=0, max_size=3
)
char_classes = st.tuples(st.booleans(), char_ranges).map(lambda c: "[" + ("^" if c[0] else "") + "".join(c[1]) + "]")
literals = st.one_of(
    st.text(alphabet="ab .{}()|*", min_size=1, max_size=4),  # what grammars hold
    st.text(alphabet='ab{}()|*"\\ .', max_size=4),  # and quotes, backslashes, nothing
).map(lambda t: '"' + t + '"')
rule_names = st.sampled_from(["root", "a", "b", "c"])
quantifiers = st.one_of(
    st.just(""),
    st.just(""),
    st.sampled_from(["*", "+", "?"]),
    st.tuples(st.integers(0, 5), st.integers(0, 5)).map(lambda mn: f"{{{mn[0]},{mn[1]}}}"),
)


def _sequence(items: list[str]) -> str:
    return " ".join(items)


gbnf_items = st.recursive(
    st.one_of(char_classes, literals, rule_names, st.just(".")),
    lambda inner: st.one_of(
        st.tuples(inner, quantifiers).map("".join),
        st.lists(st.lists(inner, min_size=1, max_size=3).map(_sequence), min_size=1, max_size=3).map(
            lambda alternatives: "(" + " | ".join(alternatives) + ")"
        ),
    ),
    max_leaves=6,
)
gbnf_rules = st.tuples(rule_names, st.lists(st.lists(gbnf_items, min_size=1, max_size=3), min_size=1, max_size=3)).map(
    lambda rule: f"{rule[0]} ::= " + " | ".join(_sequence(alt) for alt in rule[1])
)
wild_grammars = st.lists(gbnf_rules, min_size=1, max_size=4).map("\n".join)
# Grammars made only of parts llama.cpp accepts, so that most reach the sampler.
sound_items = st.recursive(
    st.one_of(
        st.sampled_from(["[a-z]", "[^a]", "[0-9]", "[ -~]", "[\\u00E0-\\u00FF]", ".", "[\\x00-\\x1F]"]),
        st.text(alphabet="ab xy{}", min_size=1, max_size=4).map(lambda t: '"' + t + '"'),
    ),
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["", "?", "{1,3}", "*", "+", "{2}"])).map("".join),
        st.lists(inner, min_size=1, max_size=3).map(lambda items: "(" + " | ".join(items) + ")"),
    ),
    max_leaves=5,
)
sound_grammars = st.lists(st.lists(sound_items, min_size=1, max_size=3).map(_sequence), min_size=1, max_size=3).map(
    lambda alternatives: "root ::= " + " | ".join(alternatives)
)
grammars = st.one_of(sound_grammars, wild_grammars)

regex_parts = st.sampled_from(
    [
        "a",
        "z",
        ".",
        "\\d",
        "\\w",
        "\\s",
        "\\D",
        "\\.",
        "\\b",
        "[a-z]",
        "[z-a]",
        "[\\w-]",
        "[^0-9]",
        "(?:ab)",
        "(a|b)",
        "\\1",
        "(?=a)",
        "x{2,3}",
        "x{3,2}",
        "+",
        "*",
        "?",
        "$",
        "^",
        "[",
        ")",
    ]
)
regexes = (
    st.lists(regex_parts, min_size=1, max_size=6)
    .map("".join)
    .map(lambda body: st.sampled_from([body, f"^{body}$", f"^{body}", f"{body}$"]))
    .flatmap(lambda choice: choice)
)


@pytest.fixture(scope="module")
def vocab(model_path):
    """The bundled model's vocabulary alone: what llama.cpp's grammar parser needs."""
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), params)
    yield llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


@settings(
    max_examples=800,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(grammar=grammars, pattern=regexes)
def test_every_grammar_the_checks_pass_llama_cpp_parses(vocab, grammar, pattern):
    """The language check (gbnf_check.py) is a model of llama.cpp's parser: what it passes, llama.cpp
    must parse, raw or written from a pattern, or the model is wrong somewhere a client can find."""
    import llama_cpp

    from magnitude_jupyter.engine.gbnf_check import check_grammar_language
    from magnitude_jupyter.engine.gbnf_limits import measure_grammar
    from magnitude_jupyter.engine.schema_grammar import schema_grammar
    from magnitude_jupyter.engine.schema_limits import GrammarError

    for text in (grammar, None):
        try:
            text = text if text is not None else schema_grammar({"type": "string", "pattern": pattern})
            measure_grammar(text)
            check_grammar_language(text)
        except GrammarError:
            continue
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode(), b"root")
        assert sampler, text
        llama_cpp.llama_sampler_free(sampler)


def _answered_or_refused(inproc, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(inproc.url + "/v1/chat/completions", json=body, headers=inproc.headers(), timeout=300)
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
    if r.status_code != 200:
        assert r.json()["error"]["message"], r.text
    small = httpx.post(inproc.url + "/v1/chat/completions", json=SMALL, headers=inproc.headers(), timeout=300)
    assert small.status_code == 200, small.text
    return r


@settings(
    max_examples=80,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(grammar=grammars, sampled=st.booleans())
def test_generated_grammars_never_take_the_server_down(inproc, grammar, sampled):
    body = {"messages": SMALL["messages"], "max_tokens": 6, "grammar": grammar}
    body |= {"temperature": 1.0, "seed": 7} if sampled else {"temperature": 0}
    _answered_or_refused(inproc, body)


@settings(
    max_examples=100,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(pattern=regexes)
def test_generated_patterns_never_take_the_server_down(inproc, pattern):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    body = {
        "messages": SMALL["messages"],
        "max_tokens": 12,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    }
    r = _answered_or_refused(inproc, body)
    if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop":
        # A whole answer is JSON whose string matches the pattern (where Python reads the pattern alike).
        value = json.loads(r.json()["choices"][0]["message"]["content"])["s"]
        try:
            compiled = re.compile(pattern)
        except re.error:
            return
        assert compiled.search(value), (pattern, value)


# -- GGUF headers: whatever a file says, it is read or refused in words, within bounds ---------------

_GGUF_TYPES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
gguf_keys = st.sampled_from(
    [
        "general.architecture",
        "llama.block_count",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.embedding_length",
        "llama.attention.key_length",
        "llama.context_length",
        "llama.attention.sliding_window",
        "llama.attention.sliding_window_pattern",
        "llama.vocab_size",
        "general.file_type",
        "tokenizer.chat_template",
        "tokenizer.ggml.tokens",
    ]
)
gguf_numbers = st.one_of(
    st.integers(0, 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True, width=32), st.booleans()
)


def _encode_value(kind: int, value: Any) -> bytes | None:
    import struct

    code = _GGUF_TYPES[kind]
    try:
        return struct.pack("<I", kind) + struct.pack("<" + code, value)
    except (struct.error, OverflowError, TypeError):
        return None


@st.composite
def gguf_files(draw: Any) -> bytes:
    import struct

    entries = []
    for _ in range(draw(st.integers(0, 8))):
        key = draw(gguf_keys).encode()
        choice = draw(st.integers(0, 3))
        if choice == 0:  # a string
            text = draw(st.sampled_from(["llama", "gemma3", "", "x" * 3000])).encode()
            value = struct.pack("<I", 8) + struct.pack("<Q", len(text)) + text
        elif choice == 1:  # an array of numbers, its length told truly or not
            kind = draw(st.sampled_from([4, 5, 6, 10]))
            items = draw(st.lists(st.integers(0, 1000), max_size=6))
            told = draw(st.one_of(st.just(len(items)), st.integers(0, 2**63)))
            body = b"".join(struct.pack("<" + _GGUF_TYPES[kind], i) for i in items)
            value = struct.pack("<I", 9) + struct.pack("<I", kind) + struct.pack("<Q", told) + body
        else:  # a number of any type
            kind = draw(st.sampled_from(sorted(_GGUF_TYPES)))
            value = _encode_value(kind, draw(gguf_numbers)) or _encode_value(4, 1)
        entries.append(struct.pack("<Q", len(key)) + key + value)
    n_tensors = draw(st.one_of(st.just(0), st.integers(0, 2**63)))
    n_entries = draw(st.one_of(st.just(len(entries)), st.integers(0, 2**64 - 1)))
    return (
        b"GGUF"
        + struct.pack("<I", draw(st.sampled_from([3, 2, 7])))
        + struct.pack("<QQ", n_tensors, n_entries)
        + b"".join(entries)
    )


@settings(max_examples=400, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=gguf_files())
def test_generated_gguf_headers_are_read_or_refused_in_words(tmp_path, data):
    from magnitude_jupyter.models.gguf_reader import GGUFError
    from magnitude_jupyter.models.registry import _read_model_info

    path = tmp_path / "fuzzed.gguf"
    path.write_bytes(data)
    try:
        info = _read_model_info.__wrapped__(str(path), path.stat().st_mtime_ns)  # uncached: every example read
    except GGUFError as exc:
        assert str(exc)
        return
    assert 0 <= info.layers <= 512 and len(info.windowed_layers) <= 512 and len(info.kv_heads_per_layer) <= 512


# -- references: wherever a generated schema puts one, nothing is fetched ------------------------------


def _ref_schemas(url: str) -> st.SearchStrategy[dict[str, Any]]:
    ref = st.sampled_from([url, url + "#/a", "file:///etc/hostname", "/etc/hostname", "#/$defs/a", "#"]).map(
        lambda target: {"$ref": target}
    )
    slots = st.one_of(
        ref,
        st.fixed_dictionaries({"type": st.just("string"), "enum": st.lists(ref, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"const": ref}),
        st.fixed_dictionaries({"type": st.just("string"), "default": ref}),
        st.fixed_dictionaries({"type": st.just("string"), "examples": st.lists(ref, max_size=2)}),
    )
    return st.recursive(
        slots,
        lambda inner: st.one_of(
            st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(names, inner, max_size=3)}),
            st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
            st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=2)}),
            st.fixed_dictionaries({"type": st.just("object"), "$defs": st.fixed_dictionaries({"a": inner})}),
        ),
        max_leaves=6,
    )


class _Listener:
    """A loopback HTTP server that counts every request it gets."""

    def __init__(self) -> None:
        import http.server

        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"type": "string"}')

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/schema"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


LISTENER = _Listener()


@settings(
    max_examples=60,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=_ref_schemas(LISTENER.url), where=st.sampled_from(["tools", "response_format", "messages_api"]))
def test_generated_references_anywhere_fetch_nothing(inproc, schema, where):
    parameters = {"type": "object", "properties": {"x": schema}}
    if where == "tools":
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        path, body = "/v1/chat/completions", {"messages": SMALL["messages"], "max_tokens": 2, "tools": [tool]}
    elif where == "response_format":
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": parameters}}
        path, body = "/v1/chat/completions", {"messages": SMALL["messages"], "max_tokens": 2, "response_format": fmt}
    else:
        tool = {"name": "f", "description": "f", "input_schema": parameters}
        path, body = "/v1/messages", {"max_tokens": 2, "messages": SMALL["messages"], "tools": [tool]}
    r = httpx.post(inproc.url + path, json=body, headers=inproc.headers(), timeout=120)
    assert r.status_code in (200, 400), r.text
    assert LISTENER.hits == []
