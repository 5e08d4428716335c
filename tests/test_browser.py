"""JupyterLab with the Magnitude panel in a real browser (Debian chromium + playwright-core)."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

from .browser import SHOTS, require_browser, run_ui_test, running_lab
from .conftest import SECOND_MODEL

pytestmark = pytest.mark.model


@pytest.fixture
def lab(tmp_path, models_dir):
    require_browser()
    with running_lab(tmp_path, models_dir) as lab:
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.cells = [
            nbformat.v4.new_code_cell("%load_ext magnitude_jupyter"),
            nbformat.v4.new_code_cell("%%magnitude --max-tokens 48\nWrite a short poem about lighthouses."),
        ]
        nbformat.write(nb, lab["root"] / "demo.ipynb")
        yield lab


def test_labextension_is_installed_and_enabled():
    listing = subprocess.run(
        [sys.executable, "-m", "jupyterlab.labextensions", "list"], capture_output=True, text=True, timeout=60
    )
    line = next((ln for ln in (listing.stdout + listing.stderr).splitlines() if "magnitude-jupyter" in ln), "")
    assert "enabled" in line and "OK" in line, listing.stdout + listing.stderr


def test_panel_and_streaming_cell_in_a_real_browser(lab):
    # JupyterLab starts with no model in memory: the script loads the default from the panel's button,
    # runs a cell, then loads a second model beside it (the panel lists both and can show either).
    result = run_ui_test("panel.test.mjs", lab, SECOND_MODEL=SECOND_MODEL)
    assert result["ok"] and "tok/s" in result["status"]
    assert "ms llama_decode" in result["steps"] and "ms rest" in result["steps"]
    assert result["residents"] == 2 and result["shown"] == SECOND_MODEL
    assert (SHOTS / "jupyterlab-magnitude.png").stat().st_size > 10_000


SWEEP_CELL = "%magnitude calibrate --concurrency 1,2 --requests 2 --max-tokens 8 --no-probe --start"
MAP_CELL = (
    "%magnitude calibrate --pressure-map --concurrency 1,2 --contexts 128,256 --requests 2 --max-tokens 4 "
    "--warmup 0 --start"
)


def test_calibration_widget_fits_the_cell_survives_a_reload_and_draws_the_pressure_map(lab):
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
    # In the same lab (one start less): the widget's pressure map, its heatmaps drawn cell by cell.
    nb.cells = [nbformat.v4.new_code_cell("%load_ext magnitude_jupyter"), nbformat.v4.new_code_cell(MAP_CELL)]
    nbformat.write(nb, lab["root"] / "pressure.ipynb")
    result = run_ui_test("pressure-map.test.mjs", lab)
    assert result["ok"] and (SHOTS / "pressure-map.png").stat().st_size > 5_000
