"""A JSON Schema `pattern` rewritten into the regular-expression subset the grammar converter reads.

llama-cpp-python's converter copies escapes through to GBNF as they are, and GBNF knows only
`\\t \\r \\n \\xHH \\uHHHH \\UHHHHHHHH` and a few quoted characters: `(\\w+\\s?)+` became a grammar
llama.cpp could not parse, and `\\.` one it refused. Here the shorthand classes become the
classes they stand for (ECMAScript's meaning: `\\w` is ASCII letters, digits and `_`), escaped
punctuation becomes a hex escape, a pattern without anchors may have anything around it (JSON
Schema patterns match anywhere), and what a grammar cannot hold (back-references, word
boundaries, lookarounds, Unicode properties) is refused by name. Every character range is checked:
`[z-a]` matches nothing, and a grammar holding it would leave the sampler no token to pick.
"""

from __future__ import annotations

from .schema_limits import GrammarError

WORD = "a-zA-Z0-9_"
DIGIT = "0-9"
SPACE = " \\t\\n\\r\\x0B\\x0C"
SHORTHANDS = {"w": WORD, "d": DIGIT, "s": SPACE}
CONTROL = {"t": "\\t", "n": "\\n", "r": "\\r", "f": "\\x0C", "v": "\\x0B", "0": "\\x00"}
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


def _hex(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02X}"
    return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"


def _escape(pattern: str, i: int, in_class: bool) -> tuple[str, int, int | None]:
    """The escape at `i` (a backslash): its GBNF text, the index after it, and the code point it
    stands for when it is one character (for range checks)."""
    if i + 1 >= len(pattern):
        raise PatternError(f"the pattern {pattern[:80]!r} ends with a lone backslash")
    kind = pattern[i + 1]
    if kind in SHORTHANDS or kind.lower() in SHORTHANDS:
        chars = SHORTHANDS[kind.lower()]
        if kind.islower():
            return (chars if in_class else f"[{chars}]"), i + 2, None
        if in_class:
            raise PatternError(
                f"the pattern {pattern[:80]!r} has \\{kind} inside a character class, which a grammar "
                "cannot hold: list the characters instead"
            )
        return f"[^{chars}]", i + 2, None
    if kind in CONTROL:
        text = CONTROL[kind]
        code = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "0": 0}[kind]
        return (text if in_class else f"[{text}]"), i + 2, code
    if kind in UNSUPPORTED or kind.isdigit():
        what = UNSUPPORTED.get(kind, f"a back-reference (\\{kind})")
        raise PatternError(f"the pattern {pattern[:80]!r} uses {what}, which a grammar cannot hold")
    if kind in "xu":
        size = 2 if kind == "x" else 4
        digits = pattern[i + 2 : i + 2 + size]
        if len(digits) != size or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise PatternError(f"the pattern {pattern[:80]!r} has \\{kind} without {size} hex digits")
        code = int(digits, 16)
        text = _hex(chr(code))
        return (text if in_class else f"[{text}]"), i + 2 + size, code
    # Any other escaped character stands for itself.
    text = _hex(kind)
    return (text if in_class else f"[{text}]"), i + 2, ord(kind)


def _char_class(pattern: str, i: int) -> tuple[str, int]:
    """The class that opens at `i`, in GBNF, with its ranges checked; the index after it."""
    out = ["["]
    i += 1
    if i < len(pattern) and pattern[i] == "^":
        out.append("^")
        i += 1
    first = True
    previous: int | None = None  # the code point just written, for a range after it
    while i < len(pattern) and (pattern[i] != "]" or first):
        char = pattern[i]
        if char == "-" and previous is not None and i + 1 < len(pattern) and pattern[i + 1] != "]":
            # a range: previous - next
            if pattern[i + 1] == "\\":
                text, after, code = _escape(pattern, i + 1, True)
            else:
                text, after, code = _hex(pattern[i + 1]), i + 2, ord(pattern[i + 1])
            if code is None:
                raise PatternError(f"the pattern {pattern[:80]!r} has a range ending in a class shorthand")
            if code < previous:
                raise PatternError(
                    f"the pattern {pattern[:80]!r} has the range {chr(previous)!r}-{chr(code)!r}, which is "
                    f"empty ({chr(previous)!r} comes after {chr(code)!r})"
                )
            out.append("-" + text)
            i, previous = after, None
        elif char == "\\":
            text, i, previous = _escape(pattern, i, True)
            out.append(text)
        else:
            out.append(_hex(char) if char in '[]\\-^"' else char)
            previous = ord(char)
            i += 1
        first = False
    if i >= len(pattern):
        raise PatternError(f"the pattern {pattern[:80]!r} has an unterminated character class")
    if len(out) == 1 or out == ["[", "^"]:
        raise PatternError(f"the pattern {pattern[:80]!r} has an empty character class")
    out.append("]")
    return "".join(out), i + 1


def translate_pattern(pattern: str) -> str:
    """`pattern` as the converter reads it: anchored with ^...$, classes and escapes written out."""
    out: list[str] = []
    body = pattern
    anchored_start = body.startswith("^")
    if anchored_start:
        body = body[1:]
    # A $ at the end anchors the end, unless a backslash escapes it.
    before = body[:-1]
    anchored_end = body.endswith("$") and (len(before) - len(before.rstrip("\\"))) % 2 == 0
    if anchored_end:
        body = body[:-1]
    i = 0
    while i < len(body):
        char = body[i]
        if char == "\\":
            text, i, _ = _escape(body, i, False)
            out.append(text)
        elif char == "[":
            text, i = _char_class(body, i)
            out.append(text)
        elif char in "^$":
            raise PatternError(
                f"the pattern {pattern[:80]!r} has {char!r} inside it: only a leading ^ and a trailing $ "
                "can be held by a grammar"
            )
        elif char == "(" and body.startswith("(?", i):
            if body.startswith("(?:", i):
                out.append("(")
                i += 3
            else:
                raise PatternError(
                    f"the pattern {pattern[:80]!r} has a lookaround or named group '(?', which a grammar cannot hold"
                )
        else:
            out.append(char)
            i += 1
    text = "".join(out)
    return "^" + ("" if anchored_start else ".*") + text + ("" if anchored_end else ".*") + "$"
