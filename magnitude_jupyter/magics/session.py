"""What the magics remember between cells of one notebook: the server, the model chosen with
`%magnitude use`, the conversations, the cell running now."""

from __future__ import annotations

import os
import string
from collections.abc import Callable
from typing import Any, TypeVar

from ..client.conversations import Conversation, Conversations
from ..client.http import Client, ClientError, discover
from .arguments import MagnitudeError

LAST_ANSWER = "_magnitude"
T = TypeVar("T")


class CellProgress:
    """One line under the running cell while a model loads: "loading smollm2-135m … reading the model
    file (40%), 3 s", rewritten as the load goes, and gone once it is done."""

    def __init__(self) -> None:
        import time

        self._clock = time.monotonic
        self.started = self._clock()
        self.model = ""
        self._handle: Any = None

    def __call__(self, phase: str) -> None:
        from IPython.display import display

        name = f"loading {self.model} … " if self.model and not phase.startswith("loading") else ""
        line = f"{name}{phase}, {self._clock() - self.started:.0f} s"
        text = {"text/plain": line}
        if self._handle is None:
            self._handle = display(text, raw=True, display_id=True)
        else:
            self._handle.update(text, raw=True)

    def done(self) -> None:
        if self._handle is not None:
            self._handle.update({"text/plain": ""}, raw=True)
            self._handle = None


class NotebookSession:
    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self._client: Client | None = None
        self._facts: tuple[Client, bool, list[dict[str, Any]]] | None = None
        self.model: str | None = None
        self.chats = Conversations()
        self.cell_key = ""  # the cell running now: its id from JupyterLab, else its text (pre_run_cell)

    def origin(self, what: str = "") -> str:
        """Where this cell's requests come from, for the panel: the notebook (its path, as Jupyter
        tells its kernels), the cell's execution number, and `what` within it (a batch row...)."""
        notebook = os.path.basename(os.environ.get("JPY_SESSION_NAME", "")) or "notebook"
        count = self.cell_number()
        where = f"{notebook} · cell {count}" if count else notebook
        return f"{where} · {what}" if what else where

    def cell_number(self) -> int | None:
        """The running cell's In [N]: the input history's last index, as it is stored before the cell
        runs (IPython 9 counts `execution_count` up before running a cell, earlier versions after)."""
        history = getattr(self.shell, "history_manager", None)
        if history is not None and len(history.input_hist_raw) > 1:
            return len(history.input_hist_raw) - 1
        return getattr(self.shell, "execution_count", None)

    @property
    def user_ns(self) -> dict[str, Any]:
        assert self.shell is not None, "the magics are registered with a shell"
        return self.shell.user_ns

    # -- the server ---------------------------------------------------------------------------

    @property
    def client(self) -> Client:
        """The server, found (or started) on first use, its model loaded: meanwhile the cell shows
        what the load is doing, with the time it has taken."""
        if self._client is None:
            progress = CellProgress()
            try:
                client = discover(on_progress=progress)
                client.wait_ready(on_progress=progress)
                self._load_first_model(client, progress)
            except ClientError as exc:
                raise MagnitudeError(str(exc)) from None
            finally:
                progress.done()
            self._client = client
        return self._client

    def _load_first_model(self, client: Client, progress: CellProgress) -> None:
        """A server that loads its model on first use (the Jupyter extension) loads it now, in view."""
        try:
            models = client.models()
        except ClientError:
            return  # another OpenAI-compatible server: nothing to load
        wanted = self.model or next((m["id"] for m in models if m.get("default")), None)
        entry = next((m for m in models if m.get("id") == wanted), None)
        if entry is not None and entry.get("state") != "ready":
            progress.model = str(wanted)
            progress(f"loading {wanted}")
            client.load_showing_progress(str(wanted), progress, origin=self.origin())

    def connect(self, client: Client | None) -> None:
        """Talk to this server from now on (None: find one again on the next call)."""
        if self._client is not None and client is None:
            self._client.close()
        self._client = client
        self._facts = None

    def server_facts(self, client: Client) -> tuple[bool, list[dict[str, Any]]]:
        """(is it our engine, its models), asked once per server rather than on every cell."""
        if self._facts is not None and self._facts[0] is client:
            return self._facts[1], self._facts[2]
        try:
            ours = client.is_magnitude()
        except ClientError:
            ours = False
        try:
            models = client.models()
        except ClientError:
            return ours, []  # not remembered: the next cell asks again
        self._facts = (client, ours, models)
        return ours, models

    def forget_facts(self) -> None:
        """The server's listing changed (a model was loaded)."""
        self._facts = None

    def call(self, fn: Callable[[], T]) -> T:
        """A client call whose failure is one line under the cell."""
        try:
            return fn()
        except ClientError as exc:
            raise MagnitudeError(str(exc)) from None

    # -- results ------------------------------------------------------------------------------

    def keep(self, value: Any, output: str | None) -> None:
        """The result in `_magnitude`, and in the variable -o names."""
        self.user_ns[LAST_ANSWER] = value
        if output:
            self.user_ns[output] = value

    def keep_answer(self, answer: Any, output: str | None, conversation: Conversation | None) -> None:
        """A prompt's answer in `_magnitude`; -o's variable gets the whole conversation in a turn."""
        self.user_ns[LAST_ANSWER] = answer
        if output:
            self.user_ns[output] = conversation.messages() if conversation is not None else answer

    def interpolate(self, text: str) -> str:
        """`{name}`, `{In[3]}`, `{Out[2]}`, `{x:.2f}` from the notebook's namespace; `{{` and `}}` escape."""
        try:
            return string.Formatter().vformat(text, (), self.user_ns)
        except KeyError as exc:
            raise MagnitudeError(
                f"{{{exc.args[0]}}} is not defined in the notebook (write {{{{ to mean a brace)"
            ) from None
        except (IndexError, AttributeError, ValueError, TypeError) as exc:
            raise MagnitudeError(f"cannot fill in the prompt: {exc}") from None

    def dataframe(self, name: str) -> Any:
        df = self.user_ns.get(name)
        if df is None:
            raise MagnitudeError(f"no DataFrame named {name!r} in the notebook")
        return df
