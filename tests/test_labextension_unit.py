"""The lab extension's logic, tested with jest (its node_modules come with the package build)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

LABEXTENSION = Path(__file__).resolve().parent.parent / "labextension"


def test_jest_suite_passes():
    if not (LABEXTENSION / "node_modules" / ".bin" / "jest").exists():
        if not shutil.which("npm"):
            pytest.skip("npm is needed for the lab extension's jest tests")
        subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=LABEXTENSION, check=True, timeout=600)
    done = subprocess.run(["npm", "test", "--", "--ci"], cwd=LABEXTENSION, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Tests:" in done.stderr + done.stdout
