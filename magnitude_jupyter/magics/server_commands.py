"""`%magnitude status`, `list`, `use`, `connect` and `disconnect`: which server and model the
notebook's cells talk to."""

from __future__ import annotations

import json
from typing import Any

from IPython.display import display

from ..client.http import Client
from .arguments import Connect, Status, Use
from .session import NotebookSession


def status(session: NotebookSession, args: Status) -> None:
    figures = session.call(session.client.status)
    if args.json:
        display({"text/plain": json.dumps(figures, indent=2), "application/json": figures}, raw=True)
        return
    print("\n".join(status_lines(figures)))


def status_lines(status: dict[str, Any]) -> list[str]:
    """A server's /status in a few lines a participant can read (a non-magnitude server: what it says)."""
    if "kv_cells_total" not in status:
        return [json.dumps(status)]
    lines = [f"model      {status.get('model')} ({status.get('state')})"]
    running, parallel, waiting = (int(status.get(k) or 0) for k in ("running", "parallel", "waiting"))
    lines.append(f"slots      {running} of {parallel} in use, {waiting} waiting")
    total, used = status.get("kv_cells_total") or 0, status.get("kv_cells_used") or 0
    share = f" ({used / total:.0%})" if total else ""
    lines.append(f"KV cache   {used:,} of {total:,} cells hold tokens{share}")
    speed, generated = status.get("recent_tokens_per_s") or 0, int(status.get("generated_tokens_total") or 0)
    lines.append(f"speed      {speed:.1f} tokens/s now, {generated:,} generated")
    rate = status.get("prefix_cache_hit_rate")
    hits = f"{rate:.0%} of prompt tokens came from the cache" if rate is not None else "no prompts looked up yet"
    lines.append(f"cache      {hits}")
    objectives = (status.get("slo") or {}).get("objectives") or []
    for o in objectives:
        verdict = {True: "holds", False: "BROKEN", None: "no requests yet"}[o.get("holds")]
        now = "-" if o.get("current") is None else f"{o['current']:,.0f}"
        lines.append(f"objective  {o['what']} {now} {o['unit']} (limit {o['objective']:,.0f}): {verdict}")
    return lines


def list_models(session: NotebookSession) -> None:
    """The server's models: `*` marks the one this notebook's cells use (%magnitude use), and the
    server's default says so in words, as the panel does."""
    models = session.call(session.client.models)
    default = next((m["id"] for m in models if m.get("default")), None)
    chosen = session.model or default
    for model in models:
        mark = "*" if model["id"] == (chosen or model["id"]) else " "
        notes = []
        if model["id"] == default and "default" in model:
            notes.append("server default")
        if "loaded" in model:  # a magnitude server says which models are in memory
            memory = (model.get("memory") or {}).get("resident")
            notes.append(
                f"loaded, {memory / 2**20:,.0f} MiB"
                if model["loaded"] and memory
                else "loaded"
                if model["loaded"]
                else "not loaded"
            )
        print(f"{mark} {model['id']}" + (f"  ({'; '.join(notes)})" if notes else ""))
    if session.model:
        mine = next((m for m in models if m["id"] == session.model), {})
        if mine.get("loaded") is False:  # unloaded since (keep_alive, or asked to): the next cell loads it
            print(
                f"(* this notebook's cells use {session.model}, not loaded now: their next request loads it "
                "again; %magnitude use NAME picks another)"
            )
        else:
            print(f"(* this notebook's cells use {session.model}: %magnitude use)")


def use(session: NotebookSession, args: Use) -> None:
    """Pick the model for the cells that follow; a magnitude server loads it now, not on the next cell."""
    client = session.client
    ours, _ = session.server_facts(client)
    if ours:
        print(f"magnitude: loading {args.model!r}...", end="", flush=True)
        loaded = session.call(lambda: client.load_model(args.model))
        took = f"loaded in {loaded['load_ms'] / 1000:.1f} s" if loaded.get("load_ms") else "already loaded"
        print(f"\rmagnitude: using model {loaded['id']!r} ({took})")
        session.model = loaded["id"]
        session.forget_facts()
        return
    session.model = args.model
    print(f"magnitude: using model {args.model!r}")


def connect(session: NotebookSession, args: Connect) -> None:
    client = Client(args.url, args.token, source="connect")
    session.call(client.models)
    session.connect(client)
    print(f"magnitude: connected to {client.api_base}")


def disconnect(session: NotebookSession) -> None:
    session.connect(None)
    print("magnitude: disconnected (the next call finds a server again)")
