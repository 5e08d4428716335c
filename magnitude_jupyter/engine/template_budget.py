"""A chat template from a model file, rendered within a budget of work and of characters.

Users drop GGUF files from anywhere into `models_dir`, and each file may carry its own Jinja chat
template. Jinja's sandbox keeps a template from reaching Python's internals, but not from working
without end: nested loops over `range(100000)`, a string doubled thirty times, `"x" * 10**9` or
`10 ** 10 ** 9`. Every request renders the template, so one such file would hold a worker for as
long as it runs and take memory from every model.

Here every render counts its work in steps: each loop iteration, call, filter and concatenation is
one, and every string or list a template builds costs one step per `CHARS_PER_STEP` of its length.
A render stops with `TemplateBudgetError` once it has taken `MAX_RENDER_STEPS` steps, built a
string or list longer than `MAX_RENDER_CHARS`, written more than `MAX_RENDER_CHARS` characters, or
run past `RENDER_DEADLINE_SECONDS` (a backstop for a busy machine: the steps are what stop a render
on any machine, the same way each time). Sizes are checked before an operation that would build
a large value (a repeat, a padding width, a power), so nothing over the cap is ever allocated.
docs/http-api.md, "Limits", lists the values; docs/decisions.md, "Chat templates within a budget",
gives the reason.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .step_budget import StepBudget, running, within

MAX_RENDER_STEPS = 1_000_000  # loop iterations, calls, filters and joins in one render
MAX_RENDER_CHARS = 16 << 20  # characters of the rendered prompt, and of any string or list built on the way
CHARS_PER_STEP = 64  # a built string or list costs one step per this many characters or items
RENDER_DEADLINE_SECONDS = 10.0
MAX_POWER_BITS = 4096  # the bits of an integer `**` may make
# A width or count in a format string: seven digits or more would pad to a million characters or more.
WIDE_FORMAT = re.compile(r"\d{7,}")
# String methods and filters whose integer arguments say how long their result is.
SIZED_BY_ARGUMENT = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "truncate"})


class TemplateBudgetError(ValueError):
    """A render that went over its budget; the message says which part of it."""


def _new_budget() -> StepBudget:
    return StepBudget(MAX_RENDER_STEPS, RENDER_DEADLINE_SECONDS, "the chat template", TemplateBudgetError)


def _budget() -> StepBudget:
    """The running render's budget (a template rendered outside `render`, a test's: one of its own)."""
    budget = running()
    return budget if budget is not None else _new_budget()


def _too_long(what: str, size: int) -> TemplateBudgetError:
    return TemplateBudgetError(
        f"the chat template would build {what} of {size:,} characters or items; the limit is {MAX_RENDER_CHARS:,}"
    )


def _sized(value: Any) -> Any:
    """Charge for a value a template built, and refuse it if it is over the cap."""
    if isinstance(value, (str, list, tuple, dict, bytes)):
        size = len(value)
        if size > MAX_RENDER_CHARS:
            raise _too_long("a value", size)
        _budget().charge(1 + size // CHARS_PER_STEP)
    else:
        _budget().charge()
    return value


def _counted_loop(iterable: Any) -> Iterator[Any]:
    """A `for` loop's items, one step each."""
    budget = _budget()
    for item in iterable:
        budget.charge()
        yield item


def _length(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple, bytes)) else None


def _check_repeat(left: Any, right: Any) -> None:
    for seq, count in ((left, right), (right, left)):
        size = _length(seq)
        if size is not None and isinstance(count, int) and size * max(count, 0) > MAX_RENDER_CHARS:
            raise _too_long("a repeat", size * count)


def _check_power(left: Any, right: Any) -> None:
    powers = isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0
    if powers and right * math.log2(abs(left)) > MAX_POWER_BITS:
        raise TemplateBudgetError(f"the chat template would raise {left} to the power {right}")


def _check_format(text: Any) -> None:
    if isinstance(text, str) and WIDE_FORMAT.search(text):
        raise TemplateBudgetError("the chat template formats a value to a width of a million characters or more")


def _check_sized_by_argument(name: str, args: Iterable[Any], kwargs: dict[str, Any]) -> None:
    if name not in SIZED_BY_ARGUMENT:
        return
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_RENDER_CHARS:
            raise _too_long(f"the result of {name!r}", value)


def _check_replace(target: Any, args: tuple[Any, ...]) -> None:
    if isinstance(target, str) and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        # count("") is len + 1: an empty `old` inserts `new` between every two characters
        size = len(target) + target.count(args[0]) * max(0, len(args[1]) - len(args[0]))
        if size > MAX_RENDER_CHARS:
            raise _too_long("the result of 'replace'", size)


def _budgeted_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_environment marks
    def run(*args: Any, **kwargs: Any) -> Any:
        _budget().charge()
        _check_sized_by_argument(name, args[1:], kwargs)
        texts = [a for a in args if isinstance(a, str)]
        if name == "format":
            for text in texts:
                _check_format(text)
        if name == "replace" and len(texts) >= 3:
            _check_replace(texts[0], (texts[1], texts[2]))
        return _sized(fn(*args, **kwargs))

    return run


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, every template's work counted (see the module doc)."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals["__magnitude_loop"] = _counted_loop
        self.globals["__magnitude_join"] = _sized
        self.filters = {name: _budgeted_filter(name, fn) for name, fn in self.filters.items()}

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name("__magnitude_loop", "load"), [loop.iter], [], None, None)
        for concat in list(tree.find_all(nodes.Concat)):
            _replace_node(tree, concat, nodes.Call(nodes.Name("__magnitude_join", "load"), [concat], [], None, None))
        return tree

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        _budget().charge()
        if operator_name == "*":
            _check_repeat(left, right)
        elif operator_name == "**":
            _check_power(left, right)
        elif operator_name == "%":
            _check_format(left)
        elif operator_name == "+":
            sizes = (_length(left), _length(right))
            if sizes[0] is not None and sizes[1] is not None and sizes[0] + sizes[1] > MAX_RENDER_CHARS:
                raise _too_long("a concatenation", sizes[0] + sizes[1])
        return _sized(self.binop_table[operator_name](left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _budget().charge()
        name = getattr(__obj, "__name__", "")
        # str.format reaches here as the sandbox's wrapper of the bound method.
        target = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(target, str):
            _check_sized_by_argument(name, args, kwargs)
            if name in ("format", "format_map"):
                _check_format(target)
            if name == "replace":
                _check_replace(target, args)
        return _sized(super().call(__context, __obj, *args, **kwargs))


def _replace_node(tree: nodes.Node, old: nodes.Node, new: nodes.Node) -> None:
    """Put `new` where `old` stands in `tree` (`new` holds `old`, so `old` is matched by identity)."""
    for parent in tree.find_all(nodes.Node):
        if parent is new:
            continue
        for field in parent.fields:
            value = getattr(parent, field, None)
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
                        return


def render(template: Any, **variables: Any) -> str:
    """Render a template of a BudgetedEnvironment within a fresh budget; its output is bounded too."""
    with within(_new_budget) as budget:
        pieces: list[str] = []
        written = 0
        for piece in template.generate(**variables):
            written += len(piece)
            if written > MAX_RENDER_CHARS:
                raise _too_long("a prompt", written)
            budget.charge(1 + len(piece) // CHARS_PER_STEP)
            pieces.append(piece)
        return "".join(pieces)
