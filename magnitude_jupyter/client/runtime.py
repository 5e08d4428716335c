"""Where running servers announce themselves on this machine, and one way to start `magnitude serve`.

`magnitude serve` writes `serve-<port>.json` (url, token, pid; mode 0600) into the runtime folder
and removes it on shutdown; Jupyter servers write `jpserver-<pid>.json` into theirs. Clients read
both to find a server, and `LocalServer` starts one in a child process (for a kernel that finds
none, for the tests and for the benchmarks) and returns once its model is loaded.

Nothing here imports tornado or the engine: every kernel that looks for a server imports this.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a child server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def runtime_dir() -> Path:
    return Path(os.environ.get("MAGNITUDE_RUNTIME_DIR") or Path.home() / ".magnitude" / "runtime")


def write_runtime_file(host: str, port: int, token: str | None, model: str) -> Path:
    """Where clients on this machine find the server and its token; readable by this user only."""
    folder = runtime_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    path = folder / f"serve-{port}.json"
    url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    info = {"url": f"http://{url_host}:{port}", "token": token, "pid": os.getpid(), "model": model}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(info, fh)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_runtime_files(folder: Path, pattern: str) -> list[dict[str, Any]]:
    """The runtime files in `folder` whose process still runs, newest first."""
    found = []
    for path in sorted(folder.glob(pattern), key=os.path.getmtime, reverse=True):
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(path.read_text())
            if _alive(int(info.get("pid", 0))):
                found.append(info)
    return found


def serve_runtime_files() -> list[dict[str, Any]]:
    return live_runtime_files(runtime_dir(), "serve-*.json")


def jupyter_servers() -> list[dict[str, Any]]:
    from jupyter_core.paths import jupyter_runtime_dir

    return live_runtime_files(Path(jupyter_runtime_dir()), "jpserver-*.json")


class ServerStartError(RuntimeError):
    pass


STALL_SECONDS = 120.0  # a start that makes no progress for this long has failed


class _Progress:
    """Whether a starting server is getting anywhere: what it says it is doing changed, or its
    process spent CPU time, within `stall_timeout` seconds."""

    def __init__(self, pid: int, stall_timeout: float, on_progress: Callable[[str], None] | None) -> None:
        self.stall_timeout = stall_timeout
        self.on_progress = on_progress
        self.started = self.moved = time.monotonic()
        self._seen: str | None = None
        self._phase: str | None = None
        try:
            import psutil

            self._process: Any = psutil.Process(pid)
        except Exception:  # gone already: check() says so through the exit status
            self._process = None
        self._cpu = self._cpu_seconds()

    def _cpu_seconds(self) -> float:
        try:
            times = self._process.cpu_times() if self._process is not None else None
            return (times.user + times.system) if times is not None else 0.0
        except Exception:
            return 0.0

    def saw(self, state: str, phase: str | None = None) -> None:
        if state != self._seen:
            self._seen, self.moved = state, time.monotonic()
        phase = phase or state
        if phase != self._phase:
            self._phase = phase
            if self.on_progress is not None:
                self.on_progress(phase)

    def check(self, phase: str) -> None:
        now = time.monotonic()
        cpu = self._cpu_seconds()
        if cpu > self._cpu + 0.05:  # the process is working: imports, a context being made
            self._cpu, self.moved = cpu, now
        if now - self.moved > self.stall_timeout:
            raise ServerStartError(
                f"magnitude serve made no progress for {self.stall_timeout:.0f} s while {phase} "
                f"({now - self.started:.0f} s after it started)"
            )


class LocalServer:
    """`magnitude serve` in a child process on a free port; returns once its model is loaded.

    `config` (YAML text) and a fresh runtime folder isolate it from the user's own settings; without
    them it reads the user's config and announces itself where kernels look. `detached` servers
    outlive this process (a kernel's background server, reused by later kernels).

    It waits as long as the start makes progress: the server says what its load is doing (`/health`'s
    phase), or its process keeps working (CPU time), so a busy machine only makes the wait longer.
    `stall_timeout` seconds without either is an error that says what it was doing; `on_progress`
    is told each new phase.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        token: str | None = None,
        config: str | None = None,
        detached: bool = False,
        log: IO[bytes] | int | None = subprocess.DEVNULL,
        stall_timeout: float = STALL_SECONDS,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        env = dict(os.environ)
        if config is not None:
            self._tmp = tempfile.TemporaryDirectory(prefix="magnitude-serve-")
            folder = Path(self._tmp.name)
            (folder / "config.yaml").write_text(config)
            env |= {"MAGNITUDE_CONFIG": str(folder / "config.yaml"), "MAGNITUDE_RUNTIME_DIR": str(folder / "runtime")}
        env.pop("MAGNITUDE_URL", None)
        # `python -m` would put the caller's working directory first on the server's import path: a
        # notebook folder's own `yaml.py`, or a checkout's package over the one PYTHONPATH names
        # (Python 3.11+; 3.10 ignores it).
        env["PYTHONSAFEPATH"] = "1"
        if token is not None:
            env.pop("MAGNITUDE_TOKEN", None)
        self.runtime = Path(env.get("MAGNITUDE_RUNTIME_DIR") or runtime_dir())
        cmd = [sys.executable, "-m", "magnitude_jupyter.cli", "serve", "--port", "0", *args]
        if token is not None:
            cmd += ["--token", token]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=detached
        )
        self._progress = _Progress(self.proc.pid, stall_timeout, on_progress)
        try:
            info = self._wait_for_runtime_file()
            self.url: str = info["url"]
            self.token: str | None = info.get("token")
            self.port = int(self.url.rsplit(":", 1)[1])
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    @property
    def runtime_file(self) -> Path:
        return self.runtime / f"serve-{self.port}.json"

    def _wait_for_runtime_file(self) -> dict[str, Any]:
        self._progress.saw("starting")
        while True:
            for info in live_runtime_files(self.runtime, "serve-*.json"):
                if info.get("pid") == self.proc.pid:
                    return info
            if self.proc.poll() is not None:
                raise ServerStartError(f"magnitude serve exited with status {self.proc.returncode}")
            self._progress.check("starting")
            time.sleep(0.1)

    def _wait_healthy(self) -> None:
        # Imported here, not at the top: `magnitude serve` imports this module for its runtime file and
        # never uses an HTTP client.
        import httpx

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        phase = "loading the model"
        while True:
            with contextlib.suppress(httpx.TransportError, ValueError):
                response = httpx.get(f"{self.url}/health", headers=headers, timeout=5)
                if response.status_code == 200:
                    return
                if response.status_code != 503:
                    raise ServerStartError(f"magnitude serve answered /health with {response.status_code}")
                body = response.json()
                if body.get("status") == "failed":
                    raise ServerStartError(f"magnitude serve could not load its model: {body.get('error')}")
                phase = body.get("phase") or phase
                self._progress.saw(f"{phase} #{body.get('progress')}", phase)
            if self.proc.poll() is not None:
                raise ServerStartError(f"magnitude serve exited with status {self.proc.returncode}")
            self._progress.check(phase)
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM (the server shuts its engine down and removes its runtime file), then SIGKILL if need be."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.left_runtime_file = hasattr(self, "port") and self.runtime_file.exists()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
