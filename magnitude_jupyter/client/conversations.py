"""Conversations in a notebook: named message histories owned by the kernel, one turn per cell.

The server keeps no session state: each turn sends the whole history, and the engine's prefix cache
makes that cheap (everything up to the last answer is already in the KV cache). Notebook semantics
decide where a turn goes: a cell that made turn k and runs again replaces turn k and drops the turns
after it, as re-running a cell replaces its output, instead of appending a duplicate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .exchange import token_counts

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_CHAT = "default"


@dataclass
class Turn:
    user: str
    assistant: str
    cell: str  # the cell that made it: its id (JupyterLab sends one), else its text
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    tool_messages: list[dict[str, Any]] = field(default_factory=list)  # calls and results before the reply


@dataclass
class Conversation:
    name: str
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)

    def slot_for(self, cell: str) -> int:
        """Where a turn from `cell` goes: the turn this cell made before, else after the last one."""
        return next((i for i, turn in enumerate(self.turns) if turn.cell == cell), len(self.turns))

    def messages(self, turns: list[Turn] | None = None, user: str | None = None) -> list[dict[str, Any]]:
        """The history as chat messages (system prompt first), with `user` as the next turn if given."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for turn in self.turns if turns is None else turns:
            out += [{"role": "user", "content": turn.user}, *turn.tool_messages]
            if turn.assistant or not turn.tool_messages:
                out.append({"role": "assistant", "content": turn.assistant})
        if user is not None:
            out.append({"role": "user", "content": user})
        return out

    def record(self, slot: int, turn: Turn) -> None:
        """Turn `slot` is `turn` now; the turns after it belonged to the old one and go."""
        self.turns[slot:] = [turn]

    def history(self) -> pd.DataFrame:
        """One row per message: role, content, tokens, cached tokens, TTFT and the cell that made it."""
        import pandas as pd

        rows: list[dict[str, Any]] = []
        if self.system:
            rows.append({"role": "system", "content": self.system})
        for turn in self.turns:
            counts, timings = token_counts(turn.usage) if turn.usage else None, turn.timings or {}
            rows.append(
                {
                    "role": "user",
                    "content": turn.user,
                    "tokens": counts.prompt if counts else None,
                    "cached_tokens": counts.cached if counts else None,
                }
            )
            rows += [{"role": m["role"], "content": _tool_message_text(m)} for m in turn.tool_messages]
            rows.append(
                {
                    "role": "assistant",
                    "content": turn.assistant,
                    "tokens": counts.output if counts else None,
                    # a person reads milliseconds whole (the server's figure has microseconds)
                    "ttft_ms": round(timings["ttft_ms"]) if timings.get("ttft_ms") is not None else None,
                    "cell": turn.cell[:40],
                }
            )
        columns = ["role", "content", "tokens", "cached_tokens", "ttft_ms", "cell"]
        # Counts are whole numbers, blank where a row has none (not floats with NaN).
        whole = {"tokens": "Int64", "cached_tokens": "Int64", "ttft_ms": "Int64"}
        return pd.DataFrame(rows, columns=columns).astype(whole)


def _tool_message_text(message: dict[str, Any]) -> str:
    """A call (`name(arguments)`) or a tool's result, as one line of the history."""
    calls = message.get("tool_calls") or []
    if calls:
        return "; ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in calls)
    return str(message.get("content") or "")


class Conversations:
    """The kernel's conversations, by name."""

    def __init__(self) -> None:
        self.by_name: dict[str, Conversation] = {}

    def get(self, name: str, system: str | None = None) -> Conversation:
        conversation = self.by_name.setdefault(name, Conversation(name))
        if system is not None:
            conversation.system = system
        return conversation

    def find(self, name: str) -> Conversation:
        if name not in self.by_name:
            known = ", ".join(sorted(self.by_name)) or "none yet"
            raise KeyError(f"no conversation called {name!r} (conversations: {known})")
        return self.by_name[name]

    def reset(self, name: str) -> None:
        self.find(name)
        del self.by_name[name]
