"""How much work a GBNF grammar makes llama.cpp do, measured on its text before llama.cpp sees it.

llama.cpp's grammar parser recurses once per nested group, writes `x{m,n}` out as m copies of x
and n - m rules, and its left-recursion check and sampling walk chains of those rules recursively.
A grammar that nests 10 million groups, as a 10,000,000-character `maxLength` once became, runs
the native stack out and kills the process. Every grammar, built from a schema or sent as it is,
passes this scan first: the nesting it may have, the repetition counts, the rules and symbols it
expands to, and the alternatives of one choice are all capped, and threads that run grammar code
get a stack that holds the deepest chain these caps allow (`GRAMMAR_STACK_BYTES`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .schema_limits import GrammarError

MAX_GRAMMAR_BYTES = 512 << 10
MAX_NESTING = 128  # groups inside groups: the parser recurses once per level
MAX_REPETITION = 4096  # m and n of x{m,n}
MAX_RULES = 65_536  # rules once repetitions are written out, groups included
MAX_EXPANDED = 1_000_000  # symbols and rules once repetitions are written out
MAX_CHOICES = 1024  # alternatives of one rule or group
# The deepest recursion the caps allow is about one frame per expanded rule; a few hundred bytes a
# frame, with room to spare.
GRAMMAR_STACK_BYTES = 256 << 20
T = TypeVar("T")


@dataclass
class GrammarSize:
    rules: int = 0
    expanded: int = 0
    deepest: int = 0
    most_choices: int = 0


class GrammarLimitError(GrammarError):
    """A grammar over one of the caps; the message names which."""


@dataclass
class _Group:
    choices: int = 1
    last: int = 0  # symbols of the last element, for a quantifier after it


def _skip_quoted(text: str, i: int, close: str) -> int:
    """The index after the literal or class that opens at `i`."""
    i += 1
    while i < len(text) and text[i] != close:
        i += 2 if text[i] == "\\" else 1
    if i >= len(text):
        kind = "literal" if close == '"' else "class"
        raise GrammarLimitError(f"the grammar has an unterminated {kind}")
    return i + 1


def _count(text: str, at: int) -> tuple[int, int | None, int]:
    """A repetition `{m}`, `{m,}` or `{m,n}` at `at`: (m, n or None for no end, index after it)."""
    end = text.find("}", at)
    if end < 0:
        raise GrammarLimitError("the grammar has an unterminated repetition '{'")
    body = text[at + 1 : end].replace(" ", "")
    low, comma, high = body.partition(",")
    if not low.isdigit() or (high and not high.isdigit()) or len(low) > 9 or len(high) > 9:
        raise GrammarLimitError(f"the grammar has a malformed repetition {{{body[:20]}}}")
    m = int(low)
    n = int(high) if high else (None if comma else m)
    for value in (m, n):
        if value is not None and value > MAX_REPETITION:
            raise GrammarLimitError(f"the grammar repeats an element {value} times; the limit is {MAX_REPETITION}")
    return m, n, end + 1


def measure_grammar(text: str) -> GrammarSize:
    """What `text` expands to in llama.cpp; raises GrammarLimitError past a cap."""
    if len(text.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise GrammarLimitError(f"the grammar is over {MAX_GRAMMAR_BYTES} bytes")
    size = GrammarSize()
    groups: list[_Group] = [_Group()]
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        element = 0
        if char in " \t\r\n":
            i += 1
            continue
        if char == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if text.startswith("::=", i):
            size.rules += 1
            groups = [_Group()]  # a new rule: what came before was its name
            i += 3
            continue
        if char == '"':
            start, i = i, _skip_quoted(text, i, '"')
            element = max(1, i - start - 2)
        elif char == "[":
            start, i = i, _skip_quoted(text, i, "]")
            element = max(1, (i - start) // 2)
        elif char == "<" or text.startswith("!<", i):
            end = text.find(">", i)
            if end < 0:
                raise GrammarLimitError("the grammar has an unterminated token '<'")
            i, element = end + 1, 1
        elif char == "(":
            groups.append(_Group())
            size.rules += 1
            if len(groups) > MAX_NESTING:
                raise GrammarLimitError(f"the grammar nests groups more than {MAX_NESTING} deep")
            size.deepest = max(size.deepest, len(groups) - 1)
            i += 1
            continue
        elif char == ")":
            if len(groups) < 2:
                raise GrammarLimitError("the grammar closes a group it never opened")
            groups.pop()
            i, element = i + 1, 1  # the group becomes a rule, referred to once here
        elif char == "|":
            group = groups[-1]
            group.choices += 1
            size.most_choices = max(size.most_choices, group.choices)
            if group.choices > MAX_CHOICES:
                raise GrammarLimitError(f"the grammar has a choice of more than {MAX_CHOICES} alternatives")
            group.last = 0
            i += 1
            continue
        elif char in "*+?{":
            last = groups[-1].last
            if char == "{":
                m, high, i = _count(text, i)
            else:
                m, high, i = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char] + (i + 1,)
            # m copies in place, then n - m optional rules (or one recursive rule) each holding a copy
            optional = 1 if high is None else high - m
            size.expanded += last * max(0, m - 1) + optional * (last + 2)
            size.rules += optional
            if size.expanded > MAX_EXPANDED or size.rules > MAX_RULES:
                break
            continue
        else:  # a rule name, or `.`
            start = i
            while i < n and (text[i].isalnum() or text[i] in "-_."):
                i += 1
            if i == start:
                raise GrammarLimitError(f"the grammar has an unexpected character {char!r}")
            element = 1
        groups[-1].last = element
        size.expanded += element
    if size.expanded > MAX_EXPANDED:
        raise GrammarLimitError(f"the grammar expands to over {MAX_EXPANDED} symbols; make it smaller")
    if size.rules > MAX_RULES:
        raise GrammarLimitError(f"the grammar has over {MAX_RULES} rules once repetitions are written out")
    return size


_stack_lock = threading.Lock()


def start_with_grammar_stack(thread: threading.Thread) -> None:
    """Start `thread` with a stack that holds llama.cpp's deepest grammar recursion under the caps."""
    with _stack_lock:
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)


def run_on_grammar_stack(function: Callable[[], T]) -> T:
    """Run `function` (native grammar parsing) on a thread with the grammar stack, and wait for it."""
    result: list[T] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            result.append(function())
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=work, name="magnitude-grammar", daemon=True)
    start_with_grammar_stack(thread)
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
