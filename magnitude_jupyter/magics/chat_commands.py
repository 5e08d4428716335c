"""`%magnitude chats`, `history` and `reset`: the notebook's named conversations."""

from __future__ import annotations

from typing import Any

from .arguments import History, MagnitudeError, Reset
from .session import NotebookSession


def chats(session: NotebookSession) -> None:
    for conversation in session.chats.by_name.values():
        print(f"{conversation.name}: {len(conversation.turns)} turns")
    if not session.chats.by_name:
        print("magnitude: no conversations yet (%%magnitude --chat [NAME] starts one)")


def history(session: NotebookSession, args: History) -> Any:
    try:
        return session.chats.find(args.chat).history()
    except KeyError as exc:
        raise MagnitudeError(exc.args[0]) from None


def reset(session: NotebookSession, args: Reset) -> None:
    try:
        session.chats.reset(args.chat)
    except KeyError as exc:
        raise MagnitudeError(exc.args[0]) from None
    print(f"magnitude: forgot the conversation {args.chat!r}")
