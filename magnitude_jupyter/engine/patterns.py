"""A JSON Schema `pattern` rewritten into the regular-expression subset the grammar converter reads,
for the text of a JSON string.

llama-cpp-python's converter copies escapes through to GBNF as they are, and GBNF knows only
`\\t \\r \\n \\xHH \\uHHHH \\UHHHHHHHH` and a few quoted characters: `(\\w+\\s?)+` became a grammar
llama.cpp could not parse, and `\\.` one it refused. And a pattern describes the string's value,
while the grammar writes its JSON text: a `.` or `[^0-9]` let the model write a raw `"`, ending the
string early (invalid JSON). Here every class and character becomes a set of code points: those a
JSON string may hold as they are are written as a class; a `"` or `\\` the pattern asks for by
name is written escaped (`\\"`, `\\\\`), as are `\\n \\t \\r`; classes leave out what JSON escapes (a
stricter pattern: every answer still matches it). Shorthands mean what ECMAScript says (`\\w` is
ASCII letters, digits and `_`). A pattern without anchors may have anything around it (JSON Schema
patterns match anywhere). What a grammar cannot hold (back-references, word boundaries,
lookarounds, Unicode properties) is refused by name, and so is a range such as `[z-a]`.
"""

from __future__ import annotations

from .schema_limits import GrammarError

MAX_CODE_POINT = 0x10FFFF
Ranges = list[tuple[int, int]]
WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
DIGIT: Ranges = [(0x30, 0x39)]
SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20)]
SHORTHANDS = {"w": WORD, "d": DIGIT, "s": SPACE}
CONTROL = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "0": 0}
# What a JSON string holds only escaped: control characters, the quote and the backslash.
JSON_ESCAPED: Ranges = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
JSON_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x0A: "n", 0x09: "t", 0x0D: "r", 0x08: "b", 0x0C: "f"}
UNSUPPORTED = {
    "b": "a word boundary (\\b)",
    "B": "a non-boundary (\\B)",
    "p": "a Unicode property (\\p{...})",
    "P": "a Unicode property (\\P{...})",
    "k": "a named back-reference (\\k<...>)",
    "c": "a control escape (\\cX)",
}


class PatternError(GrammarError):
    """A pattern the grammar cannot hold; the message names the pattern and the part."""


