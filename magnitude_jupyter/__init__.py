"""magnitude-jupyter: a local-LLM inference service that lives inside Jupyter."""

from __future__ import annotations

__version__ = "0.1.0"
