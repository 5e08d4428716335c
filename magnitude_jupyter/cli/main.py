"""`magnitude`: the command line over the same code the notebook side uses."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..batch.options import BatchOptions
from ..calibrate.options import CalibrateOptions
from ..config import ConfigError
from ..models.registry import ModelNotFoundError
from ..options import click_options
from ..settings_surface import engine_options, engine_overrides, with_slo
from .models import list_cmd, profiles_cmd, settings_or_exit
from .slo import slo_cmd


@click.group()
@click.version_option(package_name="magnitude-jupyter")
def main() -> None:
    """Serve a local GGUF model and measure its magnitude: throughput, latency, capacity."""


class _LoadProgress:
    """What a model load is doing, on stderr while the command waits for it: one line rewritten in
    place on a terminal, a line per phase elsewhere."""

    def __init__(self) -> None:
        import time

        self._clock = time.monotonic
        self.started = self._clock()
        self.tty = sys.stderr.isatty()
        self.shown = 0

    def __call__(self, phase: str) -> None:
        line = f"magnitude: {phase} ({self._clock() - self.started:.0f} s)"
        if self.tty:
            sys.stderr.write("\r" + line.ljust(self.shown))
            self.shown = len(line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and self.shown:
            sys.stderr.write("\r" + " " * self.shown + "\r")
            sys.stderr.flush()


def _client(url: str | None, token: str | None):
    """The server to use (started in the background if none runs), once its model is loaded: the
    wait lasts as long as the load makes progress, and says what it is doing."""
    from ..client.http import Client, ClientError, discover

    progress = _LoadProgress()
    try:
        client = Client(url, token, source="--url") if url else discover(on_progress=progress)
        client.wait_ready(on_progress=progress)
    except ClientError as exc:
        progress.done()
        raise click.ClickException(str(exc)) from exc
    progress.done()
    return client


@main.command()
@click.argument("prompt", required=False)
@click.option("-m", "--model", default=None, help="Model to ask for (default: the server's).")
@click.option("-s", "--system", default=None, help="System message.")
@click.option("-t", "--temperature", type=float, default=0.0, show_default=True)
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--ignore-eos", is_flag=True, help="Generate exactly --max-tokens (for measuring).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--url", default=None, help="Server URL ending before /v1 (default: find one, or start one).")
@click.option("--token", default=None, envvar="MAGNITUDE_TOKEN", help="Bearer token for --url.")
def chat(
    prompt: str | None,
    model: str | None,
    system: str | None,
    temperature: float,
    max_tokens: int,
    seed: int | None,
    ignore_eos: bool,
    fmt: str,
    url: str | None,
    token: str | None,
) -> None:
    """Answer PROMPT, streaming; with no PROMPT, read it from a pipe, or hold a conversation at the terminal.

    Starts `magnitude serve` in the background if none runs. In a conversation, /reset forgets it,
    /exit (or Ctrl-D) leaves, and Ctrl-C stops the answer being written, not the session.
    """
    body: dict[str, Any] = {"temperature": temperature, "max_tokens": max_tokens}
    if model:
        body["model"] = model
    if seed is not None:
        body["seed"] = seed
    if ignore_eos:
        body["ignore_eos"] = True
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read().strip()
        if not prompt:
            raise click.ClickException("no prompt: give one as an argument, or pipe text in")
    client = _client(url, token)
    if prompt is None:
        _conversation(client, system, body)
        return
    _one_answer(client, system, prompt, {**body, "reproducible": True}, fmt)


def _one_answer(client: Any, system: str | None, prompt: str, body: dict[str, Any], fmt: str) -> None:
    from ..client.exchange import prompt_messages
    from ..client.http import ClientError, StreamResult

    messages = prompt_messages(prompt, system)
    result = StreamResult()
    try:
        for piece in client.stream_chat(messages, result=result, **body):
            if fmt == "text":
                click.echo(piece, nl=False)
    except ClientError as exc:
        raise click.ClickException(str(exc)) from exc
    if fmt == "text":
        click.echo()
        return
    answer = {
        "id": result.id,
        "model": result.model,
        "text": result.text,
        "message": {"role": "assistant", "content": result.text},
        "finish_reason": result.finish_reason,
        "usage": result.usage,
        "timings": result.timings,
    }
    click.echo(json.dumps(answer, indent=2))


def _conversation(client: Any, system: str | None, body: dict[str, Any]) -> None:
    """A conversation at the terminal: each turn resends the history (the server's prefix cache has it)."""
    from ..client.conversations import Conversation, Turn
    from ..client.http import ClientError, StreamResult

    conversation = Conversation("terminal", system)
    click.echo("magnitude chat: /reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops an answer")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            click.echo()
            return
        except KeyboardInterrupt:
            click.echo()
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            conversation.turns.clear()
            click.echo("(the conversation is forgotten)")
            continue
        if not line:
            continue
        result = StreamResult()
        pieces = client.stream_chat(conversation.messages(user=line), result=result, **body)
        try:
            for piece in pieces:
                click.echo(piece, nl=False)
        except KeyboardInterrupt:
            pieces.close()  # cancels the generation on the server
            click.echo("\n(stopped; that answer is left out of the conversation)")
            continue
        except ClientError as exc:
            click.echo(f"\nmagnitude: {exc}", err=True)
            continue
        click.echo()
        turn = len(conversation.turns) + 1
        conversation.turns.append(Turn(line, result.text, f"turn {turn}", result.usage, result.timings))


@main.command()
@click.option(
    "--input",
    "input_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Rows to score: .jsonl or .csv.",
)
@click.option(
    "--output",
    "output_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Where to write the scored rows (.jsonl).",
)
@click.option("--template", required=True, help="Jinja2 template over the columns, e.g. 'Classify: {{ review }}'.")
@click_options(BatchOptions, skip=("template",), unset_is_none=True)
@click.option("--fail-on-truncation", is_flag=True, help="Exit non-zero if any answer hit max tokens.")
@click.option("--url", default=None)
@click.option("--token", default=None, envvar="MAGNITUDE_TOKEN")
def batch(
    input_path: str,
    output_path: str,
    template: str,
    fail_on_truncation: bool,
    url: str | None,
    token: str | None,
    **values: Any,
) -> None:
    """Score a JSONL or CSV file row by row with a template (the notebook's batch, from the shell).

    --json-schema names a JSON Schema file.
    """
    import pandas as pd

    from ..batch.options import BatchError, given_options
    from ..batch.score import score_dataframe, summary_line

    try:
        df = pd.read_csv(input_path) if input_path.endswith(".csv") else pd.read_json(input_path, lines=True)
    except ValueError as exc:
        raise click.ClickException(f"cannot read {input_path}: {exc}") from exc
    options = given_options(values)
    if "json_schema" in options:
        schema_path = Path(options["json_schema"])
        try:
            options["json_schema"] = json.loads(schema_path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise click.ClickException(f"cannot read the schema file {schema_path}: {exc.strerror}") from exc
        except ValueError as exc:
            raise click.ClickException(f"{schema_path} is not JSON: {exc}") from exc
    client = _client(url, token)
    try:
        out = score_dataframe(df, template, client=client, **options)
    except BatchError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        out.to_json(output_path, orient="records", lines=True, force_ascii=False)
    except OSError as exc:
        raise click.ClickException(
            f"{summary_line(out, options.get('checkpoint'))}; but the output {output_path} could not be written: "
            f"{exc.strerror or exc}"
        ) from exc
    failed = int(out["error"].notna().sum())
    truncated = int((out["finish_reason"] == "length").sum())
    click.echo(f"{summary_line(out, options.get('checkpoint'))}; {truncated} hit max tokens -> {output_path}", err=True)
    if failed or (fail_on_truncation and truncated):
        sys.exit(1)


@main.command()
@click.option("-m", "--model", default=None, help="Model alias or .gguf path (default: from config).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on.")
@engine_options
@click.option("--token", default=None, help="Bearer token clients must send (default: $MAGNITUDE_TOKEN or a new one).")
@click.option("--no-auth", is_flag=True, help="Accept requests without a token (loopback hosts only).")
@click.option("--force", is_flag=True, help="Allow --no-auth on a non-loopback host.")
@click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's log.")
def serve(
    model: str | None,
    host: str,
    port: int,
    token: str | None,
    no_auth: bool,
    force: bool,
    verbose: bool,
    **engine: Any,
) -> None:
    """Serve the OpenAI-compatible API (and /health, /status, /metrics) on HTTP."""
    import asyncio
    import logging

    from ..engine.pool import ModelPool
    from ..server.standalone import is_loopback, resolve_token
    from ..server.standalone import serve as run_server
    from ..server.tenants import check_owner_key_apart

    if no_auth and not is_loopback(host) and not force:
        raise click.ClickException(
            f"--no-auth on {host} would let anyone on the network use this server; add --force if you really mean it"
        )
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(message)s")
    settings = settings_or_exit()
    try:
        overrides = engine_overrides(engine)
        settings = with_slo(settings, engine)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    try:
        pool = ModelPool(settings, model, overrides=overrides, verbose=verbose)
        pool.plan(pool.default_entry)  # bad overrides (or a memory budget too small) fail here, before listening
    except (ModelNotFoundError, ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    token, generated = resolve_token(token, no_auth)
    try:
        check_owner_key_apart(token, settings.api_keys)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if generated:
        click.echo(f"token: {token}  (clients on this machine also find it in ~/.magnitude/runtime)")
    try:
        asyncio.run(run_server(pool, host, port, token, announce=lambda line: click.echo(line)))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


@main.command()
@click.option("--url", default=None, help="Server URL ending before /v1 (default: find one, or start one).")
@click.option("--token", default=None, envvar="MAGNITUDE_TOKEN")
@click_options(CalibrateOptions)
@click.option("--json", "json_path", default=None, help="Write the profile here.")
@click.option("--csv", "csv_path", default=None, help="Write the levels here.")
@click.option("--html", "html_path", default=None, help="Write a standalone report with the plots here.")
@click.option(
    "--baseline", default=None, help="Compare with this profile file, or 'auto': the last archived one of this model."
)
@click.option("--max-regression", default="15%", show_default=True, help="With --baseline: exit 1 beyond this.")
@click.option("--no-archive", is_flag=True, help="Do not keep this profile in the archive (magnitude profiles).")
@click.option(
    "--cache-types",
    default=None,
    help="Compare KV cache types (e.g. f16,q8_0,q4_0): an engine of each, in this process, one after the other.",
)
@click.option(
    "--apply",
    "apply_changes",
    is_flag=True,
    help="Write the recommended parallel, queue limit and objectives into the config file (a diff is shown first).",
)
@click.option("--yes", is_flag=True, help="With --apply: write without asking.")
def calibrate(
    url: str | None,
    token: str | None,
    json_path: str | None,
    csv_path: str | None,
    html_path: str | None,
    baseline: str | None,
    max_regression: str,
    no_archive: bool,
    cache_types: str | None,
    apply_changes: bool,
    yes: bool,
    **values: Any,
) -> None:
    """Sweep concurrency against a server and print throughput, latency and capacity.

    With --workflow: sessions that resend their growing conversation every round, and the verdict on
    a round-latency objective (exit 1 when the largest number of sessions misses it); with --agent,
    each session is an agent calling a calculator and a lookup table, then answering.

    Every profile is archived by model file and settings (`magnitude profiles`); with --baseline the
    run is compared with another and exits 1 when a figure is worse by more than --max-regression.
    """
    from ..calibrate.archive import parse_fraction
    from ..calibrate.options import CalibrateOptions
    from ..calibrate.records import Level
    from ..calibrate.report import format_profile
    from ..calibrate.run import calibrate as run_calibration
    from ..calibrate.sweep import SweepConfig
    from ..client.http import ClientError

    options = CalibrateOptions.from_values(values)
    try:
        bound = parse_fraction(max_regression)
        options.validate()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    model = options.model
    if options.workflow:
        profile = _workflow(lambda: _model_client(_client(url, token), model), options)
        regressed, _ = _archive_and_compare(profile, baseline, bound, no_archive)
        _save_profile(profile, json_path, csv_path, html_path)
        if not profile.workflow.passed or regressed:
            sys.exit(1)
        return

    try:
        config = SweepConfig.from_options(options)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc

    def progress(level: Level, label: str = "") -> None:
        click.echo(
            f"  {label}concurrency {level.concurrency:>3}: {level.output_tokens_per_s:7.1f} tok/s, "
            f"TTFT p95 {level.ttft_ms.p95 or 0:7.0f} ms",
            err=True,
        )

    if cache_types is not None:
        _calibrate_cache_types(cache_types, config, model, url, progress, html_path, no_archive)
        return
    client = _model_client(_client(url, token), model)
    config.model = client.model

    try:
        if options.pressure_map:
            profile = _pressure_map(client, config, options)
        else:
            profile = run_calibration(client, config, run_probe=not options.no_probe, on_level=progress)
    except (ClientError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    if profile.pressure_map is None:
        click.echo(format_profile(profile))
    regressed, base = _archive_and_compare(profile, baseline, bound, no_archive)
    _save_profile(profile, json_path, csv_path, html_path, base)
    if apply_changes:
        _apply(profile, yes)
    if regressed:
        sys.exit(1)


def _workflow(connect: Callable[[], Any], options: Any) -> Any:
    """Multi-round sessions at each level of --sessions (checked before `connect()` finds the server):
    the profile, its verdict printed."""
    from ..calibrate.run import calibrate_workflow
    from ..calibrate.workflow import format_workflow
    from ..client.http import ClientError

    try:
        levels = options.session_levels()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    client = connect()
    try:
        profile = calibrate_workflow(
            client, levels, options.rounds, options.max_tokens, options.slo_round_p95_ms, agent=options.agent
        )
    except (ClientError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    assert profile.workflow is not None
    click.echo(format_workflow(profile.workflow))
    return profile


def _pressure_map(client: Any, config: Any, options: Any) -> Any:
    """The pressure map, cell by cell on stderr, then its grids."""
    from ..calibrate.pressure import PressureCell, sessions_text
    from ..calibrate.report import format_pressure_map
    from ..calibrate.run import calibrate_pressure_map

    contexts = options.context_levels()
    total = len(contexts) * len(set(config.concurrency))
    done = [0]

    def progress(cell: PressureCell) -> None:
        done[0] += 1
        where = f"  cell {done[0]}/{total}: {sessions_text(cell.concurrency)} × {cell.context_tokens:,} tokens: "
        if cell.measured:
            click.echo(f"{where}{cell.output_tokens_per_s:7.1f} tok/s, p95 {cell.e2e_p95_ms or 0:7.0f} ms", err=True)
        else:
            click.echo(f"{where}{cell.state}", err=True)

    profile = calibrate_pressure_map(client, config, contexts, on_cell=progress)
    assert profile.pressure_map is not None
    click.echo(format_pressure_map(profile.pressure_map))
    return profile


def _apply(profile: Any, yes: bool) -> None:
    """Show what the calibration recommends as a diff of the config file, and write it (asked first)."""
    from ..calibrate.apply import proposal, write_config
    from ..config import config_path

    path = config_path()
    what, diff, new = proposal(profile, path)
    if not diff:
        click.echo(f"--apply: {what}", err=True)
        return
    click.echo(diff)
    if not yes and not click.confirm(f"write these changes to {path}?", default=False):
        return
    try:
        write_config(path, new)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"--apply: {exc}") from None
    click.echo(f"wrote {path}: restart magnitude serve (or JupyterLab) to run with it", err=True)


def _calibrate_cache_types(
    cache_types: str, config: Any, model: str | None, url: str | None, progress: Any, html: str | None, no_archive: bool
) -> None:
    from ..calibrate.archive import archive
    from ..probes.cache_types import cache_types_figure, calibrate_cache_types, format_cache_types

    if url is not None:
        raise click.ClickException("--cache-types restarts the engine for each type: it runs its own, not --url's")
    types = tuple(t.strip() for t in cache_types.split(",") if t.strip())
    try:
        profiles = calibrate_cache_types(types, config, model, on_level=lambda t, lv: progress(lv, f"{t:<5} "))
    except (ConfigError, ModelNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_cache_types(profiles))
    for profile in profiles if not no_archive else ():
        click.echo(f"archived {archive(profile)}", err=True)
    if html:
        cache_types_figure(profiles).write_html(html)
        click.echo(f"wrote {html}", err=True)


def _model_client(client: Any, model: str | None) -> Any:
    """The client every calibration request goes through: on `model` (loaded first by our server)."""
    from ..client.http import ClientError

    if model is None:
        return client
    try:
        ours = client.is_magnitude()
        return client.for_model(client.load_model(model)["id"] if ours else model)
    except ClientError as exc:
        raise click.ClickException(str(exc)) from exc


def _archive_and_compare(profile: Any, baseline: str | None, bound: float, no_archive: bool) -> tuple[bool, Any]:
    """Archive the profile and compare it with the baseline: whether a figure regressed, and the
    baseline's profile (None: none was asked for, or none was found)."""
    from ..calibrate.archive import archive, compare_to_baseline, format_regressions, latest_match
    from ..calibrate.profile import Profile

    saved = None if no_archive else archive(profile)
    if saved is not None:
        click.echo(f"archived {saved}", err=True)
    if baseline is None:
        return False, None
    if baseline == "auto":
        match = latest_match(profile, exclude=saved)
        if match is None:
            click.echo("no archived profile of this model file and settings yet: this run is the first baseline")
            return False, None
        base, name = match.profile, match.path.name
    else:
        try:
            base, name = Profile.load(baseline), baseline
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise click.ClickException(f"cannot read the baseline {baseline}: {exc}") from exc
    rows = compare_to_baseline(profile, base, bound)
    click.echo(format_regressions(rows, name, bound))
    return any(r.regressed for r in rows), base


def _save_profile(
    profile: Any, json_path: str | None, csv_path: str | None, html_path: str | None, baseline: Any = None
) -> None:
    """The profile's files; the report draws the difference from `baseline` where it can."""
    for path, save in ((json_path, profile.save_json), (csv_path, profile.save_csv)):
        if path:
            save(path)
            click.echo(f"wrote {path}", err=True)
    if html_path:
        profile.save_html(html_path, baseline)
        click.echo(f"wrote {html_path}", err=True)


main.add_command(list_cmd)
main.add_command(profiles_cmd)
main.add_command(slo_cmd)