def _normal(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out: Ranges = []
    start = 0
    for lo, hi in _normal(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return out


def _minus(ranges: Ranges, taken: Ranges) -> Ranges:
    """`ranges` without `taken`."""
    keep = _complement(taken)
    out: Ranges = []
    for lo, hi in _normal(ranges):
        for klo, khi in keep:
            if klo <= hi and lo <= khi:
                out.append((max(lo, klo), min(hi, khi)))
    return out


def _code(code: int) -> str:
    if code <= 0xFF:
        return f"\\x{code:02X}"
    return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"


def _class(ranges: Ranges) -> str:
    """A class the converter copies to GBNF as it is, every character written as a hex escape."""
    parts = [_code(lo) if lo == hi else f"{_code(lo)}-{_code(hi)}" for lo, hi in _normal(ranges)]
    return "[" + "".join(parts) + "]"


def _json_text(ranges: Ranges, pattern: str, what: str) -> str:
    """A set of characters as the JSON text that writes one of them: those a string holds as they
    are, as a class (a letter or digit as itself); a single character JSON escapes, escaped; a class
    loses what JSON escapes."""
    ranges = _normal(ranges)
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        code = ranges[0][0]
        backslash = _class([(0x5C, 0x5C)])
        if code in JSON_SHORT_ESCAPES:
            return (
                f"({backslash}{JSON_SHORT_ESCAPES[code]})"
                if JSON_SHORT_ESCAPES[code].isalpha()
                else (f"({backslash}{_class([(code, code)])})")
            )
        if code < 0x20:
            return f"({backslash}u{code:04x})"
        if chr(code).isascii() and chr(code).isalnum():
            return chr(code)
    plain = _minus(ranges, JSON_ESCAPED)
    if not plain:
        raise PatternError(f"the pattern {pattern[:80]!r} has {what}, which holds only characters JSON escapes")
    return _class(plain)


def _escape(pattern: str, i: int) -> tuple[Ranges, int, int | None]:
    """The escape at `i` (a backslash): the characters it stands for, the index after it, and its
    code point when it is one character (for ranges)."""
    if i + 1 >= len(pattern):
        raise PatternError(f"the pattern {pattern[:80]!r} ends with a lone backslash")
    kind = pattern[i + 1]
    if kind.lower() in SHORTHANDS:
        chars = SHORTHANDS[kind.lower()]
        return (chars if kind.islower() else _complement(chars)), i + 2, None
    if kind in CONTROL:
        code = CONTROL[kind]
        return [(code, code)], i + 2, code
    if kind in UNSUPPORTED or kind.isdigit():
        what = UNSUPPORTED.get(kind, f"a back-reference (\\{kind})")
        raise PatternError(f"the pattern {pattern[:80]!r} uses {what}, which a grammar cannot hold")
    if kind in "xu":
        size = 2 if kind == "x" else 4
        digits = pattern[i + 2 : i + 2 + size]
        if len(digits) != size or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise PatternError(f"the pattern {pattern[:80]!r} has \\{kind} without {size} hex digits")
        code = int(digits, 16)
        return [(code, code)], i + 2 + size, code
    return [(ord(kind), ord(kind))], i + 2, ord(kind)  # any other escaped character stands for itself


def _char_class(pattern: str, i: int) -> tuple[Ranges, int]:
    """The characters of the class that opens at `i`, its ranges checked; the index after it."""
    start = i
    i += 1
    negated = i < len(pattern) and pattern[i] == "^"
    if negated:
        i += 1
    ranges: Ranges = []
    first = True
    previous: int | None = None  # the single character just read, for a range after it
    while i < len(pattern) and (pattern[i] != "]" or first):
        char = pattern[i]
        if char == "-" and previous is not None and i + 1 < len(pattern) and pattern[i + 1] != "]":
            if pattern[i + 1] == "\\":
                _, after, code = _escape(pattern, i + 1)
            else:
                after, code = i + 2, ord(pattern[i + 1])
            if code is None:
                raise PatternError(f"the pattern {pattern[:80]!r} has a range ending in a class shorthand")
            if code < previous:
                raise PatternError(
                    f"the pattern {pattern[:80]!r} has the range {chr(previous)!r}-{chr(code)!r}, which is "
                    f"empty ({chr(previous)!r} comes after {chr(code)!r})"
                )
            ranges.append((previous, code))
            i, previous = after, None
        elif char == "\\":
            chars, i, previous = _escape(pattern, i)
            ranges += chars
        else:
            ranges.append((ord(char), ord(char)))
            previous = ord(char)
            i += 1
        first = False
    if i >= len(pattern):
        raise PatternError(f"the pattern {pattern[:80]!r} has an unterminated character class")
    if not ranges:
        raise PatternError(f"the pattern {pattern[:80]!r} has an empty character class")
    chars = _complement(ranges) if negated else ranges
    if not chars:
        raise PatternError(f"the pattern {pattern[:80]!r} has a class {pattern[start : i + 1]} that matches nothing")
    return chars, i + 1


ANY = _complement([(0x0A, 0x0A), (0x0D, 0x0D)])  # `.`: any character but a line break


def translate_pattern(pattern: str) -> str:
    """`pattern` as the converter reads it, for a JSON string's text: anchored with ^...$, every
    class and character written out."""
    body = pattern
    anchored_start = body.startswith("^")
    if anchored_start:
        body = body[1:]
    before = body[:-1]  # a $ at the end anchors the end, unless a backslash escapes it
    anchored_end = body.endswith("$") and (len(before) - len(before.rstrip("\\"))) % 2 == 0
    if anchored_end:
        body = before
    out: list[str] = []
    i = 0
    while i < len(body):
        char = body[i]
        if char == "\\":
            chars, i, _ = _escape(body, i)
            out.append(_json_text(chars, pattern, f"the escape {body[i - 2 : i]}"))
        elif char == "[":
            start = i
            chars, i = _char_class(body, i)
            out.append(_json_text(chars, pattern, f"the class {body[start:i]}"))
        elif char == ".":
            out.append(_json_text(ANY, pattern, "'.'"))
            i += 1
        elif char in "^$":
            raise PatternError(
                f"the pattern {pattern[:80]!r} has {char!r} inside it: only a leading ^ and a trailing $ "
                "can be held by a grammar"
            )
        elif char == "(" and body.startswith("(?", i):
            if not body.startswith("(?:", i):
                raise PatternError(
                    f"the pattern {pattern[:80]!r} has a lookaround or named group '(?', which a grammar cannot hold"
                )
            out.append("(")
            i += 3
        elif char == "{":  # a repetition count, as it is
            end = body.find("}", i)
            if end < 0:
                raise PatternError(f"the pattern {pattern[:80]!r} has an unterminated repetition '{{'")
            out.append(body[i : end + 1])
            i = end + 1
        elif char in "()|*+?}":
            out.append(char)
            i += 1
        else:
            out.append(_json_text([(ord(char), ord(char))], pattern, repr(char)))
            i += 1
    anything = "(" + _json_text(ANY, pattern, "'.'") + ")*"
    return "^" + ("" if anchored_start else anything) + "".join(out) + ("" if anchored_end else anything) + "$"
