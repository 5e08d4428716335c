"""The check after generation: an answer against what its grammar could not hold.

A grammar holds most of JSON Schema (schema_grammar.py); what it cannot (`propertyNames`, `not`,
`if`/`then`, `uniqueItems`, most formats, bounds on a number below 0...) is not refused: the
grammar holds the rest, and the finished answer (the whole JSON answer, or each tool call's
arguments) is validated against the whole schema here. An answer that fails ends with an error in
its API's own shape, its text kept. docs/decisions.md, "Validated after generation".

The schema is a client's: its regular expressions run on RE2, whose matching takes linear time
(Python's `re` backtracks, and `(a|a)*b` on a model's long answer would stall the server), and
`uniqueItems` is checked in one pass, not pairwise. Nothing is fetched: references resolve inside
the schema only (schema_limits.py checks that before, and refuses a schema whose references fan
out past `MAX_EXPANDED_NODES`).

Every check has a budget: each keyword the validator applies is one step, a format or pattern
checked on a string one more per `CHARS_PER_STEP` of it, and a check stops after `MAX_CHECK_STEPS`
steps or `CHECK_DEADLINE_SECONDS` (a backstop for a busy machine), its answer ending with that
reason. The steps also bound the memory the validator's errors take. Formats whose checkers do not
run in linear time (the IRI ones, a parser that backtracks) are checked here through their URI form.
docs/decisions.md, "The check after generation within a budget".
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .schema_limits import GrammarError, schema_objects
from .step_budget import StepBudget, running, within
from .tools import ToolRequest, parse_answer

MAX_ERRORS_READ = 32  # the errors the message is chosen from (the validator yields them lazily)
MESSAGE_CHARS = 300
MAX_CHECK_STEPS = 50_000  # keywords applied in one answer's check, and its strings' length in CHARS_PER_STEP
CHARS_PER_STEP = 64
# Keywords applied inside one another: a schema that refers to itself where the answer goes no deeper
# ({"anyOf": [{"$ref": "#"}]}) would otherwise recurse until Python's own limit.
MAX_CHECK_DEPTH = 128
CHECK_DEADLINE_SECONDS = 10.0


class CheckBudgetError(Exception):
    """A check that went over its budget; the message says which part."""


def _budget() -> StepBudget:
    return StepBudget(MAX_CHECK_STEPS, CHECK_DEADLINE_SECONDS, "checking it", CheckBudgetError)


def _counted(keyword: Any) -> Any:
    """A keyword's function that charges one step each time the validator applies it."""

    def apply(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
        budget = running()
        if budget is None:
            yield from keyword(validator, value, instance, schema) or ()
            return
        budget.charge(1 + (len(instance) // CHARS_PER_STEP if isinstance(instance, str) else 0))
        budget.depth += 1
        try:
            if budget.depth > MAX_CHECK_DEPTH:
                raise CheckBudgetError(
                    f"the schema applies its keywords more than {MAX_CHECK_DEPTH} deep (it refers to itself "
                    "where the answer goes no deeper)"
                )
            yield from keyword(validator, value, instance, schema) or ()
        finally:
            budget.depth -= 1

    return apply


@functools.lru_cache(maxsize=512)
def _regex(pattern: str) -> Any:
    """A pattern compiled by RE2 (linear-time matching); GrammarError when RE2 cannot hold it."""
    import re2

    options = re2.Options()
    options.log_errors = False  # a refused pattern is the client's error, said in the answer, not logged
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise GrammarError(
            f"the pattern {pattern[:80]!r} cannot be checked in linear time ({reason}): back-references "
            "and lookarounds are not supported"
        ) from None


# -- keywords that match regular expressions or compare items, written for RE2 and one pass -------


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not _regex(pattern).search(instance):
        yield ValidationError(f"{instance[:80]!r} does not match {pattern[:80]!r}")


def _pattern_properties(validator: Any, patterns: Mapping[str, Any], instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _regex(pattern).search(key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    named = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [k for k in instance if k not in named and not any(_regex(p).search(k) for p in patterns)]
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif extra is False and extras:
        listed = ", ".join(repr(k[:40]) for k in extras[:5])
        yield ValidationError(f"additional properties are not allowed ({listed})")


def _canonical(value: Any) -> Any:
    """A hashable form in which equal JSON values are equal (1 and 1.0 alike; true is not 1)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, (int, float)):
        return ("number", value)
    if isinstance(value, list):
        return ("array", tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return ("object", frozenset((k, _canonical(v)) for k, v in value.items()))
    return ("other", repr(value))


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for item in instance:
        key = _canonical(item)
        if key in seen:
            yield ValidationError(f"the array has the item {json.dumps(item)[:80]} twice ('uniqueItems')")
            return
        seen.add(key)


_OWN_KEYWORDS = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "uniqueItems": _unique_items,
}


def _as_uri(iri: str) -> str:
    """An IRI's URI form (RFC 3987, 3.1): every character outside ASCII percent-encoded as UTF-8."""
    return "".join(c if ord(c) < 128 else "".join(f"%{b:02X}" for b in c.encode()) for c in iri)


def _through_uri(check: Any) -> Any:
    """A URI format's check, made an IRI format's: the value's URI form checked."""
    return lambda value: check(_as_uri(value)) if isinstance(value, str) else True


def _format_checker(base: Any) -> Any:
    """The validator's format checker, with the IRI formats checked in linear time: their URI form
    against RFC 3986's grammar. (A format's string is charged to the budget with its `format`
    keyword, as every keyword's instance is.)"""
    from jsonschema import FormatChecker

    checker = FormatChecker(())
    checker.checkers.update(base.FORMAT_CHECKER.checkers)
    for iri, uri in (("iri", "uri"), ("iri-reference", "uri-reference")):
        if uri in checker.checkers:
            check, raises = checker.checkers[uri]
            checker.checkers[iri] = (_through_uri(check), raises)
    return checker


def _refuse_retrieval(uri: str) -> Any:
    raise GrammarError(f"'$ref' {uri[:200]!r} points outside the schema")


class SchemaCheck:
    """One JSON Schema, ready to validate values against (its draft as its `$schema` says, 2020-12
    when it says none). Raises GrammarError when the schema itself is not valid or cannot be checked."""

    def __init__(self, schema: dict[str, Any]) -> None:
        # jsonschema is imported only when a schema needs checking: it costs a second to import.
        from jsonschema import Draft202012Validator, validators
        from jsonschema.exceptions import SchemaError
        from referencing import Registry

        keywords: set[str] = set()
        for node, _, _ in schema_objects(schema):  # every pattern compiles on RE2, or is refused now
            keywords.update(node)
            if isinstance(node.get("pattern"), str):
                _regex(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                for pattern in node["patternProperties"]:
                    _regex(pattern)
        if {"unevaluatedProperties", "patternProperties"} <= keywords:  # jsonschema matches these with `re`
            raise GrammarError("'unevaluatedProperties' beside 'patternProperties' cannot be checked here")
        base = validators.validator_for(schema, default=Draft202012Validator)
        try:
            base.check_schema(schema)
        except SchemaError as exc:
            raise GrammarError(f"the JSON schema is not valid: {exc.message[:MESSAGE_CHARS]}") from None
        keywords_counted = {name: _counted(fn) for name, fn in {**base.VALIDATORS, **_OWN_KEYWORDS}.items()}
        own = validators.extend(base, keywords_counted)
        registry: Any = Registry(retrieve=_refuse_retrieval)  # type: ignore[call-arg]
        self._validator = own(schema, registry=registry, format_checker=_format_checker(base))

    def problem(self, value: Any) -> str | None:
        """Why `value` does not follow the schema, in words; None when it does. Within a budget of
        its own (see the module doc): CheckBudgetError when it runs out."""
        from jsonschema.exceptions import best_match

        with within(_budget):
            try:
                error = best_match(itertools.islice(self._validator.iter_errors(value), MAX_ERRORS_READ))
            except RecursionError:
                return "the schema refers to itself without end"
            except GrammarError as exc:
                return str(exc)
        if error is None:
            return None
        return f"{error.message[:MESSAGE_CHARS]} (at {error.json_path})"


@dataclass(frozen=True)
class AnswerCheck:
    """What a request's answer is checked against once generated: the schema of the whole answer
    (`response_format`), or each tool's parameters (by tool name); `unheld` says, in words, what
    the grammar left to this check."""

    answer: SchemaCheck | None = None
    tools: Mapping[str, SchemaCheck] = field(default_factory=dict)
    unheld: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, answer_schema: dict[str, Any] | None, unheld: tuple[str, ...], tools: ToolRequest | None
    ) -> AnswerCheck | None:
        """The check a request needs: None when its grammar holds everything it was asked."""
        checks = {tool.name: SchemaCheck(tool.parameters) for tool in (tools.tools if tools else ()) if tool.unheld}
        words = [*unheld, *(f"{w} of {t.name!r}" for t in (tools.tools if tools else ()) for w in t.unheld)]
        if answer_schema is None and not checks:
            return None
        return cls(SchemaCheck(answer_schema) if answer_schema is not None else None, checks, tuple(words))

    def problem(self, text: str, tool_form: str | None) -> str | None:
        """Why the finished answer `text` fails the check, in words; None when it passes. The whole
        answer, every tool call of it, is checked within one budget."""
        try:
            with within(_budget):
                return self._problem(text, tool_form)
        except CheckBudgetError as exc:
            return self._said(f"the answer could not be checked within its budget: {exc}")

    def _problem(self, text: str, tool_form: str | None) -> str | None:
        if self.answer is not None:
            try:
                value = json.loads(text)
            except ValueError:
                return self._said("the answer is not JSON")
            problem = self.answer.problem(value)
            return self._said(f"the answer does not follow its JSON schema: {problem}") if problem else None
        if tool_form is None:
            return None
        for call in parse_answer(text, tool_form).calls:
            check = self.tools.get(call.name)
            if check is None:
                continue
            try:
                arguments = json.loads(call.arguments)
            except ValueError:
                return self._said(f"the arguments of the call of {call.name!r} are not JSON")
            problem = check.problem(arguments)
            if problem:
                return self._said(f"the arguments of the call of {call.name!r} do not follow its parameters: {problem}")
        return None

    def _said(self, problem: str) -> str:
        held = "; ".join(self.unheld[:4]) + ("; …" if len(self.unheld) > 4 else "")
        return f"{problem} ({held}: checked after generation, as no grammar holds it)"
