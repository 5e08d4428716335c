"""What `Engine.submit` checks and fills in before a request is queued: its sampling parameters
validated, its tools turned into a grammar, every grammar measured before llama.cpp parses it."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from .answer_check import AnswerCheck
from .gbnf_check import check_grammar_language
from .gbnf_limits import measure_grammar, run_on_grammar_stack
from .request import SamplingParams, invalid_param
from .runner_api import Runner
from .schema_limits import GrammarError
from .tools import ToolRequest, template_form, tools_grammar


def prepare_params(
    runner: Runner,
    params: SamplingParams | None,
    messages: Any,
    tools: ToolRequest | None,
    chat_template: str | None,
) -> tuple[SamplingParams, str | None, AnswerCheck | None]:
    """A request's own copy of its parameters, checked, the tool-call form of the template (None
    without tools), and what its answer is checked against once generated (None: its grammar holds
    everything). Raises ValueError (bad parameters, tools or grammar) naming the field."""
    params = replace(params or SamplingParams(), stop=list((params.stop if params else []) or []))
    params.validate()
    tool_form = None
    if tools is not None:
        if messages is None:
            raise invalid_param("tools", "tools need chat messages")
        if params.grammar is not None:
            raise invalid_param("tools", "give tools or a grammar (response_format), not both")
        tool_form = template_form(chat_template).name
        params.grammar = tools_grammar(tools, tool_form)
    if params.grammar is not None:
        grammar = params.grammar
        try:
            measure_grammar(grammar)  # before llama.cpp sees it: see gbnf_limits.py
            check_grammar_language(grammar)  # and nothing it can reach is a dead end: gbnf_check.py
        except GrammarError as exc:
            raise invalid_param("tools" if tools is not None else "grammar", str(exc)) from None
        if not run_on_grammar_stack(lambda: runner.check_grammar(grammar)):
            raise invalid_param("grammar", "llama.cpp could not parse it (GBNF with a 'root' rule)")
    try:
        check = AnswerCheck.of(params.answer_schema, params.unheld, tools)
    except GrammarError as exc:
        raise invalid_param("tools" if tools is not None else "response_format", str(exc)) from None
    if not params.greedy and params.seed is None:
        params.seed = random.getrandbits(32)  # recorded, so a sampled answer can be reproduced
    return params, tool_form, check
