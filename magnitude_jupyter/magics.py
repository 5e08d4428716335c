"""`%%magnitude` and `%magnitude`: prompts that stream into the cell, and DataFrame batches.

The magics talk to a server through `client.py` (ours, found automatically, or any
OpenAI-compatible endpoint after `%magnitude connect URL`); they never touch the engine.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import string
import time
from typing import Any, NoReturn

from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from .batch import is_dask_dataframe, score_dataframe, summary_line
from .batch_options import BatchError, add_batch_arguments, batch_flags, given_options
from .calibrate.options import add_arguments as add_calibrate_arguments
from .client import Client, ClientError, StreamResult, discover
from .conversations import DEFAULT_CHAT, Conversations, Turn
from .exchange import prompt_messages

LAST_ANSWER = "_magnitude"
FORMATS = ("text", "markdown", "json", "code")
UPDATE_EVERY_S = 0.05


class MagnitudeError(Exception):
    """Shown as one line under the cell, not a traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"magnitude: {self}"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # never SystemExit inside a kernel
        raise MagnitudeError(f"{message} (usage: {self.format_usage().strip().removeprefix('usage: ')})")


def interpolate(text: str, namespace: dict[str, Any]) -> str:
    """`{name}`, `{In[3]}`, `{Out[2]}`, `{x:.2f}` from the notebook's namespace; `{{` and `}}` escape."""
    try:
        return string.Formatter().vformat(text, (), namespace)
    except KeyError as exc:
        raise MagnitudeError(f"{{{exc.args[0]}}} is not defined in the notebook (write {{{{ to mean a brace)") from None
    except (IndexError, AttributeError, ValueError, TypeError) as exc:
        raise MagnitudeError(f"cannot fill in the prompt: {exc}") from None


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


# Options a single prompt shares with a batch: declared here for both, with the same types.
SHARED_WITH_BATCH = frozenset({"model", "system", "temperature", "max_tokens"})


