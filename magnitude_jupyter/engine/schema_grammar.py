"""JSON Schema to GBNF, so that what the model writes always validates against the schema.

llama-cpp-python's converter handles types, properties, enums, string lengths and patterns, but
drops numeric bounds (`minimum`, `maximum`, ...): a schema asking for 1-7 days got 32. This
converter adds them (integer ranges digit by digit; numbers from a non-negative whole bound). What
no grammar here holds (`propertyNames`, `not`, `if`/`then`, most formats, bounds on a number below 0
or not whole...) it leaves out of the grammar and lists in `unheld`: the answer is checked against
the whole schema once generated (answer_check.py), so a client's schema is never refused for it.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from llama_cpp import llama_grammar
from llama_cpp.llama_grammar import SchemaConverter

from .gbnf_limits import measure_grammar
from .patterns import translate_pattern
from .schema_limits import GrammarError, check_schema, clamped, no_bound

MAX_DIGITS = 15  # as the converter's own integer rule: [1-9] [0-9]{0,15}

# Keywords that constrain a value in ways a grammar built here does not follow: checked afterwards.
UNHELD_KEYWORDS = (
    "multipleOf",
    "uniqueItems",
    "not",
    "minProperties",
    "maxProperties",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "contains",
    "minContains",
    "maxContains",
    "patternProperties",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)


LITERAL_ESCAPE = re.compile(r'[\\"\r\n\t]')
LITERAL_ESCAPES = {"\\": "\\\\", '"': '\\"', "\r": "\\r", "\n": "\\n", "\t": "\\t"}
# Keywords that describe a value without constraining it.
ANNOTATIONS = frozenset(
    {"description", "title", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
)
COMPILE_SECONDS = 2.0  # a schema's conversion stops with an error past this
# String formats llama-cpp-python's converter writes a rule for; any other format is checked afterwards.
HELD_FORMATS = re.compile(r"^(uuid[1-5]?|date|time|date-time)$")


def repetition(
    item: str, low: int, high: int | None, separator_rule: str | None = None, item_rule_is_literal: bool = False
) -> str:
    """GBNF for `low` to `high` (None: no end) of `item`, written as llama.cpp's `{m,n}`.

    llama-cpp-python's converter writes `{0,n}` out as n nested optional groups, and llama.cpp's
    parser recurses once per group: a `maxLength` of 10,000,000 ran its stack out. `{m,n}` stays
    flat in the text, and llama.cpp expands it without recursing (gbnf_limits.py caps n).
    """
    del item_rule_is_literal  # a literal repeats like any other item (the converter's keyword names)
    separator = separator_rule
    if high == 0:
        return ""
    if separator is None:
        if (low, high) == (0, 1):
            return f"{item}?"
        if high is None:
            return f"{item}*" if low == 0 else f"{item}+" if low == 1 else f"{item}{{{low},}}"
        return f"{item}{{{low}}}" if low == high else f"{item}{{{low},{high}}}"
    more_low, more_high = max(0, low - 1), None if high is None else high - 1
    more = f"({separator} {item})"
    if more_high == 0:
        tail = ""
    elif more_high is None:
        tail = f" {more}*" if more_low == 0 else f" {more}{{{more_low},}}"
    elif more_low == more_high:
        tail = f" {more}{{{more_low}}}"
    else:
        tail = f" {more}{{{more_low},{more_high}}}"
    return f"({item}{tail})?" if low == 0 else f"{item}{tail}"


# The converter's own visit and pattern code call this module function by name: pinned
# llama-cpp-python (pyproject.toml), so the swap is tested against the one version we run.
llama_grammar._build_repetition = repetition


def _same_length(a: str, b: str) -> str:
    """GBNF for the digit strings from `a` to `b` (equal lengths, a <= b), leading zeros and all."""
    if a == b:
        return f'"{a}"'
    if len(a) == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return f'"{a[0]}" ({_same_length(a[1:], b[1:])})'
    rest = len(a) - 1
    alternatives = []
    start, end = int(a[0]), int(b[0])
    if a[1:] != "0" * rest:
        alternatives.append(f'"{a[0]}" ({_same_length(a[1:], "9" * rest)})')
        start += 1
    if b[1:] != "9" * rest:
        end -= 1
    if start <= end:
        alternatives.append(f"[{start}-{end}] [0-9]{{{rest}}}")
    if b[1:] != "9" * rest:
        alternatives.append(f'"{b[0]}" ({_same_length("0" * rest, b[1:])})')
    return " | ".join(alternatives)


def _natural_range(lo: int, hi: int | None) -> str:
    """GBNF for the whole numbers from `lo` >= 0 to `hi` (None: no end), without leading zeros."""
    alternatives = []
    shortest = len(str(lo))
    longest = len(str(hi)) if hi is not None else shortest
    for length in range(shortest, longest + 1):
        first = lo if length == shortest else 10 ** (length - 1)
        last = min(hi, 10**length - 1) if hi is not None else 10**length - 1
        if first <= last:
            alternatives.append(_same_length(str(first), str(last)))
    if hi is None and shortest < MAX_DIGITS:
        alternatives.append(f"[1-9] [0-9]{{{shortest},{MAX_DIGITS}}}")
    return " | ".join(f"({a})" for a in alternatives)


def integer_range(lo: int | None, hi: int | None) -> str:
    """GBNF for the integers from `lo` to `hi` (either may be None: no bound)."""
    alternatives = []
    if lo is None or lo < 0:  # the negative part: "-" and a magnitude
        smallest = 1 if hi is None or hi >= 0 else -hi
        largest = None if lo is None else -lo
        if largest is None or smallest <= largest:
            alternatives.append(f'"-" ({_natural_range(smallest, largest)})')
    if hi is None or hi >= 0:
        first = 0 if lo is None else max(0, lo)
        if hi is None or first <= hi:
            alternatives.append(_natural_range(first, hi))
    if not alternatives:
        raise GrammarError(f"no integer lies between {lo} and {hi}")
    return " | ".join(f"({a})" for a in alternatives)


class UnheldBounds(GrammarError):
    """Bounds on a number that the grammar does not hold (the answer is checked against them after)."""


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str, integer: bool) -> int | None:
    value, strict = schema.get(inclusive), schema.get(exclusive)
    value, strict = (None if no_bound(v) else v for v in (value, strict))
    if isinstance(strict, bool):  # draft 4: a flag on the inclusive bound
        value, strict = (None, value) if strict else (value, None)
    for raw in (value, strict):
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, (int, float))):
            raise GrammarError(f"'{inclusive}'/'{exclusive}' must be numbers")
    if not integer:
        if strict is not None:
            raise UnheldBounds(f"'{exclusive}' on a number")
        if value is not None and value != int(value):
            raise UnheldBounds(f"'{inclusive}' {value} on a number (not a whole number)")
        return None if value is None else int(value)
    up = inclusive == "maximum"
    bounds = []
    if value is not None:
        bounds.append(math.floor(value) if up else math.ceil(value))
    if strict is not None:
        bounds.append(math.ceil(strict) - 1 if up else math.floor(strict) + 1)
    if not bounds:
        return None
    return min(bounds) if up else max(bounds)


def number_rule(schema: dict[str, Any]) -> str:
    """GBNF for an integer or number with bounds (numbers: from a whole lower bound >= 0)."""
    integer = schema.get("type") == "integer"
    lo = _bound(schema, "minimum", "exclusiveMinimum", integer)
    hi = _bound(schema, "maximum", "exclusiveMaximum", integer)
    if integer:
        return integer_range(lo, hi)
    if lo is None or lo < 0:
        raise UnheldBounds("bounds on a number without a 'minimum' of 0 or more")
    if hi is not None and hi < lo:
        raise GrammarError(f"no number lies between {lo} and {hi}")
    fraction = f'("." [0-9]{{1,{MAX_DIGITS}}})?'
    alternatives = []
    if hi is None or hi > lo:
        alternatives.append(f"({integer_range(lo, None if hi is None else hi - 1)}) {fraction}")
    if hi is not None:
        alternatives.append(f'"{hi}" ("." "0"{{1,{MAX_DIGITS}}})?')
    return " | ".join(f"({a})" for a in alternatives)


BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class BoundedSchemaConverter(SchemaConverter):
    """llama-cpp-python's converter, with numeric bounds and refusals of what it would ignore."""

    def __init__(self, seconds: float = COMPILE_SECONDS) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self.deadline = time.monotonic() + seconds
        self._branches = 0  # rules made by _trie
        self.unheld: list[str] = []  # what the grammar leaves to the check after generation, in words

    def _format_literal(self, literal: str) -> str:
        """A GBNF string literal of `literal`. The converter escapes quotes and line breaks but not
        backslashes, so the JSON text of a value holding a quote (`\\"`) ended its literal early."""
        return '"' + LITERAL_ESCAPE.sub(lambda m: LITERAL_ESCAPES[m.group(0)], literal) + '"'

    def _visit_pattern(self, pattern: str, name: str) -> str:
        """A pattern's rule, from the pattern rewritten into what the converter reads (patterns.py)."""
        return str(super()._visit_pattern(translate_pattern(pattern), name))

    def visit(self, schema: Any, name: str) -> str:
        if time.monotonic() > self.deadline:
            raise GrammarError("the JSON schema took too long to turn into a grammar; make it smaller")
        if isinstance(schema, dict):
            schema = clamped(schema)
            where = name or "the schema"
            dropped = [keyword for keyword in UNHELD_KEYWORDS if keyword in schema]
            if dropped:
                self.unheld.extend(f"'{keyword}' in {where}" for keyword in dropped)
            kept = {key: value for key, value in schema.items() if key not in UNHELD_KEYWORDS}
            if (schema or dropped) and not (kept.keys() - ANNOTATIONS):  # nothing the grammar holds: any value
                rule = name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root"
                return str(self._add_rule(rule, self._add_primitive("value", llama_grammar.PRIMITIVE_RULES["value"])))
            schema = kept
            form = schema.get("format")
            if isinstance(form, str) and not HELD_FORMATS.match(form) and schema.get("type") in (None, "string"):
                self.unheld.append(f"format '{form[:64]}' in {where}")
            if isinstance(schema.get("enum"), list) and schema["enum"] and "$ref" not in schema:
                texts = sorted({json.dumps(value) for value in schema["enum"]})
                rule = name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root"
                return str(self._add_rule(rule, self._trie(texts, rule)))
            bounded = any(key in schema for key in BOUNDS)
            if bounded and schema.get("type") in ("integer", "number") and not ({"enum", "const"} & schema.keys()):
                try:
                    return str(self._add_rule(name or "root", f"({number_rule(schema)}) space"))
                except UnheldBounds as exc:  # a number whose bounds no grammar here holds: checked after
                    self.unheld.append(f"{exc} in {where}")
                    schema = {key: value for key, value in schema.items() if key not in BOUNDS}
        return str(super().visit(schema, name))

    def _trie(self, texts: list[str], name: str) -> str:
        """GBNF for exactly `texts` (sorted, distinct), their common prefixes written once.

        llama.cpp keeps a parse stack per open alternative and tries every candidate token on each:
        an enum written as N whole alternatives costs N stacks for as long as they share a prefix.
        Branching where the texts differ keeps the open alternatives to the characters that differ.
        Each branching point is a rule of its own, so nothing nests deeper than one group.
        """
        first, last = texts[0], texts[-1]  # sorted: what these share, all share
        shared = 0
        while shared < min(len(first), len(last)) and first[shared] == last[shared]:
            shared += 1
        prefix = first[:shared]
        rests = [text[len(prefix) :] for text in texts]
        head = self._format_literal(prefix) if prefix else ""
        if len(rests) == 1:
            return head
        optional = rests[0] == ""  # sorted: the empty rest comes first
        branches = []
        for _, group in itertools.groupby(rests[1:] if optional else rests, key=lambda rest: rest[0]):
            members = list(group)
            if len(members) == 1:
                branches.append(self._format_literal(members[0]))
            else:
                self._branches += 1
                branches.append(str(self._add_rule(f"{name}-b{self._branches}", self._trie(members, name))))
        choice = f"({' | '.join(branches)}){'?' if optional else ''}"
        return f"{head} {choice}" if head else choice


