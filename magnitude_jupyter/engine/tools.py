"""Tool calling: the tools a request gives (each API reads its own shape into `ToolSpec`s), a prompt
that describes them, a grammar that holds the answer to a call or a plain reply, and a parser that
reads calls back out of the answer, whole or in pieces.

The form of a call is chosen by the model's chat template:

- **generic** (templates that know nothing of tools, the bundled SmolLM2's among them): the tools are
  described in the system prompt (`tools_prompt`) and a call is JSON alone, always spaced the same::

      {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}

  Tool results come back as one user message per run of `tool` messages:
  ``{"tool_results": [{"name": "add", "content": "5"}]}``.
- **hermes** (templates that read `tools` and write `<tool_call>` tags: Qwen 2.5/3, Hermes, SmolLM3):
  the template describes the tools and renders the history itself; a call is::

      <tool_call>
      {"name": "add", "arguments": {"a": 2, "b": 3}}
      </tool_call>
- **llama3** (Llama 3.1-3.3 templates, which ask for `"parameters"`): one call an answer,
  ``{"name": "add", "parameters": {"a": 2, "b": 3}}``.

In all, the wrapper around the arguments is literal text with no choice of spacing, so a call sent
back in the history renders to the text the model wrote (and the prefix cache keeps the model's own
tokens for it: `PrefixCache.respelled`). The arguments follow each tool's JSON Schema
(schema_grammar.py), so they always validate, whatever the model's size. A plain reply is any text
that does not start with the call form's first character (`{` or `<`) or with white space.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .schema_grammar import BoundedSchemaConverter, GrammarError, schema_rules, without_trailing_space
from .schema_limits import MAX_TOOLS, check_schema

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("auto", "none", "required")


class ToolError(ValueError):
    """A tool definition, tool choice or tool message that cannot be used; `param` names the field."""

    def __init__(self, message: str, param: str = "tools") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    unheld: tuple[str, ...] = ()  # what of `parameters` the grammar leaves to the check after (answer_check.py)

    def for_template(self) -> dict[str, Any]:
        """The tool as chat templates read it (Hugging Face's convention, the `tools` they render)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def described(self) -> str:
        return json.dumps({"name": self.name, "description": self.description, "parameters": self.parameters})


class _NoRemoteRefs(Mapping[str, Callable[[str], Any]]):
    """fastjsonschema's handlers by URL scheme, holding every scheme: each refuses. A scheme it has no
    handler for, it fetches with urllib (file:// and http:// alike); with this, nothing is fetched,
    wherever in a schema a `$ref` stands (a value inside `enum` included)."""

    def __getitem__(self, scheme: str) -> Callable[[str], Any]:
        return _refuse_remote

    def __contains__(self, scheme: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def _refuse_remote(uri: str) -> Any:
    raise ToolError(f"'$ref' {uri[:200]!r} points outside the schema: only references inside it ('#/...') resolve")


NO_REMOTE_REFS = _NoRemoteRefs()


def without_patterns(schema: Any) -> Any:
    """A copy of a schema without its `pattern` keywords (walked without recursion)."""
    copy: Any = {} if isinstance(schema, dict) else [] if isinstance(schema, list) else schema
    stack = [(schema, copy)]
    while stack:
        source, target = stack.pop()
        items = source.items() if isinstance(source, dict) else enumerate(source)
        for key, value in items:
            if key == "pattern" and isinstance(source, dict) and isinstance(value, str):
                continue
            child: Any = {} if isinstance(value, dict) else [] if isinstance(value, list) else value
            if isinstance(target, dict):
                target[key] = child
            else:
                target.append(child)
            if isinstance(value, (dict, list)):
                stack.append((value, child))
    return copy


@dataclass(frozen=True)
class ToolSpec:
    """One tool as a client sent it, in any API's shape: its parts, and where they stand in the
    request (`at`: "tools[2].function"; `schema_field`: "parameters" or "input_schema"), so that a
    problem is reported by the names the client used."""

    name: Any
    description: Any
    parameters: Any
    at: str
    schema_field: str = "parameters"
    strict: Any = None


def check_tools(specs: list[ToolSpec]) -> list[Tool]:
    """The tools, checked: names, descriptions, and parameter schemas that are valid JSON Schema and
    can become a grammar. Raises ToolError naming the field at fault."""
    if not specs:
        raise ToolError("'tools' must be a non-empty list")
    if len(specs) > MAX_TOOLS:
        raise ToolError(f"'tools' lists {len(specs)} functions; the limit is {MAX_TOOLS}")
    tools: list[Tool] = []
    for index, spec in enumerate(specs):
        tool = _checked(spec, index)
        if any(other.name == tool.name for other in tools):
            raise ToolError(f"{spec.at}: two tools are named {tool.name!r}")
        tools.append(tool)
    return tools


def _checked(spec: ToolSpec, index: int) -> Tool:
    # fastjsonschema, not jsonschema: importing jsonschema costs seconds and tens of MiB in a Jupyter
    # environment, for a check of the schema's own shape (docs/decisions.md).
    import fastjsonschema

    name, at = spec.name, spec.at
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ToolError(f"{at}.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    description = spec.description or ""
    if not isinstance(description, str):
        raise ToolError(f"{at}.description must be a string")
    schema_at = f"{at}.{spec.schema_field}"
    parameters = spec.parameters
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolError(f"{schema_at} of {name!r} must be a JSON Schema of type 'object'")
    try:  # the caps, and no reference outside the schema, before fastjsonschema resolves anything
        check_schema(parameters, schema_at)
    except GrammarError as exc:
        raise ToolError(str(exc)) from None
    try:  # patterns are the grammar converter's to read: fastjsonschema rewrites `$` inside a class
        fastjsonschema.compile(without_patterns(parameters), handlers=NO_REMOTE_REFS)
    except Exception as exc:  # a definition error, or whatever its walk of a malformed schema hits
        raise ToolError(f"{schema_at} of {name!r} is not a valid JSON Schema: {exc}") from None
    if spec.strict not in (None, True, False):
        raise ToolError(f"{at}.strict must be true or false")
    return Tool(name, description, parameters, _unheld(parameters, index, f"{schema_at} of {name!r}"))


def _unheld(parameters: dict[str, Any], index: int, where: str) -> tuple[str, ...]:
    """What of a tool's parameters no grammar holds (checked after generation); ToolError when they
    cannot become a grammar at all."""
    converter = BoundedSchemaConverter()
    try:
        schema_rules(converter, parameters, f"tool-{index}-arguments", f"tool-{index}")
    except GrammarError as exc:
        raise ToolError(f"{where}: {exc}") from None
    inside = f"tool-{index}-arguments"  # the converter names rules after where they stand
    return tuple(
        w.replace(f"in {inside}-", "in ").replace(f"in {inside}", "in the parameters") for w in converter.unheld
    )


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools: which, whether or which one to call, and how many at once."""

    tools: tuple[Tool, ...]
    choice: str = "auto"  # auto | none | required | function
    function: str | None = None  # the one to call, when choice == "function"
    parallel: bool = False  # as llama.cpp's server: a small model asked for several tends to loop

    @classmethod
    def of(
        cls, tools: list[Tool], choice: str = "auto", function: str | None = None, parallel: bool = False
    ) -> ToolRequest:
        """Checked: `choice` one of CHOICES or "function", and then `function` one of the tools."""
        if choice == "function":
            if not any(tool.name == function for tool in tools):
                raise ToolError(f"'tool_choice' names {function!r}, which is not one of the tools", "tool_choice")
        elif choice not in CHOICES:
            raise ToolError(f"'tool_choice' must be one of {', '.join(CHOICES)} or a function", "tool_choice")
        return cls(tuple(tools), choice, function if choice == "function" else None, parallel)


# -- the two forms --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallForm:
    """The literal text around calls; only the name and the arguments vary."""

    name: str
    opening: str  # before the first call
    call_open: str  # before a call's name
    call_mid: str  # between the name and the arguments
    call_close: str  # after the arguments
    separator: str | None  # between two calls; None: one call an answer, whatever the request allows
    closing: str  # after the last call
    native: bool = True  # the chat template describes the tools and renders tool turns itself

    @property
    def first_char(self) -> str:
        return (self.opening or self.call_open)[0]

    def render(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments JSON text) as the model writes them."""
        written = [f"{self.call_open}{name}{self.call_mid}{args}{self.call_close}" for name, args in calls]
        return self.opening + (self.separator or "").join(written) + self.closing


GENERIC = CallForm("generic", '{"tool_calls": [', '{"name": "', '", "arguments": ', "}", ", ", "]}", native=False)
HERMES = CallForm("hermes", "", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n", "")
# Llama 3.1-3.3: one call an answer, its arguments under "parameters" (the template says so itself).
LLAMA3 = CallForm("llama3", "", '{"name": "', '", "parameters": ', "}", None, "")
# gpt-oss (harmony): a call is a commentary-channel message to the function, its arguments JSON; the
# turn ends at <|call|>, an end-of-generation token, so one call an answer.
HARMONY = CallForm("harmony", "", "<|channel|>commentary to=functions.", " <|constrain|>json<|message|>", "", None, "")
FORMS = {form.name: form for form in (GENERIC, HERMES, LLAMA3, HARMONY)}
# Harmony's channels around a call or a reply: reasoning first if the model wants (analysis), the
# reply in the final channel; `<|` never inside the analysis text, as the format's markers start so.
HARMONY_ANALYSIS = (
    'analysis ::= "<|channel|>analysis<|message|>" analysis-text "<|end|><|start|>assistant"\n'
    'analysis-text ::= ([^<] | "<" [^|])*'
)
HARMONY_REPLY = 'plain-reply ::= "<|channel|>final<|message|>" [^\\x00]*'


def template_form(template: str | None) -> CallForm:
    """The call form a chat template expects, when it reads `tools`: hermes when it writes
    `<tool_call>` tags, llama3 when it asks for `"parameters"`; else (and without tools) generic."""
    if not template or not re.search(r"\btools\b", template):
        return GENERIC
    if "<|channel|>" in template and "to=functions." in template:
        return HARMONY
    if "<tool_call>" in template:
        return HERMES
    if '"parameters": ' in template and "ipython" in template:
        return LLAMA3
    return GENERIC


def _literal(text: str) -> str:
    return json.dumps(text)  # a GBNF string literal escapes as JSON does for these characters


def calls_grammar(
    tools: list[Tool] | tuple[Tool, ...], only: str | None, parallel: bool, plain: bool, form: str
) -> str:
    """GBNF: one call (or several, when `parallel`) of `only` or any tool, or else, when `plain`, a
    reply in text."""
    shape = FORMS[form]
    converter = BoundedSchemaConverter()
    alternatives = []
    for i, tool in enumerate(tools):
        if only is not None and tool.name != only:
            continue
        try:
            args = schema_rules(converter, tool.parameters, f"tool-{i}-arguments", f"tool-{i}")
            without_trailing_space(converter, args)  # the wrapper's "}" follows at once: one way to write a call
        except GrammarError as exc:
            raise ToolError(f"tools[{i}].function.parameters of {tool.name!r}: {exc}") from None
        call = _literal(shape.call_open + tool.name + shape.call_mid) + f" {args}"
        if shape.call_close:
            call += " " + _literal(shape.call_close)
        alternatives.append(call)
    lines = [converter.format_grammar(), "tool-call ::= " + " | ".join(alternatives)]
    more = f" ({_literal(shape.separator)} tool-call)*" if parallel and shape.separator is not None else ""
    lines.append(f"tool-calls ::= {_literal(shape.opening) + ' ' if shape.opening else ''}tool-call{more}")
    if shape.closing:
        lines[-1] += " " + _literal(shape.closing)
    if shape is HARMONY:
        lines.append(HARMONY_ANALYSIS)
        if plain:
            lines.append(HARMONY_REPLY)
        lines.append("root ::= analysis? " + ("(tool-calls | plain-reply)" if plain else "tool-calls"))
    elif plain:
        lines.append(f"plain-reply ::= [^{shape.first_char} \\t\\r\\n] [^\\x00]*")
        lines.append("root ::= tool-calls | plain-reply")
    else:
        lines.append("root ::= tool-calls")
    if not alternatives:
        raise ToolError(f"no tool is named {only!r}", "tool_choice")
    return "\n".join(lines)


def plain_grammar(form: str) -> str:
    """A reply in text that cannot be read as a call (tool_choice 'none')."""
    if FORMS[form] is HARMONY:
        return "\n".join((HARMONY_ANALYSIS, HARMONY_REPLY, "root ::= analysis? plain-reply"))
    return f"root ::= [^{FORMS[form].first_char} \\t\\r\\n] [^\\x00]*"


def tools_grammar(tools: ToolRequest, form: str) -> str:
    """The grammar a request's tool choice holds its answer to."""
    if tools.choice == "none":
        return plain_grammar(form)
    return calls_grammar(tools.tools, tools.function, tools.parallel, plain=tools.choice == "auto", form=form)


# -- reading calls out of an answer ---------------------------------------------------------------


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text as generated; the whole object once `complete`
    complete: bool = False


@dataclass
class ParsedAnswer:
    """What an answer (or the part of it generated so far) says: text, or calls."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    is_call: bool = False


# What can open or close an object, or a string, or escape inside one: the only characters the scan
# below stops at (the rest of an argument's text is skipped in C, not read a character at a time).
_SIGNIFICANT = re.compile(r'[{}"\\]')


def _object_end(text: str, start: int) -> int | None:
    """The index after the JSON object starting at `start`, or None if it is not closed yet."""
    depth, in_string, escaped_at = 0, False, -1
    for match in _SIGNIFICANT.finditer(text, start):
        i = match.start()
        if i == escaped_at:  # the character after a backslash in a string
            continue
        c = text[i]
        if in_string:
            if c == "\\":
                escaped_at = i + 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _expect(text: str, pos: int, literal: str) -> int | None:
    """The position after `literal` at `pos`, or None if the text stops before it (or differs)."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    return None


def parse_answer(text: str, form: str) -> ParsedAnswer:
    """Read an answer in the given call form. Works on a partial answer: a call is listed once its
    name is whole, with the arguments generated so far; text is content only once it cannot be a call."""
    shape = FORMS[form]
    if not text:
        return ParsedAnswer()
    first = shape.opening or shape.call_open
    if not (text.startswith(first) or first.startswith(text)):
        return ParsedAnswer(content=text)
    answer = ParsedAnswer(is_call=True)
    pos = _expect(text, 0, shape.opening)
    while pos is not None:
        name_at = _expect(text, pos, shape.call_open)
        if name_at is None:
            break
        name_end = text.find(shape.call_mid[0], name_at)  # a name holds neither a quote nor a space
        args_at = _expect(text, name_end, shape.call_mid) if name_end >= 0 else None
        if args_at is None:
            break
        end = _object_end(text, args_at)
        call = ParsedCall(text[name_at:name_end], text[args_at : end or len(text)], complete=end is not None)
        answer.calls.append(call)
        if end is None:
            break
        while text[end : end + 1].isspace():  # a schema whose last rule ends in an optional space
            end += 1
        after = _expect(text, end, shape.call_close)
        if after is None or shape.separator is None:
            break
        pos = _expect(text, after, shape.separator)
    return answer


# -- tool turns in the history --------------------------------------------------------------------


def tools_prompt(tools: list[Tool] | tuple[Tool, ...]) -> str:
    """The generic form's description of the tools, added to the system prompt. It does not depend
    on `tool_choice` (the grammar enforces that), so an agent's turns share one prompt prefix."""
    listed = "\n".join(tool.described() for tool in tools)
    example = GENERIC.render([("<function name>", "{<arguments>}")])
    return (
        "You can call these functions (each given as its name, what it does, and the JSON Schema of its "
        f"arguments):\n{listed}\n"
        f"To call functions, answer with JSON alone, in this form:\n{example}\n"
        'Their results come back as {"tool_results": [...]}. To answer without calling a function, '
        "or once the results answer the question, write plain text."
    )


def _arguments_text(arguments: Any, where: str) -> str:
    if isinstance(arguments, dict):
        return json.dumps(arguments)
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return arguments
    raise ToolError(f"{where}.function.arguments must be a JSON object (as text), got {arguments!r}", "messages")


def history_calls(message: dict[str, Any], index: int) -> list[tuple[str, str, str]]:
    """An assistant message's `tool_calls` as (id, name, arguments text), checked."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise ToolError(f"messages[{index}].tool_calls must be a non-empty list", "messages")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(f"{where} must be {{id, type: 'function', function: {{name, arguments}}}}", "messages")
        call_id = call.get("id")
        out.append((str(call_id or ""), function["name"], _arguments_text(function.get("arguments", "{}"), where)))
    return out


def _tool_names_by_id(messages: list[Any]) -> dict[str, str]:
    return {
        call_id: name
        for i, m in enumerate(messages)
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        for call_id, name, _ in history_calls(m, i)
    }


def _tool_result(message: dict[str, Any], index: int, names: dict[str, str]) -> tuple[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or call_id not in names:
        raise ToolError(
            f"messages[{index}].tool_call_id ({call_id!r}) must name a call of an earlier assistant message",
            "messages",
        )
    return names[call_id], message.get("content")


def generic_messages(messages: list[Any], tools: tuple[Tool, ...] | None, text_of: Any) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: the tools described in the system prompt, calls
    written out in the generic form, and each run of tool results as one user message."""
    names = _tool_names_by_id(messages)
    out: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []

    def flush() -> None:
        if results:
            out.append({"role": "user", "content": json.dumps({"tool_results": list(results)})})
            results.clear()

    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "tool":
            name, content = _tool_result(message, i, names)
            results.append({"name": name, "content": text_of(content, i)})
            continue
        flush()
        if role == "assistant" and message.get("tool_calls"):
            written = GENERIC.render([(name, args) for _, name, args in history_calls(message, i)])
            text = text_of(message.get("content") or "", i)
            out.append({"role": "assistant", "content": f"{text}\n{written}" if text else written})
        else:
            out.append(message)
    flush()
    if tools:
        described = tools_prompt(tools)
        first = out[0] if out else {}
        if first.get("role") in ("system", "developer"):
            out[0] = {"role": "system", "content": f"{text_of(first.get('content'), 0)}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def native_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools itself: arguments as objects (as Hugging Face's
    templates expect), each tool result with the name of the call it answers."""
    names = _tool_names_by_id(messages)
    out = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.loads(args)}}
                for call_id, name, args in history_calls(message, i)
            ]
            message = {**message, "content": message.get("content") or "", "tool_calls": calls}
        elif role == "tool":
            name, _ = _tool_result(message, i, names)
            message = {**message, "name": name}
        out.append(message)
    return out
