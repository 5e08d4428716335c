"""What a JSON Schema from a client may ask, checked before anything compiles or resolves it.

A schema becomes a grammar (schema_grammar.py) that llama.cpp parses and then applies to every
sampled token, on the engine's thread. Each cap below bounds one way a schema makes that work
grow: grammar rules per character or item (lengths, counts), alternatives every step tries (enum,
properties, anyOf), the parser's recursion (nesting) and the regular-expression converter's
(patterns). Everything is refused by name: the keyword, where it stands, its value and the cap.
`$ref` resolves only inside the document: nothing a request says makes the server open a file or
a URL. docs/decisions.md gives what each cap costs at its limit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

MAX_STRING_LENGTH = 4096  # minLength / maxLength: llama.cpp builds a grammar rule per character
MAX_ITEMS = 1024  # minItems / maxItems, and prefixItems' length
MAX_ENUM = 256  # enum entries: each is an alternative every step tries
MAX_PROPERTIES = 256  # properties of one object
MAX_ALTERNATIVES = 64  # anyOf / oneOf / allOf entries
MAX_DEPTH = 32  # schemas nested in schemas
MAX_NODES = 4096  # subschemas in one document
# Subschemas counted with every `$ref` expanded to what it names (a reference to the schema's own
# ancestor counts once): the work of the check after generation grows with this, not with the
# document's size, and a chain of definitions that each refer twice to the next doubles it per level.
MAX_EXPANDED_NODES = 16384
MAX_PATTERN_LENGTH = 1000  # characters of one `pattern`
MAX_PATTERN_REPEAT = 4096  # n in a pattern's {n} / {m,n}: written as a flat {m,n} repetition, as lengths are
MAX_INTEGER_DIGITS = 15  # |minimum| / |maximum| below 10**15: ranges are built digit by digit
JS_SAFE_INTEGER = 2**53 - 1  # a bound this large or larger means none (zod's int() writes it)
MAX_TOOLS = 128  # functions in one request's `tools`

# Values that are data, not schemas: never walked for keywords (an enum of objects may hold "maxLength").
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example", "description", "title", "$comment"})
# Keywords whose value maps names to schemas.
SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas", "patternProperties"})
# Lower bounds over their cap are refused; upper bounds over it are lowered to the cap when the
# grammar is written (`clamped`): every answer still validates, and clients' "any length" maxima
# (Claude Code sends maxLength 524,288) are served.
COUNTED = {"minLength": MAX_STRING_LENGTH, "minItems": MAX_ITEMS}
CLAMPED = {"maxLength": MAX_STRING_LENGTH, "maxItems": MAX_ITEMS}
LISTED = {"enum": MAX_ENUM, "anyOf": MAX_ALTERNATIVES, "oneOf": MAX_ALTERNATIVES, "allOf": MAX_ALTERNATIVES}
URL_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//|^\\\\")
# A quantifier: * + {n} {m,} {m,n}.
QUANTIFIER = re.compile(r"\*|\+|\{(\d*)(,(\d*))?\}")


class GrammarError(ValueError):
    """A schema or grammar that cannot become a grammar llama.cpp runs; the message says why."""


class SchemaLimitError(GrammarError):
    """A schema over one of the caps above; the message names the keyword, its value and the cap."""


def _where(path: list[str]) -> str:
    return ".".join(path) if path else "the schema"


def _over(keyword: str, value: Any, cap: int, path: list[str]) -> SchemaLimitError:
    return SchemaLimitError(f"'{keyword}' is {value} (in {_where(path)}); the limit is {cap}")


def check_ref(ref: Any, path: list[str]) -> None:
    """Only references inside the document: '#' or '#/...'."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise SchemaLimitError(
            f"'$ref' {str(ref)[:200]!r} (in {_where(path)}) points outside the schema: "
            "only references inside the document ('#/...') are resolved"
        )