def schema_rules(converter: BoundedSchemaConverter, schema: dict[str, Any], name: str, url: str) -> str:
    """Add the rules of one schema to `converter`; returns the name of its rule. The schema is
    checked against the caps of schema_limits.py first: nothing resolves a reference outside it."""
    check_schema(schema)
    try:
        resolved = converter.resolve_refs(copy.deepcopy(schema), url)  # it rewrites refs in place
        return converter.visit(resolved, name)
    except GrammarError:
        raise
    except Exception as exc:  # the converter raises whatever its walk of the schema hits
        raise GrammarError(f"the JSON schema cannot be turned into a grammar: {exc}") from None


def without_trailing_space(converter: BoundedSchemaConverter, rule: str) -> None:
    """Drop the optional space the converter puts after a value, where literal text follows it."""
    rules = converter._rules  # the converter's own table: name -> body
    if rules.get(rule, "").endswith(" space"):
        rules[rule] = rules[rule][: -len(" space")]


@dataclass(frozen=True)
class SchemaGrammar:
    """A schema's grammar, and what of the schema it leaves to the check after generation (in words;
    empty: the grammar holds all of it)."""

    grammar: str
    unheld: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None  # the schema it came from

    @property
    def checked_after(self) -> dict[str, Any] | None:
        """The schema the finished answer is checked against: None where the grammar holds all of it."""
        return self.schema if self.unheld else None


def grammar_for_schema(schema: dict[str, Any]) -> SchemaGrammar:
    """GBNF for JSON that follows `schema` as far as a grammar can hold it."""
    converter = BoundedSchemaConverter()
    schema_rules(converter, schema, "", "input")
    grammar = str(converter.format_grammar())
    measure_grammar(grammar)
    return SchemaGrammar(grammar, tuple(converter.unheld), schema)


def schema_grammar(schema: dict[str, Any]) -> str:
    """GBNF for JSON that follows `schema` (what it cannot hold: `grammar_for_schema`)."""
    return grammar_for_schema(schema).grammar
