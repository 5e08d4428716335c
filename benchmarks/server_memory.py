"""What a server process holds before it serves: a context's sequences, and a schema checker's import.

1. llama.cpp keeps a logits row (vocabulary x 4 bytes) for every sequence a context is made with,
   and it is resident: RSS after loading the bundled model into a context of 8,192 cells with 16,
   80 (the default: parallel 16 + `prefix_cache_entries` 64) and 256 sequences, each in a fresh
   process.
2. Checking tool schemas: RSS and seconds of `import jsonschema` (with the format extras Jupyter
   installs) against `import fastjsonschema`, each in a fresh process.

    python benchmarks/server_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys

from _common import table

LOAD = """
import json, os, psutil
from magnitude_jupyter.engine.runner import LlamaRunner
from magnitude_jupyter.models.registry import bundled_model_path
before = psutil.Process(os.getpid()).memory_info().rss
runner = LlamaRunner(bundled_model_path(), n_ctx=8192, n_seq_max={n}, n_batch=512, n_threads=2)
print(json.dumps({{"mib": (psutil.Process(os.getpid()).memory_info().rss - before) / 2**20, "vocab": runner.n_vocab}}))
"""
IMPORT = """
import json, os, time, psutil
before, start = psutil.Process(os.getpid()).memory_info().rss, time.perf_counter()
import {module}
seconds = time.perf_counter() - start
print(json.dumps({{"mib": (psutil.Process(os.getpid()).memory_info().rss - before) / 2**20, "s": seconds}}))
"""


def fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    rows = []
    base = None
    for n in (16, 80, 256):
        got = fresh(LOAD.format(n=n))
        base = got["mib"] if base is None else base
        expected = (n - 16) * got["vocab"] * 4 / 2**20
        rows.append([n, f"{got['mib']:.0f}", f"{got['mib'] - base:+.0f}", f"{expected:+.0f}"])
    print("bundled model, 8,192 cells, one context; RSS growth of a fresh process over the load")
    print(table(["sequences", "RSS MiB", "vs 16", "logits rows (vocab x 4 B) vs 16"], rows))
    rows = []
    for module in ("jsonschema", "fastjsonschema"):
        got = fresh(IMPORT.format(module=module))
        rows.append([module, f"{got['mib']:.1f}", f"{got['s']:.2f}"])
    print(table(["import", "RSS MiB", "seconds"], rows))


if __name__ == "__main__":
    main()
