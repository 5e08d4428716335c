"""magnitude-jupyter: a local-LLM inference service that lives inside Jupyter."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .server.extension import MagnitudeApp

    return [{"module": "magnitude_jupyter.server.extension", "app": MagnitudeApp}]


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext magnitude_jupyter`: register `%%magnitude` and `%magnitude`."""
    from .magics import load_ipython_extension as load

    load(ipython)
