"""The tools of the agent-workflow calibration: a calculator and a lookup table, real Python that a
session's model calls round after round (call, tool result, next call), as agents do."""

from __future__ import annotations

import ast
import operator
from typing import Annotated, Any

from pydantic import Field

OPERATORS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
CITIES = {
    "Lisbon": ("Portugal", 545_000, 1179),
    "Oslo": ("Norway", 709_000, 1040),
    "Nairobi": ("Kenya", 4_397_000, 1899),
    "Lima": ("Peru", 10_092_000, 1535),
    "Hanoi": ("Vietnam", 8_054_000, 1010),
    "Montreal": ("Canada", 1_762_000, 1642),
    "Krakow": ("Poland", 803_000, 1257),
    "Porto Alegre": ("Brazil", 1_332_000, 1772),
    "Osaka": ("Japan", 2_752_000, 645),
    "Tunis": ("Tunisia", 638_000, 698),
    "Adelaide": ("Australia", 1_387_000, 1836),
    "Valparaiso": ("Chile", 296_000, 1536),
    "Tbilisi": ("Georgia", 1_202_000, 479),
    "Dakar": ("Senegal", 1_438_000, 1857),
    "Reykjavik": ("Iceland", 140_000, 874),
    "Kyoto": ("Japan", 1_464_000, 794),
}


# Bounded strings: a small model can ramble inside a string until max_tokens cuts the call short.
def calculator(expression: Annotated[str, Field(max_length=40)]) -> str:
    """Work out an arithmetic expression: numbers, + - * / ** and parentheses.

    Args:
        expression: the expression, for example "545000 + 709000"
    """

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 64:
                raise ValueError("exponents above 64 are refused")
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"only numbers and + - * / ** are allowed, not {ast.dump(node)[:40]}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def lookup(city: Annotated[str, Field(max_length=24)]) -> str:
    """Facts about a city from a small table: its country, population and the year it was founded.

    Args:
        city: the city's name, for example "Lisbon"
    """
    key = next((name for name in CITIES if name.lower() == city.strip().lower()), None)
    if key is None:
        return f"no entry for {city!r}; the table knows: {', '.join(CITIES)}"
    country, population, founded = CITIES[key]
    return f"{key}: country {country}, population {population}, founded {founded}"


TOOLS = (calculator, lookup)


def agent_task(session: int) -> str:
    """The task of one session: different cities for every session, calls needed to answer."""
    names = list(CITIES)
    first, second = names[session % len(names)], names[(session * 7 + 3) % len(names)]
    return (
        f"Task {session + 1}: how many people live in {first} and {second} together? Look up both cities, add the two "
        "populations with the calculator, then answer in one sentence."
    )
