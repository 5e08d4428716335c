"""`%magnitude status`, `list`, `use`, `connect` and `disconnect`: which server and model the
notebook's cells talk to."""

from __future__ import annotations

import json

from IPython.display import display

from ..client import Client
from .arguments import Connect, Use
from .session import NotebookSession


def status(session: NotebookSession) -> None:
    figures = session.call(session.client.status)
    display({"text/plain": json.dumps(figures, indent=2), "application/json": figures}, raw=True)


def list_models(session: NotebookSession) -> None:
    models = session.call(session.client.models)
    chosen = session.model or next((m["id"] for m in models if m.get("default")), None)
    for model in models:
        mark = "*" if model["id"] == (chosen or model["id"]) else " "
        resident = ""
        if "loaded" in model:  # a magnitude server says which models are in memory
            memory = (model.get("memory") or {}).get("resident")
            held = f", {memory / 2**20:,.0f} MiB" if memory else ""
            resident = f"  (loaded{held})" if model["loaded"] else "  (not loaded)"
        print(f"{mark} {model['id']}{resident}")


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