def check_pattern(pattern: Any, path: list[str]) -> None:
    """A regular expression of bounded length, repetition counts and no nested unbounded repetition."""
    if not isinstance(pattern, str):
        raise SchemaLimitError(f"'pattern' (in {_where(path)}) must be a string")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise _over("pattern", f"{len(pattern)} characters long", MAX_PATTERN_LENGTH, path)
    # One pass: a stack of open groups, each remembering whether it holds a repeat without end.
    groups: list[bool] = [False]
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":  # a class: skip to its end
            i += 1
            if i < len(pattern) and pattern[i] == "^":
                i += 1
            if i < len(pattern) and pattern[i] == "]":
                i += 1
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
            unbounded = _repeat_after(pattern, i, path)
            groups[-1] = groups[-1] or unbounded
            continue
        if char == "(":
            groups.append(False)
            i += 1
            continue
        if char == ")":
            inner = groups.pop() if len(groups) > 1 else False
            i += 1
            unbounded = _repeat_after(pattern, i, path)
            if inner and unbounded:
                raise SchemaLimitError(
                    f"'pattern' {pattern[:80]!r} (in {_where(path)}) repeats a group that itself repeats "
                    "without bound (as in (a+)+): its matching can take exponential time; write it without nesting"
                )
            groups[-1] = groups[-1] or inner or unbounded
            continue
        i += 1
        groups[-1] = groups[-1] or _repeat_after(pattern, i, path)


def _repeat_after(pattern: str, at: int, path: list[str]) -> bool:
    """Whether a quantifier at `at` repeats without end (*, +, {m,}); refuses counts over the cap."""
    match = QUANTIFIER.match(pattern, at)
    if match is None:
        return False
    if match.group(0) in ("*", "+"):
        return True
    low, comma, high = match.group(1), match.group(2), match.group(3)
    for count in (low, high):
        if count and int(count) > MAX_PATTERN_REPEAT:
            raise _over("pattern", f"{pattern[:80]!r} with a repeat count of {int(count)}", MAX_PATTERN_REPEAT, path)
    return comma is not None and not high


def no_bound(value: Any) -> bool:
    """A numeric bound at JavaScript's safe-integer limit or past it: what zod writes for 'any
    integer', read as no bound at all."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= JS_SAFE_INTEGER


def _check_number(keyword: str, value: Any, path: list[str]) -> None:
    if no_bound(value):
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= 10**MAX_INTEGER_DIGITS:
        raise _over(keyword, value, 10**MAX_INTEGER_DIGITS, path)


def clamped(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with maxLength / maxItems over their caps lowered to them (a stricter schema)."""
    over = {k: cap for k, cap in CLAMPED.items() if isinstance(schema.get(k), int) and schema[k] > cap}
    return {**schema, **over} if over else schema


