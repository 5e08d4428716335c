"""`%%magnitude`: the cell as one prompt, streamed into the output; a turn of a named conversation
with `--chat`; the same prompt to several models with `--compare`."""

from __future__ import annotations

import html
import json
import re
import time
from typing import Any

from IPython.display import display

from ..client.conversations import Conversation, Turn
from ..client.exchange import prompt_messages
from ..client.http import Client, ClientError, StreamResult
from .arguments import CellArgs, MagnitudeError
from .session import LAST_ANSWER, NotebookSession

UPDATE_EVERY_S = 0.05


def strip_fences(text: str) -> str:
    match = re.search(r"```[\w+-]*\n(.*?)```", text, re.S)
    return (match.group(1) if match else text).strip()


def parse_json_answer(text: str) -> Any:
    candidate = strip_fences(text)
    try:
        return json.loads(candidate)
    except ValueError:
        start, end = candidate.find("{"), candidate.rfind("}")
        if 0 <= start < end:
            try:
                return json.loads(candidate[start : end + 1])
            except ValueError:
                pass
    raise MagnitudeError(f"the answer is not valid JSON (kept as text in {LAST_ANSWER}): {text[:80]!r}")


def request_body(session: NotebookSession, args: CellArgs, conversation: Conversation | None) -> dict[str, Any]:
    """The request's fields besides its messages; a magnitude server gets its own as well."""
    body: dict[str, Any] = {}
    for key, value in (
        ("model", args.model or session.model),
        ("temperature", args.temperature if args.temperature is not None else 0.0),
        ("max_tokens", args.max_tokens),
        ("top_p", args.top_p),
        ("seed", args.seed),
        ("stop", args.stop),
    ):
        if value is not None:
            body[key] = value
    if args.format == "json":  # the server's grammar keeps the answer parseable JSON
        body["response_format"] = {"type": "json_object"}
    ours, _ = session.server_facts(session.client)
    if ours:
        # A conversation turn copies its history from the prefix cache; reproducible requests never do.
        body["reproducible"] = not args.no_reproducible and conversation is None
        if args.ignore_eos:
            body["ignore_eos"] = True
        body["priority"] = "interactive"
        body["origin"] = session.origin()  # the panel names the cell
    return body


def prompt_cell(session: NotebookSession, args: CellArgs, cell: str) -> None:
    prompt = session.interpolate(cell.strip())
    if not prompt:
        raise MagnitudeError("the cell is empty: write the prompt below %%magnitude")
    conversation = session.chats.get(args.chat, args.system) if args.chat is not None else None
    if conversation is not None:
        history = conversation.turns[: conversation.slot_for(session.cell_key)]
        messages = conversation.messages(history, prompt)
    else:
        history = []
        messages = prompt_messages(prompt, args.system)
    body = request_body(session, args, conversation)
    if args.compare is not None:
        return compare_cell(session, args, messages, body)
    if args.tools is not None:
        from .agent_cell import agent_cell

        return agent_cell(session, args, prompt, conversation, history, messages, body)

    client = session.client
    handle = None if args.no_stream else display({"text/plain": ""}, raw=True, display_id=True)
    trimmed = 0
    while True:
        try:
            result = stream_answer(client, messages, body, handle)
            break
        except ClientError as exc:
            if conversation is None or exc.code != "context_length_exceeded":
                raise MagnitudeError(str(exc)) from None
            if not (args.trim and history):
                raise MagnitudeError(
                    f"the conversation {conversation.name!r} ({len(history)} turns) no longer fits: {exc}; "
                    f"add --trim to drop its oldest turns, or start over with %magnitude reset {conversation.name}"
                ) from None
            history, trimmed = history[1:], trimmed + 1  # the oldest turn goes; the system prompt stays
            messages = conversation.messages(history, prompt)

    metadata = {"magnitude": provenance(session, client, body, result)}
    if conversation is not None:
        conversation.turns = [*history, Turn(prompt, result.text, session.cell_key, result.usage, result.timings)]
        metadata["magnitude"]["conversation"] = {
            "name": conversation.name,
            "turn": len(conversation.turns),
            "trimmed": trimmed,
        }
    answer: Any = result.text
    bundle = answer_bundle(result)
    if args.format == "markdown":
        bundle.pop("text/html", None)  # the reasoning folded above the rendered answer instead
        bundle["text/markdown"] = (reasoning_html(result) + "\n\n" if result.reasoning else "") + shown_text(result)
    elif args.format == "code":
        answer = strip_fences(result.text)
        session.shell.set_next_input(answer, replace=False)
    if handle is not None:
        handle.update(bundle, raw=True, metadata=metadata)
    else:
        display(bundle, raw=True, metadata=metadata)
    session.user_ns[LAST_ANSWER] = result.text  # kept even when the JSON below does not parse
    if args.format == "json":
        answer = parse_json_answer(result.text)
    session.keep_answer(answer, args.output, conversation)
    return None


