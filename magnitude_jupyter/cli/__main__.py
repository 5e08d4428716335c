"""`python -m magnitude_jupyter.cli`: the `magnitude` command."""

from __future__ import annotations

import sys

from .main import main

sys.exit(main())
