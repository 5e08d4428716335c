"""Every workshop notebook runs on README command 1's install (`pip install .`): each module its cells
import is the standard library's, this package's, or one of its own dependencies'."""

from __future__ import annotations

import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import nbformat
import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", re.M)


def notebook_imports(path: Path) -> set[str]:
    nb = nbformat.read(path, as_version=4)
    found = set()
    for cell in nb.cells:
        if cell.cell_type == "code":
            found |= {(m.group(1) or m.group(2)).split(".")[0] for m in IMPORT.finditer(cell.source)}
    return found


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib: Python 3.11")
def test_every_notebook_imports_only_what_the_plain_install_brings():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = {Requirement(r).name.lower().replace("_", "-") for r in project["dependencies"]}
    by_module = packages_distributions()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for module in sorted(notebook_imports(path)):
            if module in sys.stdlib_module_names or module == "magnitude_jupyter":
                continue
            owners = {d.lower().replace("_", "-") for d in by_module.get(module, [])}
            assert owners & installed, f"{path.name} imports {module}, which `pip install .` does not bring"
