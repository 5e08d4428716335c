"""What a GBNF grammar can write, checked before llama.cpp's sampler ever runs it.

llama.cpp keeps a set of parse stacks and, each step, lets through the tokens some stack accepts.
When no token is accepted (an empty character class such as `[z-a]`, or a rule that never ends),
its sampler is handed a candidate list of nothing but -inf, picks one anyway, and its grammar then
throws "Unexpected empty grammar stack" across the C API: the process aborts, taking every stream
with it. This module parses a grammar the way llama.cpp's parser does (llama-grammar.cpp) and
refuses, in words:

- syntax llama.cpp would refuse (so the client reads which character is wrong);
- rules that are referred to and never defined;
- character classes that match no character;
- left recursion, which llama.cpp's own check refuses with no reason given;
- a `root`, or any rule reachable from it, that can never finish: the productive-nonterminal check
  of a context-free grammar (a rule is productive when one of its alternatives is made only of
  productive parts; a repetition that may be empty always is).

The sampler keeps its own guard for what depends on the model's vocabulary (sampling.py): these
checks make the common mistakes an error message instead of a dead end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .schema_limits import GrammarError

MAX_CODE_POINT = 0x10FFFF
ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


class GrammarSyntaxError(GrammarError):
    """A grammar llama.cpp's parser would refuse; the message says where."""


class GrammarLanguageError(GrammarError):
    """A grammar that parses but can reach a point where nothing may follow, or can never end."""


@dataclass
class Chars:
    """A character class (or a literal's one character): ranges of code points, maybe negated."""

    ranges: list[tuple[int, int]]
    negated: bool = False
    text: str = ""

    def matches_something(self) -> bool:
        valid = sorted((lo, hi) for lo, hi in self.ranges if lo <= hi)
        if not self.negated:
            return bool(valid)
        covered = 0  # code points 0..covered-1 are excluded
        for lo, hi in valid:
            if lo > covered:
                return True
            covered = max(covered, hi + 1)
        return covered <= MAX_CODE_POINT


@dataclass
class Ref:
    name: str


@dataclass
class Token:
    """`<...>` or `!<...>`: one token of the vocabulary (or any but it); llama.cpp checks the vocabulary."""

    text: str


@dataclass
class Literal:
    """A literal of several characters (or none): a quantifier after it repeats it whole."""

    items: list[Chars]
    text: str


@dataclass
class Repeat:
    item: Element
    low: int
    high: int | None  # None: without end


Element = Chars | Ref | Token | Literal | Repeat


@dataclass
class Grammar:
    rules: dict[str, list[list[Element]]] = field(default_factory=dict)
    referenced: dict[str, int] = field(default_factory=dict)  # name -> where first referred to
    generated: int = 0


def _word(char: str) -> bool:
    return char.isascii() and (char.isalnum() or char == "-")


