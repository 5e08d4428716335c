"""The JSON-Schema-to-grammar bounds, checked against every number near them (no model needed),
and through the real engine: a sampled answer always validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from magnitude_jupyter.engine.gbnf_check import check_grammar_language
from magnitude_jupyter.engine.grammar import json_grammar
from magnitude_jupyter.engine.schema_grammar import (
    grammar_for_schema,
    integer_range,
    number_rule,
)


def as_regex(rule: str) -> re.Pattern[str]:
    """The few GBNF forms these rules use, as a Python regex: literals, classes, groups, {m,n}."""
    pattern = re.sub(r'"([^"]*)"', lambda m: re.escape(m.group(1)), rule)
    return re.compile(pattern.replace(" ", ""))


RANGES = [(0, 9), (1, 7), (5, 123), (-40, 40), (-1250, -3), (17, 17), (0, 1000), (None, 12), (-7, None), (98, None)]


@pytest.mark.parametrize(("lo", "hi"), RANGES)
def test_integer_ranges_match_exactly_the_integers_between_their_bounds(lo, hi):
    regex = as_regex(integer_range(lo, hi))
    for value in range(-3000, 3001):
        inside = (lo is None or value >= lo) and (hi is None or value <= hi)
        assert bool(regex.fullmatch(str(value))) == inside, (lo, hi, value)
    for text in ("007", "-0", "+5", "1.0"):
        assert not regex.fullmatch(text)


def test_bounded_numbers_stay_within_their_bounds():
    regex = as_regex(number_rule({"type": "number", "minimum": 0, "maximum": 1}))
    for text in ("0", "0.5", "0.999", "1", "1.0", "1.000"):
        assert regex.fullmatch(text), text
    for text in ("1.5", "2", "-0.1", "10", "1.01"):
        assert not regex.fullmatch(text), text
    exclusive = as_regex(number_rule({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5.5}))
    assert [v for v in range(-5, 10) if exclusive.fullmatch(str(v))] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "integer", "multipleOf": 5}, "multipleOf"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"x": {"not": {"type": "null"}}}}, "not"),
        ({"type": "number", "minimum": -1.5}, "minimum"),
        ({"type": "number", "exclusiveMaximum": 3}, "exclusiveMaximum"),
    ],
)
def test_keywords_no_grammar_enforces_are_left_to_the_check_after_by_name(schema, keyword):
    held = grammar_for_schema(schema)
    assert any(keyword in words for words in held.unheld), held.unheld
    check_grammar_language(held.grammar)  # the rest is a grammar llama.cpp runs


def test_a_sampled_answer_validates_against_bounds_the_old_converter_dropped(engine):
    from magnitude_jupyter.engine import SamplingParams

    schema = {
        "type": "object",
        "properties": {
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "temperature": {"type": "integer", "minimum": -30, "maximum": 45},
            "chance": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["days", "temperature", "chance"],
    }
    grammar = json_grammar(schema)
    for seed in range(6):
        params = SamplingParams(temperature=1.2, seed=seed, max_tokens=80, grammar=grammar)
        request = engine.submit("A weather forecast as JSON:", params=params)
        request.stream.wait_final(60)
        jsonschema.validate(json.loads(request.output_text), schema)
