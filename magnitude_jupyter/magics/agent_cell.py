"""`%%magnitude --tools f,g`: the model may call Python functions of the notebook; each call and
its result is shown as it happens, and the whole run is kept in the output's metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from IPython.display import display

from ..client.agent import AgentError, AgentStep, run_agent
from ..client.conversations import Conversation, Turn
from ..client.http import ClientError
from .arguments import CellArgs, MagnitudeError
from .session import NotebookSession

if TYPE_CHECKING:
    from collections.abc import Callable

PREVIEW = 200


def notebook_functions(names: str, user_ns: dict[str, Any]) -> list[Callable[..., Any]]:
    """`--tools a,b`: functions of the notebook, by name."""
    functions = []
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        fn = user_ns.get(name)
        if fn is None:
            raise AgentError(f"--tools names {name!r}, which is not defined in the notebook")
        if not callable(fn):
            raise AgentError(f"--tools names {name!r}, a {type(fn).__name__}, not a function")
        functions.append(fn)
    if not functions:
        raise AgentError("--tools needs the names of functions, comma-separated")
    return functions


def _short(text: str | None) -> str:
    text = text or ""
    return text if len(text) <= PREVIEW else text[: PREVIEW - 1] + "…"


def step_line(step: AgentStep) -> str:
    outcome = f"error: {step.error}" if step.error is not None else _short(step.result)
    model = f"model {step.model_ms:,.0f} ms, " if step.model_ms is not None else ""
    return f"→ {step.name}({_short(step.arguments)})  ← {outcome}  ({model}tool {step.tool_ms:,.1f} ms)"


def agent_cell(
    session: NotebookSession,
    args: CellArgs,
    prompt: str,
    conversation: Conversation | None,
    history: list[Turn],
    messages: list[dict[str, Any]],
    body: dict[str, Any],
) -> None:
    """Run the agent loop for one cell: the answer in `_magnitude` (and -o's variable), each step
    printed as it happens, the whole run in the output's metadata. A bad --tools or a failed call is
    one line under the cell."""
    assert args.tools is not None
    client = session.client
    sent = len(messages)
    try:
        run = run_agent(
            client,
            messages,
            notebook_functions(args.tools, session.user_ns),
            max_steps=args.max_steps,
            tool_choice=args.tool_choice,
            on_step=lambda step: print(step_line(step), flush=True),
            **body,
        )
    except (AgentError, ClientError) as exc:
        raise MagnitudeError(str(exc)) from None
    answer = run.answer if run.answer is not None else ""
    if run.stopped == "step_limit":
        print(
            f"magnitude: stopped at the step limit ({args.max_steps} rounds of tool calls) before the model "
            "answered; raise --max-steps, or continue the conversation"
        )
    metadata: dict[str, Any] = {
        "server": client.api_base,
        "model": body.get("model"),
        "sampling": {k: v for k, v in body.items() if k != "model"},
        "agent": run.provenance(),
    }
    if conversation is not None:
        between = run.messages[sent:]
        if run.answer is not None:
            between = between[:-1]  # the answer itself is the turn's reply
        last = run.rounds[-1]
        turn = Turn(prompt, answer, session.cell_key, last["usage"], last["timings"], tool_messages=between)
        conversation.turns = [*history, turn]
        metadata["conversation"] = {"name": conversation.name, "turn": len(conversation.turns)}
    display({"text/plain": answer}, raw=True, metadata={"magnitude": metadata})
    session.keep_answer(answer, args.output, conversation)