def cell_parser() -> _Parser:
    p = _Parser(prog="%%magnitude", add_help=False)
    p.add_argument(
        "--model", "-m", default=None, help="the model to ask (default: %%magnitude use's, else the server's)"
    )
    p.add_argument("--system", "-s", default=None, help="system message")
    p.add_argument("--temperature", "-t", type=float, default=None, help="0 (default) is greedy")
    p.add_argument("--max-tokens", type=int, default=None, help="most tokens in the answer")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="with a temperature: the same answer again")
    p.add_argument("--stop", nargs="+", default=None, help="strings that end the answer")
    p.add_argument("--format", "-f", choices=FORMATS, default="text", help="json parses the answer; code adds a cell")
    p.add_argument("-o", "--output", default=None, help="variable for the answer (always also _magnitude)")
    p.add_argument("--no-stream", action="store_true", help="show the answer once it is complete")
    p.add_argument(
        "--no-reproducible", action="store_true", help="faster, but the answer may depend on what runs beside it"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (for measuring)")
    p.add_argument("--chat", nargs="?", const=DEFAULT_CHAT, default=None, help="continue a named conversation")
    p.add_argument("--trim", action="store_true", help="with --chat: drop the oldest turns when the history overflows")
    p.add_argument("--df", default=None, help="score this DataFrame, the cell being the row template")
    p.add_argument(
        "--embed", action="store_true", help="unit vectors: one per line of the cell, or with --df one per row"
    )
    p.add_argument("--compare", default=None, help="models, comma-separated: the same prompt to each, side by side")
    p.add_argument("--tools", default=None, help="functions of the notebook, comma-separated, the model may call")
    p.add_argument("--max-steps", type=int, default=5, help="with --tools: rounds of tool calls before it stops")
    p.add_argument("--tool-choice", choices=("auto", "required"), default="auto", help="with --tools")
    add_batch_arguments(p, skip=SHARED_WITH_BATCH)
    return p


LINE_COMMANDS = {
    "help": "every option of %%magnitude and every %magnitude command",
    "status": "the server's engine figures",
    "list": "the models the server can serve, and which are in memory",
    "use": "make MODEL the one cells ask for, loading it now",
    "connect": "talk to another OpenAI-compatible server",
    "disconnect": "go back to finding the server automatically",
    "chats": "the conversations of this notebook and their turns",
    "history": "one conversation as a DataFrame",
    "reset": "forget a conversation",
    "calibrate": "measure this server: tokens/s, latency percentiles, the knee (a live widget)",
    "batch": "score a DataFrame with a template over its columns",
}


def line_parser() -> _Parser:
    p = _Parser(prog="%magnitude", add_help=False)
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    parsers = {name: sub.add_parser(name, help=text, add_help=False) for name, text in LINE_COMMANDS.items()}
    parsers["use"].add_argument("model")
    parsers["connect"].add_argument("url")
    parsers["connect"].add_argument("--token", default=None)
    parsers["history"].add_argument("name", nargs="?", default=DEFAULT_CHAT)
    parsers["reset"].add_argument("name", nargs="?", default=DEFAULT_CHAT)
    add_calibrate_arguments(parsers["calibrate"])
    parsers["calibrate"].add_argument("--start", action="store_true", help="start the sweep at once")
    batch = parsers["batch"]
    batch.add_argument("df")
    batch.add_argument("--template", required=True)
    batch.add_argument("-o", "--output", default=None, help="variable for the result")
    add_batch_arguments(batch)
    return p


def help_text() -> str:
    """`%magnitude help`: the cell magic's options, then every line command with its own."""
    lines = [
        "%%magnitude [options], then the prompt on the lines below ({name} fills in a notebook variable)",
        cell_parser().format_help().split("\n", 1)[1].split("options:", 1)[1].rstrip().join(["Options:", ""]),
        "",
        "Line commands:",
    ]
    line = line_parser()
    for action in line._subparsers._group_actions if line._subparsers else []:
        for name, parser in getattr(action, "choices", {}).items():
            lines.append(f"  %magnitude {name:<11} {LINE_COMMANDS[name]}")
            usage = parser.format_usage().strip().removeprefix("usage: ")
            if parser._actions:
                lines.append("      " + usage)
    return "\n".join(lines)


@magics_class
class MagnitudeMagics(Magics):
    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self._client: Client | None = None
        self._facts: tuple[Client, bool, list[dict[str, Any]]] | None = None
        self.model: str | None = None
        self.chats = Conversations()
        self.cell_key = ""  # the cell running now: its id from JupyterLab, else its text (pre_run_cell)

    def remember_cell(self, info: Any) -> None:
        self.cell_key = getattr(info, "cell_id", None) or getattr(info, "raw_cell", "") or ""

    @property
    def ipython(self) -> Any:
        assert self.shell is not None, "the magics are registered with a shell"
        return self.shell

    @property
    def user_ns(self) -> dict[str, Any]:
        return self.ipython.user_ns

    # -- the server ---------------------------------------------------------------------------

    @property
    def client(self) -> Client:
        if self._client is None:
            try:
                self._client = discover()
            except ClientError as exc:
                raise MagnitudeError(str(exc)) from None
        return self._client

    def _server_facts(self, client: Client) -> tuple[bool, list[dict[str, Any]]]:
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

    # -- entry point ------------------------------------------------------------------------------

    @line_cell_magic
    def magnitude(self, line: str, cell: str | None = None) -> Any:
        """%%magnitude [options]: send the cell as a prompt.  %magnitude help: every option and command."""
        try:
            argv = shlex.split(line)
        except ValueError as exc:
            raise MagnitudeError(f"cannot parse the options: {exc}") from None
        if cell is None:
            return self._line(argv)
        if "--help" in argv or "-h" in argv:
            print(help_text())
            return None
        args = cell_parser().parse_args(argv)
        if args.compare is not None and (args.chat is not None or args.model):
            raise MagnitudeError("--compare names the models itself; it does not combine with --chat or -m")
        if args.tools is not None and (args.compare is not None or args.format != "text" or args.df):
            raise MagnitudeError("--tools answers in text: it does not combine with --compare, -f or --df")
        if args.tools is not None and args.max_steps < 1:
            raise MagnitudeError("--max-steps must be at least 1")
        if args.embed:
            return self._embed(args, cell)
        if args.df:
            return self._batch(args.df, cell.strip(), args)
        batch_only = sorted(given_options(args).keys() - SHARED_WITH_BATCH)
        if batch_only:
            names = {name: flag.name for name, flag, _ in batch_flags()}
            flags = ", ".join(names[name] for name in batch_only)
            raise MagnitudeError(f"{flags} score a DataFrame (with --df); for one prompt use -f json for JSON")
        return self._prompt(args, cell)

    def _line(self, argv: list[str]) -> Any:
        if not argv:
            raise MagnitudeError(f"say what to do: {', '.join(LINE_COMMANDS)} (%magnitude help says more)")
        if argv[0] in ("help", "--help", "-h"):
            print(help_text())
            return None
        args = line_parser().parse_args(argv)
        if args.command == "status":
            status = self._call(self.client.status)
            display({"text/plain": json.dumps(status, indent=2), "application/json": status}, raw=True)
            return None
        if args.command == "list":
            models = self._call(self.client.models)
            chosen = self.model or next((m["id"] for m in models if m.get("default")), None)
            for model in models:
                mark = "*" if model["id"] == (chosen or model["id"]) else " "
                resident = ""
                if "loaded" in model:  # a magnitude server says which models are in memory
                    memory = (model.get("memory") or {}).get("resident")
                    held = f", {memory / 2**20:,.0f} MiB" if memory else ""
                    resident = f"  (loaded{held})" if model["loaded"] else "  (not loaded)"
                print(f"{mark} {model['id']}{resident}")
            return None
        if args.command == "use":
            return self._use(args.model)
        if args.command == "connect":
            client = Client(args.url, args.token, source="connect")
            self._call(client.models)
            self._client = client
            print(f"magnitude: connected to {client.api_base}")
            return None
        if args.command == "disconnect":
            if self._client is not None:
                self._client.close()
            self._client = None
            print("magnitude: disconnected (the next call finds a server again)")
            return None
        if args.command == "chats":
            for conversation in self.chats.by_name.values():
                print(f"{conversation.name}: {len(conversation.turns)} turns")
            if not self.chats.by_name:
                print("magnitude: no conversations yet (%%magnitude --chat [NAME] starts one)")
            return None
        if args.command in ("history", "reset"):
            try:
                if args.command == "reset":
                    self.chats.reset(args.name)
                    print(f"magnitude: forgot the conversation {args.name!r}")
                    return None
                return self.chats.find(args.name).history()
            except KeyError as exc:
                raise MagnitudeError(exc.args[0]) from None
        if args.command == "batch":
            return self._batch(args.df, args.template, args)
        if args.command == "calibrate":
            return self._calibrate(args)
        raise MagnitudeError(f"unknown command {args.command!r}")

    def _use(self, model: str) -> None:
        """Pick the model for the cells that follow; a magnitude server loads it now, not on the next cell."""
        client = self.client
        ours, _ = self._server_facts(client)
        if ours:
            print(f"magnitude: loading {model!r}...", end="", flush=True)
            loaded = self._call(lambda: client.load_model(model))
            took = f"loaded in {loaded['load_ms'] / 1000:.1f} s" if loaded.get("load_ms") else "already loaded"
            print(f"\rmagnitude: using model {loaded['id']!r} ({took})")
            self.model = loaded["id"]
            self._facts = None  # its listing changed
            return
        self.model = model
        print(f"magnitude: using model {model!r}")

    def _compare(self, args: argparse.Namespace, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        from .compare import answers_frame, answers_html, answers_text, compare_prompt, parse_model_list

        try:
            models = parse_model_list(args.compare)
        except ValueError as exc:
            raise MagnitudeError(str(exc)) from None
        answers = compare_prompt(self.client, models, messages, body)
        display({"text/html": answers_html(answers), "text/plain": answers_text(answers)}, raw=True)
        frame = answers_frame(answers)
        self.user_ns[LAST_ANSWER] = frame
        if args.output:
            self.user_ns[args.output] = frame

    def _call(self, fn: Any) -> Any:
        try:
            return fn()
        except ClientError as exc:
            raise MagnitudeError(str(exc)) from None

    # -- one prompt ---------------------------------------------------------------------------

    def _prompt(self, args: argparse.Namespace, cell: str) -> Any:
        prompt = interpolate(cell.strip(), self.user_ns)
        if not prompt:
            raise MagnitudeError("the cell is empty: write the prompt below %%magnitude")
        conversation = self.chats.get(args.chat, args.system) if args.chat is not None else None
        if conversation is not None:
            history = conversation.turns[: conversation.slot_for(self.cell_key)]
            messages = conversation.messages(history, prompt)
        else:
            history = []
            messages = prompt_messages(prompt, args.system)
        client = self.client
        body: dict[str, Any] = {}
        for key, value in (
            ("model", args.model or self.model),
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
        ours, models = self._server_facts(client)
        if ours:
            # A conversation turn copies its history from the prefix cache; reproducible requests never do.
            body["reproducible"] = not args.no_reproducible and conversation is None
            if args.ignore_eos:
                body["ignore_eos"] = True
            body["priority"] = "interactive"
        if args.compare is not None:
            return self._compare(args, messages, body)
        if args.tools is not None:
            return self._agent(args, prompt, conversation, history, messages, body)

        handle = None if args.no_stream else display({"text/plain": ""}, raw=True, display_id=True)
        trimmed = 0
        while True:
            try:
                result = self._stream(client, messages, body, handle)
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

        metadata = {"magnitude": self._provenance(client, body, result, ours, models)}
        if conversation is not None:
            conversation.turns = [*history, Turn(prompt, result.text, self.cell_key, result.usage, result.timings)]
            metadata["magnitude"]["conversation"] = {
                "name": conversation.name,
                "turn": len(conversation.turns),
                "trimmed": trimmed,
            }
        answer: Any = result.text
        if args.format == "markdown":
            bundle = {"text/markdown": result.text, "text/plain": result.text}
        elif args.format == "code":
            code = strip_fences(result.text)
            self.ipython.set_next_input(code, replace=False)
            answer = code
            bundle = {"text/plain": result.text}
        else:
            bundle = {"text/plain": result.text}
        if handle is not None:
            handle.update(bundle, raw=True, metadata=metadata)
        else:
            display(bundle, raw=True, metadata=metadata)
        self.user_ns[LAST_ANSWER] = result.text
        if args.format == "json":
            answer = parse_json_answer(result.text)
        self.user_ns[LAST_ANSWER] = answer
        if args.output:
            self.user_ns[args.output] = conversation.messages() if conversation is not None else answer
        return None

    def _agent(
        self,
        args: argparse.Namespace,
        prompt: str,
        conversation: Any,
        history: list[Turn],
        messages: list[dict[str, Any]],
        body: dict[str, Any],
    ) -> None:
        from .agent import AgentError
        from .magics_agent import agent_cell

        try:
            answer, _ = agent_cell(
                self.client, args, self.user_ns, prompt, conversation, history, messages, body, self.cell_key
            )
        except (AgentError, ClientError) as exc:
            raise MagnitudeError(str(exc)) from None
        self.user_ns[LAST_ANSWER] = answer
        if args.output:
            self.user_ns[args.output] = conversation.messages() if conversation is not None else answer

    def _embed(self, args: argparse.Namespace, cell: str) -> Any:
        from .magics_embed import EmbedCell, EmbedCellError, cell_options, run_embed_cell

        prompt_only = [
            flag
            for flag, given in (
                ("--system", args.system),
                ("--chat", args.chat),
                ("--tools", args.tools),
                ("--compare", args.compare),
                ("-f", args.format != "text"),
            )
            if given
        ]
        try:
            options = cell_options(given_options(args), prompt_only)
            df = None
            if args.df:
                df = self.user_ns.get(args.df)
                if df is None:
                    raise EmbedCellError(f"no DataFrame named {args.df!r} in the notebook")
            request = EmbedCell(
                interpolate(cell.strip(), self.user_ns) if df is None else cell.strip(),
                model=options.get("model") or self.model,
                df=df,
                output_column=options.get("output_column") or "embedding",
                checkpoint=options.get("checkpoint"),
            )
            result = run_embed_cell(self.client, request)
        except EmbedCellError as exc:
            raise MagnitudeError(str(exc)) from None
        self.user_ns[LAST_ANSWER] = result
        if args.output:
            self.user_ns[args.output] = result
            return None
        return result

    def _stream(
        self, client: Client, messages: list[dict[str, Any]], body: dict[str, Any], handle: Any
    ) -> StreamResult:
        """Stream one answer into the cell's display (updated at most every UPDATE_EVERY_S)."""
        result = StreamResult()
        last_update = 0.0
        for _ in client.stream_chat(messages, result=result, **body):
            now = time.monotonic()
            if handle is not None and now - last_update >= UPDATE_EVERY_S:
                handle.update({"text/plain": result.text}, raw=True)
                last_update = now
        return result

    def _provenance(
        self, client: Client, body: dict[str, Any], result: StreamResult, ours: bool, models: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """How this answer was made, saved with the notebook."""
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

    # -- calibration ------------------------------------------------------------------------------

    def _calibrate(self, args: argparse.Namespace) -> Any:
        from .magics_calibrate import calibrate_cell

        try:
            return calibrate_cell(self.client, args, self.user_ns)
        except (ClientError, ValueError) as exc:
            raise MagnitudeError(str(exc)) from None

    # -- DataFrame batches ------------------------------------------------------------------------

    def _json_schema(self, ref: str) -> Any:
        """`--json-schema`: the name of a notebook variable, else JSON text."""
        if ref in self.user_ns:
            return self.user_ns[ref]
        try:
            return json.loads(ref)
        except ValueError:
            raise MagnitudeError(f"--json-schema {ref!r} is neither a variable in the notebook nor JSON text") from None

    def _dask_batch(self, ddf: Any, template: str, args: argparse.Namespace) -> Any:
        """A dask DataFrame: scored on the workers' own engines (register `EnginePlugin` first)."""
        options = given_options(args)
        if args.model or getattr(args, "compare", None):
            raise MagnitudeError("a dask DataFrame is scored by the model of each worker's engine: no -m/--compare")
        if args.json_schema is not None:
            options["json_schema"] = self._json_schema(args.json_schema)
        from .dask import compute_scored, score_dask_dataframe
        from .dask import summary_line as dask_summary

        try:
            result = compute_scored(score_dask_dataframe(ddf, template, **options))
        except (BatchError, ValueError, RuntimeError) as exc:
            raise MagnitudeError(str(exc)) from None
        print("magnitude: " + dask_summary(result))
        self.user_ns[LAST_ANSWER] = result
        if args.output:
            self.user_ns[args.output] = result
            return None
        return result

    def _batch(self, df_name: str, template: str, args: argparse.Namespace) -> Any:
        import pandas as pd

        df = self.user_ns.get(df_name)
        if df is None:
            raise MagnitudeError(f"no DataFrame named {df_name!r} in the notebook")
        if is_dask_dataframe(df):
            return self._dask_batch(df, template, args)
        if not isinstance(df, pd.DataFrame):
            raise MagnitudeError(f"{df_name!r} is a {type(df).__name__}, not a pandas or dask DataFrame")
        options = given_options(args)
        options.setdefault("model", self.model)
        if args.json_schema is not None:
            options["json_schema"] = self._json_schema(args.json_schema)
        compare = getattr(args, "compare", None)
        try:
            if compare is not None:
                from .compare import compare_dataframe, parse_model_list

                options.pop("model", None)
                result = compare_dataframe(df, template, parse_model_list(compare), client=self.client, **options)
            else:
                result = score_dataframe(df, template, client=self.client, **options)
        except (BatchError, ValueError) as exc:
            raise MagnitudeError(str(exc)) from None
        if compare is None:
            print("magnitude: " + summary_line(result, options.get("checkpoint")))
        self.user_ns[LAST_ANSWER] = result
        if args.output:
            self.user_ns[args.output] = result
            return None
        return result


def load_ipython_extension(ipython: Any) -> None:
    magics = MagnitudeMagics(ipython)
    ipython.register_magics(magics)
    ipython.events.register("pre_run_cell", magics.remember_cell)