def schema_objects(schema: Any, root: list[str] | None = None) -> Iterator[tuple[dict[str, Any], list[str], int]]:
    """Every schema object in a schema, with where it stands and how deep, walked without recursion:
    data keywords' values (`enum`, `const`, ...) are not schemas, and the schemas under `properties`
    and its kind are walked by name, whatever the names are."""
    stack: list[tuple[Any, list[str], int]] = [(schema, root or [], 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, list):
            for i, item in enumerate(node):
                stack.append((item, [*path[:-1], f"{path[-1]}[{i}]"] if path else [f"[{i}]"], depth))
            continue
        if not isinstance(node, dict):
            continue
        yield node, path, depth
        for key, value in node.items():
            if key in DATA_KEYWORDS:
                continue
            if key in SCHEMA_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    stack.append((sub, [*path, key, str(name)[:64]], depth + 1))
            elif isinstance(value, (dict, list)):
                stack.append((value, [*path, key], depth + 1))


def check_schema(schema: Any, where: str = "") -> None:
    """Refuse a schema over any cap, or with a reference outside itself, before anything compiles it.

    Walks without recursion, whatever the nesting; raises SchemaLimitError naming what is wrong.
    """
    root = [where] if where else []
    for nodes, (node, path, depth) in enumerate(schema_objects(schema, root), start=1):
        if nodes > MAX_NODES:
            raise _over("schema", "larger", MAX_NODES, root)
        if depth > MAX_DEPTH:
            raise SchemaLimitError(f"the schema is nested more than {MAX_DEPTH} levels deep (at {_where(path)})")
        _check_node(node, path)
        ref = node.get("$ref")
        if isinstance(ref, str) and resolve_pointer(schema, ref) is None:
            raise SchemaLimitError(f"'$ref' {ref[:200]!r} (in {_where(path)}) names nothing in the schema")
    expanded = expanded_size(schema, MAX_EXPANDED_NODES)
    if expanded > MAX_EXPANDED_NODES:
        raise SchemaLimitError(
            f"the schema expands to more than {MAX_EXPANDED_NODES} subschemas once its '$ref's are followed "
            f"(in {_where(root)}: definitions that each refer to others several times multiply); "
            f"the limit is {MAX_EXPANDED_NODES}"
        )


def _children(node: Any) -> list[Any]:
    """The schemas directly inside a schema object (or a list of them), as `schema_objects` walks them."""
    if isinstance(node, list):
        return [item for item in node if isinstance(item, (dict, list))]
    out: list[Any] = []
    for key, value in node.items():
        if key in DATA_KEYWORDS:
            continue
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out.extend(sub for sub in value.values() if isinstance(sub, (dict, list)))
        elif isinstance(value, (dict, list)):
            out.append(value)
    return out


def resolve_pointer(document: Any, ref: str) -> Any:
    """What a '#/...' reference names in `document`, None when it names nothing."""
    from urllib.parse import unquote

    node = document
    for raw in ref[2:].split("/") if ref.startswith("#/") else []:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def expanded_size(schema: Any, cap: int) -> int:
    """The schema objects in `schema` with each `$ref` counted as the size of what it names; a
    reference back to a schema still being counted (recursion) counts one. Stops counting past
    `cap`. Walks without recursion."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        inside = _children(node)
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            target = resolve_pointer(schema, node["$ref"])
            if isinstance(target, (dict, list)):
                inside.append(target)
        if children_done:
            own = 1 if isinstance(node, dict) else 0
            sizes[key] = min(cap + 1, own + sum(sizes.get(id(child), 1) for child in inside))
            open_.discard(key)
            continue
        if key in sizes or key in open_:
            continue
        open_.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in inside if id(child) not in sizes and id(child) not in open_)
    return sizes.get(id(schema), 1)


def _check_node(node: dict[str, Any], path: list[str]) -> None:
    if "$ref" in node:
        check_ref(node["$ref"], path)
    for key in ("$id", "id"):
        value = node.get(key)
        if isinstance(value, str) and URL_LIKE.search(value):
            raise SchemaLimitError(
                f"'{key}' {value[:200]!r} (in {_where(path)}) names a location: schemas are read "
                "only as they are sent, so drop it"
            )
    for keyword, cap in COUNTED.items():
        value = node.get(keyword)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            raise _over(keyword, value, cap, path)
    for keyword, cap in LISTED.items():
        value = node.get(keyword)
        if isinstance(value, list) and len(value) > cap:
            raise _over(keyword, f"a list of {len(value)}", cap, path)
    for keyword in ("prefixItems", "items"):
        value = node.get(keyword)
        if isinstance(value, list) and len(value) > MAX_ITEMS:
            raise _over(keyword, f"a list of {len(value)}", MAX_ITEMS, path)
    properties = node.get("properties")
    if isinstance(properties, dict) and len(properties) > MAX_PROPERTIES:
        raise _over("properties", f"{len(properties)} properties", MAX_PROPERTIES, path)
    if "pattern" in node:
        check_pattern(node["pattern"], path)
    for keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        _check_number(keyword, node.get(keyword), path)
