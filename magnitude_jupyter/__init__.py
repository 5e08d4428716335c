"""magnitude-jupyter: a local-LLM inference service that lives inside Jupyter."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .server.extension import MagnitudeApp

    return [{"module": "magnitude_jupyter.server.extension", "app": MagnitudeApp}]


def __getattr__(name: str) -> Any:
    """`run_agent`, `discover` and `Client` for scripts, imported on first use (the package itself
    stays light for the server extension)."""
    if name == "run_agent":
        from .client.agent import run_agent

        return run_agent
    if name in ("discover", "Client"):
        from .client import http as client

        return getattr(client, name)
    raise AttributeError(f"module 'magnitude_jupyter' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext magnitude_jupyter`: register `%%magnitude` and `%magnitude`."""
    from .magics import load_ipython_extension as load

    load(ipython)