class _Parser:
    """llama.cpp's recursive-descent GBNF parser, in Python (nesting is capped by gbnf_limits first)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0
        self.grammar = Grammar()

    def fail(self, what: str) -> GrammarSyntaxError:
        near = self.text[self.at : self.at + 30].replace("\n", "\\n")
        return GrammarSyntaxError(f"the grammar {what} at character {self.at} (near {near!r})")

    def peek(self, offset: int = 0) -> str:
        i = self.at + offset
        return self.text[i] if i < len(self.text) else ""

    def space(self, newline_ok: bool) -> None:
        while True:
            char = self.peek()
            if char in (" ", "\t") or (newline_ok and char in ("\r", "\n")):
                self.at += 1
            elif char == "#":
                while self.peek() not in ("", "\r", "\n"):
                    self.at += 1
            else:
                return

    def name(self) -> str:
        start = self.at
        while _word(self.peek()):
            self.at += 1
        if self.at == start:
            raise self.fail("expects a rule name")
        return self.text[start : self.at]

    def char(self) -> int:
        char = self.peek()
        if char == "":
            raise self.fail("ends unexpectedly")
        if char != "\\":
            self.at += 1
            return ord(char)
        kind = self.peek(1)
        if kind in HEX_DIGITS:
            size = HEX_DIGITS[kind]
            digits = self.text[self.at + 2 : self.at + 2 + size]
            if len(digits) != size or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"expects {size} hex digits after \\{kind}")
            self.at += 2 + size
            return int(digits, 16)
        if kind in ESCAPES:
            self.at += 2
            return ord(ESCAPES[kind])
        raise self.fail(f"has an unknown escape \\{kind}")

    def parse(self) -> Grammar:
        self.space(True)
        while self.peek():
            self.rule()
        return self.grammar

    def rule(self) -> None:
        name = self.name()
        self.space(False)
        if not self.text.startswith("::=", self.at):
            raise self.fail(f"expects '::=' after the rule name {name!r}")
        self.at += 3
        self.space(True)
        self.grammar.rules[name] = self.alternates(nested=False)
        if self.peek() == "\r":
            self.at += 2 if self.peek(1) == "\n" else 1
        elif self.peek() == "\n":
            self.at += 1
        elif self.peek():
            raise self.fail("expects a new line or the end")
        self.space(True)

    def alternates(self, nested: bool) -> list[list[Element]]:
        alternatives = [self.sequence(nested)]
        while self.peek() == "|":
            self.at += 1
            self.space(True)
            alternatives.append(self.sequence(nested))
        return alternatives

    def sequence(self, nested: bool) -> list[Element]:
        out: list[Element] = []
        last_is_item = False  # a quantifier needs something before it, as llama.cpp's `last_sym_start`
        while (char := self.peek()) != "":
            if char == '"':
                start = self.at
                self.at += 1
                literal: list[Chars] = []
                while self.peek() != '"':
                    if self.peek() == "":
                        raise self.fail("has an unterminated literal")
                    code = self.char()
                    literal.append(Chars([(code, code)]))
                self.at += 1
                # A quantifier applies to the whole literal, as llama.cpp's rewrite does.
                out.append(Literal(literal, self.text[start : self.at]))
                last_is_item = bool(literal)
            elif char == "[":
                out.append(self.char_class())
                last_is_item = True
            elif char in "<!":
                start = self.at
                self.at += 1 if char == "<" else 2
                if char == "!" and self.text[self.at - 1] != "<":
                    raise self.fail("expects '<' after '!'")
                end = self.text.find(">", self.at)
                if end < 0:
                    raise self.fail("has an unterminated token '<'")
                self.at = end + 1
                out.append(Token(self.text[start : self.at]))
                last_is_item = True
            elif _word(char):
                where = self.at
                name = self.name()
                self.grammar.referenced.setdefault(name, where)
                out.append(Ref(name))
                last_is_item = True
            elif char == "(":
                self.at += 1
                self.space(True)
                self.grammar.generated += 1
                sub = f"({self.grammar.generated}"  # a name no rule can have
                self.grammar.rules[sub] = self.alternates(nested=True)
                if self.peek() != ")":
                    raise self.fail("expects ')'")
                self.at += 1
                out.append(Ref(sub))
                last_is_item = True
            elif char == ".":
                self.at += 1
                out.append(Chars([(0, MAX_CODE_POINT)], text="."))
                last_is_item = True
            elif char in "*+?{":
                if not last_is_item:
                    raise self.fail(f"has {char!r} with nothing before it to repeat")
                low, high = self.quantifier()
                out[-1] = Repeat(out[-1], low, high)
                # llama.cpp lets a quantifier follow a quantifier (it repeats the rewritten item)
            else:
                break
            self.space(nested)
        return out

    def quantifier(self) -> tuple[int, int | None]:
        char = self.peek()
        self.at += 1
        if char != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        self.space(True)
        low = self.integer()
        self.space(True)
        if self.peek() == "}":
            self.at += 1
            return low, low
        if self.peek() != ",":
            raise self.fail("expects ',' or '}' in a repetition")
        self.at += 1
        self.space(True)
        high = self.integer() if self.peek().isdigit() else None
        self.space(True)
        if self.peek() != "}":
            raise self.fail("expects '}' to end a repetition")
        self.at += 1
        if high is not None and high < low:
            raise GrammarLanguageError(f"the grammar repeats an element {{{low},{high}}}: at most fewer than at least")
        return low, high

    def integer(self) -> int:
        start = self.at
        while self.peek().isascii() and self.peek().isdigit():
            self.at += 1
        if self.at == start:
            raise self.fail("expects a whole number in a repetition")
        return int(self.text[start : self.at])

    def char_class(self) -> Chars:
        start = self.at
        self.at += 1
        negated = self.peek() == "^"
        if negated:
            self.at += 1
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            if self.peek() == "":
                raise self.fail("has an unterminated character class")
            low = self.char()
            high = low
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.at += 1
                high = self.char()
            elif self.peek() == "-" and self.peek(1) == "":
                raise self.fail("ends inside a character class")
            ranges.append((low, high))
        self.at += 1
        text = self.text[start : self.at]
        if not ranges:  # llama.cpp reads `[]` and `[^]` as nothing at all, not as a class
            raise GrammarSyntaxError(f"the grammar has an empty character class {text} at character {start}")
        for low, high in ranges:
            if low > high:
                raise GrammarLanguageError(
                    f"the grammar's character class {text[:60]} has the range {chr(low)!r}-{chr(high)!r}, "
                    f"which is empty ({chr(low)!r} comes after {chr(high)!r}): write it {chr(high)!r}-{chr(low)!r}"
                )
        chars = Chars(ranges, negated, text)
        if not chars.matches_something():
            raise GrammarLanguageError(f"the grammar's character class {text[:60]} matches no character")
        return chars


def _productive(element: Element, known: set[str]) -> bool:
    if isinstance(element, Repeat):
        return element.low == 0 or _productive(element.item, known)
    if isinstance(element, Ref):
        return element.name in known
    if isinstance(element, Literal):
        return all(_productive(item, known) for item in element.items)
    return True  # a class that matches something (checked while parsing), or a token


def _first_refs(alternative: list[Element], nullable: set[str]) -> list[str]:
    """The rules an alternative can begin with (its leading parts that may be empty, and the next)."""
    out: list[str] = []
    for element in alternative:
        inner = element
        optional = False
        while isinstance(inner, Repeat):
            optional = optional or inner.low == 0
            inner = inner.item
        if isinstance(inner, Ref):
            out.append(inner.name)
            if not (optional or inner.name in nullable):
                return out
        elif not optional and not (isinstance(inner, Literal) and not inner.items):
            return out
    return out


def _can_be_empty(element: Element, nullable: set[str]) -> bool:
    if isinstance(element, Repeat):
        return element.low == 0 or _can_be_empty(element.item, nullable)
    if isinstance(element, Ref):
        return element.name in nullable
    if isinstance(element, Literal):
        return not element.items
    return False


def _rules_where(grammar: Grammar, part_holds: Callable[[Element, set[str]], bool]) -> set[str]:
    """The least set of rules with an alternative whose every part holds, given the rules found so
    far (a fixpoint): the rules that can be empty, or that can finish."""
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in grammar.rules.items():
            if name not in found and any(all(part_holds(e, found) for e in alt) for alt in alternatives):
                found.add(name)
                changed = True
    return found


def _nullable(grammar: Grammar) -> set[str]:
    return _rules_where(grammar, _can_be_empty)


def _shown(name: str) -> str:
    return "a group ( ... )" if name.startswith("(") else f"rule {name!r}"


def check_grammar_language(text: str, root: str = "root") -> None:
    """Refuse a grammar llama.cpp cannot parse, or whose sampling can reach a dead end; the
    message says which rule or class, in words. `text` has passed gbnf_limits.measure_grammar."""
    grammar = _Parser(text).parse()
    rules = grammar.rules
    for name, where in grammar.referenced.items():
        if name not in rules:
            raise GrammarSyntaxError(f"the grammar refers to rule {name!r} (at character {where}) but never defines it")
    if root not in rules:
        raise GrammarSyntaxError(f"the grammar has no {root!r} rule: generation starts there")
    productive = _rules_where(grammar, _productive)  # the rules that can finish (derive a finite string)
    reachable: list[str] = [root]
    seen = {root}
    while reachable:
        name = reachable.pop()
        for alternative in rules[name]:
            stack: list[Element] = list(alternative)
            while stack:
                element = stack.pop()
                if isinstance(element, Repeat):
                    stack.append(element.item)
                elif isinstance(element, Literal):
                    stack.extend(element.items)
                elif isinstance(element, Ref) and element.name not in seen:
                    seen.add(element.name)
                    reachable.append(element.name)
    if root not in productive:
        raise GrammarLanguageError(
            f"the grammar's {root!r} rule can never finish: every way through it goes on forever "
            "(each alternative refers to a rule that never ends)"
        )
    stuck = sorted(name for name in seen if name not in productive)
    if stuck:
        raise GrammarLanguageError(
            f"the grammar's {_shown(stuck[0])} can never finish (every alternative refers to itself, or to a rule "
            "that never ends): an answer that enters it could not end"
        )
    _check_left_recursion(grammar, set(rules))


def _check_left_recursion(grammar: Grammar, rules: set[str]) -> None:
    """llama.cpp refuses a rule that can begin with itself, reachable or not; say which. It writes
    `x*` as `x' ::= x x' |`: where x may be empty, x' begins with itself too."""
    nullable = _nullable(grammar)
    for name in sorted(rules):
        stack: list[Element] = [e for alternative in grammar.rules[name] for e in alternative]
        while stack:
            element = stack.pop()
            if isinstance(element, Repeat):
                if element.high is None and _can_be_empty(element.item, nullable):
                    raise GrammarLanguageError(
                        f"the grammar's {_shown(name)} repeats without end something that can be empty "
                        "(as in (x?)* or x** ), which llama.cpp cannot run: make the repeated part non-empty"
                    )
                stack.append(element.item)
    begins = {name: {ref for alt in grammar.rules[name] for ref in _first_refs(alt, nullable)} for name in rules}
    # Depth-first search for a cycle, without recursion.
    state: dict[str, int] = {}
    for start in sorted(rules):
        if state.get(start):
            continue
        path = [(start, iter(sorted(begins.get(start, ()))))]
        state[start] = 1
        while path:
            name, successors = path[-1]
            following = next(successors, None)
            if following is None:
                state[name] = 2
                path.pop()
            elif state.get(following) == 1:
                raise GrammarLanguageError(
                    f"the grammar's {_shown(following)} is left-recursive (it can begin with itself), "
                    "which llama.cpp cannot run: put something before the recursive reference"
                )
            elif not state.get(following):
                state[following] = 1
                path.append((following, iter(sorted(begins.get(following, ())))))
