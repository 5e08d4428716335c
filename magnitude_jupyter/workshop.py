"""The workshop notebooks, shipped inside the package so that they are there after `pip install`."""

from __future__ import annotations

from pathlib import Path

PACKAGED = Path(__file__).resolve().parent / "notebooks"  # in the wheel (pyproject: force-include)
SOURCE = Path(__file__).resolve().parent.parent / "notebooks"  # in a source checkout (editable install)
COPY_FOLDER = "magnitude-workshop"  # where they are copied in a person's Jupyter root


def workshop_dir() -> Path:
    return PACKAGED if PACKAGED.is_dir() else SOURCE


def workshop_notebook(name: str) -> Path:
    """The notebook called `name` (e.g. `03_calibration.ipynb`); KeyError if there is none."""
    path = workshop_dir() / name
    if "/" in name or "\\" in name or not name.endswith(".ipynb") or not path.is_file():
        raise KeyError(name)
    return path
