"""JupyterLab in a real browser for the tests: the lab (a real `jupyter lab` with the extension and
its own settings folders), Debian's chromium, and the ui-tests scripts that drive it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
UI_TESTS = ROOT / "ui-tests"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SHOTS = ROOT / "docs"  # screenshots for the README, refreshed by every run


def browser_missing() -> list[str]:
    """What this machine lacks to run the browser tests (empty: nothing)."""
    missing = []
    if not Path(CHROMIUM).exists():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    if not shutil.which("npm"):
        missing.append("npm")
    return missing


def require_browser() -> None:
    """Skip where the browser is missing, or fail where MAGNITUDE_REQUIRE_BROWSER says it must be there;
    install the ui-tests' node packages once."""
    missing = browser_missing()
    if missing:
        if os.environ.get("MAGNITUDE_REQUIRE_BROWSER"):
            pytest.fail(f"the browser test needs {', '.join(missing)}")
        pytest.skip(f"the browser test needs {', '.join(missing)}")
    if not (UI_TESTS / "node_modules" / "playwright-core").exists():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=UI_TESTS, check=True, timeout=300)


@contextlib.contextmanager
def running_lab(folder: Path, models_dir: Path) -> Iterator[dict[str, Any]]:
    """`jupyter lab` on a free port with its notebooks under `folder / "root"`, settings of its own and
    the Magnitude extension (4 slots, 4,096 cells); the app exposed to the page as `window.jupyterapp`
    (JupyterLab's own switch for browser tests) so that scripts can run its commands."""
    (folder / "magnitude.yaml").write_text(f"models_dir: {models_dir}\n")
    root = folder / "root"
    root.mkdir()
    # Cells record when they ran (in the saved notebook's metadata): where a slow notebook spends it.
    tracker = folder / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text('{"recordTiming": true}')
    port, token = free_port(), "lab-test-token"
    log = (folder / "lab.log").open("wb")
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(folder / "runtime"),
        "JUPYTERLAB_WORKSPACES_DIR": str(folder / "workspaces"),
        "JUPYTERLAB_SETTINGS_DIR": str(folder / "settings"),
        "MAGNITUDE_CONFIG": str(folder / "magnitude.yaml"),
        "MAGNITUDE_RUNTIME_DIR": str(folder / "magnitude-runtime"),
    }
    for var in ("MAGNITUDE_URL", "MAGNITUDE_TOKEN"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.allow_root=True",
            "--LabApp.expose_app_in_browser=True",
            "--MagnitudeApp.parallel=4",
            "--MagnitudeApp.ctx_size=4096",
        ],
        env=env,
        stdout=log,  # a file, never a pipe: a lab that runs every notebook fills a pipe and then stops
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "magnitude/health", headers={"Authorization": f"token {token}"}).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            raise AssertionError(f"jupyter lab did not start: {(folder / 'lab.log').read_text(errors='replace')}")
        time.sleep(0.3)
    try:
        yield {"url": url, "token": token, "env": env, "root": root}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def shut_down_kernels(lab: dict[str, Any]) -> None:
    """End every kernel session of the lab (a notebook's kernel, and the engines it made, go with it)."""
    headers = {"Authorization": f"token {lab['token']}"}
    for session in httpx.get(lab["url"] + "api/sessions", headers=headers, timeout=30).json():
        httpx.delete(f"{lab['url']}api/sessions/{session['id']}", headers=headers, timeout=60)


def run_ui_test(script: str, lab: dict[str, Any], **env: str) -> dict[str, Any]:
    """Run one ui-tests script against the lab; its last stdout line is its JSON result."""
    SHOTS.mkdir(exist_ok=True)
    done = subprocess.run(
        ["node", script],
        cwd=UI_TESTS,
        capture_output=True,
        text=True,
        timeout=int(env.get("UI_TIMEOUT_MS", "540000")) // 1000 + 60,
        env={
            **lab["env"],
            "LAB_URL": lab["url"],
            "LAB_TOKEN": lab["token"],
            "SCREENSHOT_DIR": str(SHOTS),
            "CHROMIUM": CHROMIUM,
            **env,
        },
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
