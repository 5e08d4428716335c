"""JupyterLab with the Magnitude panel in a real browser (Debian chromium + playwright-core)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nbformat
import pytest

from .conftest import SECOND_MODEL, free_port

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parent.parent
UI_TESTS = ROOT / "ui-tests"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def require_browser() -> None:
    missing = []
    if not Path(CHROMIUM).exists():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    if not shutil.which("npm"):
        missing.append("npm")
    if missing:
        if os.environ.get("MAGNITUDE_REQUIRE_BROWSER"):
            pytest.fail(f"the browser test needs {', '.join(missing)}")
        pytest.skip(f"the browser test needs {', '.join(missing)}")
    if not (UI_TESTS / "node_modules" / "playwright-core").exists():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=UI_TESTS, check=True, timeout=300)


@pytest.fixture
def lab(tmp_path, models_dir):
    require_browser()
    (tmp_path / "magnitude.yaml").write_text(f"models_dir: {models_dir}\n")
    root = tmp_path / "root"
    root.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext magnitude_jupyter"),
        nbformat.v4.new_code_cell("%%magnitude --max-tokens 48\nWrite a short poem about lighthouses."),
    ]
    nbformat.write(nb, root / "demo.ipynb")
    port, token = free_port(), "lab-test-token"
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
        "MAGNITUDE_CONFIG": str(tmp_path / "magnitude.yaml"),
        "MAGNITUDE_RUNTIME_DIR": str(tmp_path / "magnitude-runtime"),
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
            "--MagnitudeApp.parallel=4",
            "--MagnitudeApp.ctx_size=4096",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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
            raise AssertionError(f"jupyter lab did not start: {proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.3)
    yield {"url": url, "token": token, "env": env, "root": root}
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_labextension_is_installed_and_enabled():
    listing = subprocess.run(
        [sys.executable, "-m", "jupyterlab.labextensions", "list"], capture_output=True, text=True, timeout=60
    )
    line = next((ln for ln in (listing.stdout + listing.stderr).splitlines() if "magnitude-jupyter" in ln), "")
    assert "enabled" in line and "OK" in line, listing.stdout + listing.stderr


SHOTS = ROOT / "docs"  # screenshots for the README, refreshed by every run


def run_ui_test(script: str, lab: dict, **env: str) -> dict:
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
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_panel_and_streaming_cell_in_a_real_browser(lab):
    # JupyterLab starts with no model in memory: the script loads the default from the panel's button,
    # runs a cell, then loads a second model beside it (the panel lists both and can show either).
    result = run_ui_test("panel.test.mjs", lab, SECOND_MODEL=SECOND_MODEL)
    assert result["ok"] and "tok/s" in result["status"]
    assert "ms llama_decode" in result["steps"] and "ms rest" in result["steps"]
    assert result["residents"] == 2 and result["shown"] == SECOND_MODEL
    assert (SHOTS / "jupyterlab-magnitude.png").stat().st_size > 10_000


SWEEP_CELL = "%magnitude calibrate --concurrency 1,2 --requests 2 --max-tokens 8 --no-probe --start"


def test_calibration_widget_fits_the_cell_and_survives_a_reload(lab):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext magnitude_jupyter"),
        nbformat.v4.new_code_cell(SWEEP_CELL),
        nbformat.v4.new_code_cell("import ipywidgets as w\nw.IntSlider(3)"),
    ]
    nbformat.write(nb, lab["root"] / "widget.ipynb")
    result = run_ui_test("widget.test.mjs", lab)
    assert result["ok"] and (SHOTS / "calibration-widget.png").stat().st_size > 5_000


# The notebook whose page once showed two verdicts runs in every CI; all of them with
# MAGNITUDE_BROWSER_NOTEBOOKS=all (each runs for minutes, beside the kernel-only run of test_workshop.py).
WORKSHOP = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
IN_BROWSER = WORKSHOP if os.environ.get("MAGNITUDE_BROWSER_NOTEBOOKS") == "all" else ["03_calibration"]


@pytest.mark.parametrize("name", IN_BROWSER)
def test_a_workshop_notebook_as_a_participant_sees_it(lab, name):
    shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", lab["root"] / f"{name}.ipynb")
    result = run_ui_test("notebook.test.mjs", lab, NOTEBOOK=f"{name}.ipynb", UI_TIMEOUT_MS="1500000")
    assert result["ok"] and result["tracebacks"] == result["widgetErrors"] == 0 and result["wide"] == []
    if name.startswith("03"):  # one verdict per page: the widget's compares itself with the cell's run
        assert result["verdict"].startswith("This run: knee") and "the cell's run" in result["verdict"], result