def stream_answer(client: Client, messages: list[dict[str, Any]], body: dict[str, Any], handle: Any) -> StreamResult:
    """Stream one answer into the cell's display (updated at most every UPDATE_EVERY_S)."""
    result = StreamResult()
    last_update = 0.0
    try:
        for _ in client.stream_chat(messages, result=result, **body):
            now = time.monotonic()
            if handle is not None and now - last_update >= UPDATE_EVERY_S:
                handle.update(answer_bundle(result), raw=True)
                last_update = now
    except KeyboardInterrupt:
        # The server has stopped generating it (the client cancels on the way out): the answer so far
        # stays in the cell, marked, and the interrupt is one line, not the HTTP client's traceback.
        partial = {"text/plain": result.text + INTERRUPTED_MARK}
        if handle is not None:
            handle.update(partial, raw=True)
        else:
            display(partial, raw=True)
        raise MagnitudeError("interrupted: the answer so far is above; the server stopped generating it") from None
    return result


CUT_MARK = " … (max tokens)"  # shown after an answer cut at --max-tokens, never kept in the variable
INTERRUPTED_MARK = " … (interrupted)"  # shown after the part of an answer an interrupt stopped


def answer_bundle(result: StreamResult) -> dict[str, str]:
    """The answer as the cell shows it: marked where --max-tokens cut it; a thinking model's reasoning
    folded away above it (HTML), or counted in a line (plain text)."""
    text = shown_text(result)
    if not result.reasoning:
        return {"text/plain": text}
    words = len(result.reasoning.split())
    return {
        "text/plain": f"[reasoning: {words:,} words]\n{text}",
        "text/html": reasoning_html(result) + f"<pre>{html.escape(text)}</pre>",
    }


def shown_text(result: StreamResult) -> str:
    return result.text + (CUT_MARK if result.finish_reason == "length" else "")


def reasoning_html(result: StreamResult) -> str:
    words = len(result.reasoning.split())
    summary = f"reasoning ({words:,} words)"
    return f"<details><summary>{summary}</summary><pre>{html.escape(result.reasoning.strip())}</pre></details>"


def provenance(session: NotebookSession, client: Client, body: dict[str, Any], result: StreamResult) -> dict[str, Any]:
    """How this answer was made, saved with the notebook."""
    ours, models = session.server_facts(client)
    model_meta = next((m for m in models if m["id"] == result.model), models[0] if models else {})
    meta = model_meta.get("meta") or {}
    return {
        "server": client.api_base,
        "model": result.model,
        "model_file": meta.get("path"),
        "model_sha256": meta.get("sha256"),
        "sampling": {k: v for k, v in body.items() if k != "model"},
        "seed": body.get("seed"),
        "usage": result.usage,
        "timings": result.timings,
        "finish_reason": result.finish_reason,
        "id": result.id,
        "resumed": result.resumed,
        "engine": "magnitude" if ours else "openai-compatible",
    }


def compare_cell(
    session: NotebookSession, args: CellArgs, messages: list[dict[str, Any]], body: dict[str, Any]
) -> None:
    from ..batch.compare import answers_frame, answers_html, answers_text, compare_prompt, parse_model_list

    assert args.compare is not None
    try:
        models = parse_model_list(args.compare)
    except ValueError as exc:
        raise MagnitudeError(str(exc)) from None
    answers = compare_prompt(session.client, models, messages, body)
    display({"text/html": answers_html(answers), "text/plain": answers_text(answers)}, raw=True)
    session.keep(answers_frame(answers), args.output)
